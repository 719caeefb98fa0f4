"""Read pytest-benchmark JSON from `pytest bench/ --benchmark-json FILE`, print markdown tables, draw a PNG.

    python -m bench.summarize results.json [more.json ...] [--out DIR]
    python bench/summarize.py results.json --out DIR

Tables: real tokens/s per grid cell and variant; the ratios fastbert / hf-sdpa, / hf-eager, / hf-compile per cell
(a ratio > 1 means fastbert is faster; same tokens, so it is also the inverse time ratio); torch.compile's compile
times; the per-op figures (TFLOP/s, GB/s, share of the measured device ceilings). With --out DIR it writes
DIR/summary.md and DIR/tokens_per_s.png (the plot only when matplotlib is importable; the table always).
Needs only the standard library (and matplotlib for the plot): it runs where the results are, not where torch is.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

VARIANTS = ("fastbert-triton", "fastbert-graphs", "fastbert-torch", "hf-eager", "hf-sdpa", "hf-compile")
FASTBERT = ("fastbert-triton", "fastbert-graphs", "fastbert-torch")
BASELINES = ("hf-sdpa", "hf-eager", "hf-compile")


def load(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """All benchmarks of all files, and per file its date and the environment conftest recorded."""
    benchmarks, meta = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        benchmarks += data.get("benchmarks", [])
        meta.append({"path": path, "datetime": data.get("datetime"),
                     "env": (data.get("machine_info") or {}).get("fastbert_bench") or {}})
    return benchmarks, meta


def _median(bench: dict) -> float | None:
    stats = bench.get("stats") or {}
    return stats.get("median")


def _per_call(bench: dict) -> float:
    """An op benchmark's round is `calls_per_round` calls (see bench/test_bench_ops.py): seconds per call."""
    return _median(bench) / (bench.get("extra_info") or {}).get("calls_per_round", 1)


def model_cells(benchmarks: list[dict]) -> dict:
    """(model, cell, dtype, device) -> {"real_tokens", "padded_tokens", "variants": {variant: figures}} in run order."""
    cells: dict = {}
    for b in benchmarks:
        info = b.get("extra_info") or {}
        median = _median(b)
        if info.get("kind") != "model" or not median:
            continue
        key = (info["model"], info["cell"], info["dtype"], info["device"])
        cell = cells.setdefault(key, {"real_tokens": info["real_tokens"], "padded_tokens": info["padded_tokens"],
                                      "variants": {}})
        cell["variants"][info["variant"]] = {
            "median_s": median,
            "tokens_per_s": info["real_tokens"] / median,  # recomputed from the median, not trusted from extra_info
            "padded_tokens_per_s": info["padded_tokens"] / median,
            "compile_s": info.get("compile_s"),
            "max_abs_err": info.get("max_abs_err"),
        }
    return cells


def ratios(cells: dict) -> list[dict]:
    """One row per (cell, fastbert variant present): its speed-up over each baseline present."""
    rows = []
    for key, cell in cells.items():
        variants = cell["variants"]
        for fast in FASTBERT:
            if fast not in variants:
                continue
            row = {"key": key, "variant": fast, "tokens_per_s": variants[fast]["tokens_per_s"],
                   "median_s": variants[fast]["median_s"]}
            for base in BASELINES:
                if base in variants:
                    row[base] = variants[fast]["tokens_per_s"] / variants[base]["tokens_per_s"]
            rows.append(row)
    return rows


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _fmt_num(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 1 else f"{x:.2g}"


def _fmt_ratio(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}×"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def model_tables(cells: dict) -> str:
    if not cells:
        return ""
    present = [v for v in VARIANTS if any(v in c["variants"] for c in cells.values())]
    out = ["### Whole model: real tokens/s (median round; padding excluded)", ""]
    rows = []
    for (model, cell, dtype, device), c in cells.items():
        rows.append([model, cell, dtype, device, f"{c['real_tokens']:,}", f"{c['padded_tokens']:,}"]
                    + [_fmt_rate(c["variants"].get(v, {}).get("tokens_per_s")) for v in present])
    out.append(_table(["model", "batch×seq", "dtype", "device", "real tok", "padded tok"] + present, rows))
    ratio_rows = ratios(cells)
    if ratio_rows:
        bases = [b for b in BASELINES if any(b in r for r in ratio_rows)]
        out += ["", "### Ratios (fastbert tokens/s ÷ baseline tokens/s; > 1 = fastbert faster)", ""]
        rows = [[*map(str, r["key"]), r["variant"], _fmt_rate(r["tokens_per_s"])]
                + [_fmt_ratio(r.get(b)) for b in bases]
                for r in ratio_rows]
        out.append(_table(["model", "batch×seq", "dtype", "device", "variant", "tok/s"] + [f"÷ {b}" for b in bases],
                          rows))
    compiled = [(k, c["variants"]["hf-compile"]["compile_s"]) for k, c in cells.items()
                if c["variants"].get("hf-compile", {}).get("compile_s") is not None]
    if compiled:
        out += ["", "### torch.compile (HF sdpa): compile time, never inside the timed rounds", ""]
        out.append(_table(["model", "batch×seq", "dtype", "device", "first call (compile) s"],
                          [[*map(str, k), f"{s:.1f}"] for k, s in compiled]))
    return "\n".join(out)


def op_table(benchmarks: list[dict]) -> str:
    ops = [b for b in benchmarks if (b.get("extra_info") or {}).get("kind") == "op" and _median(b)]
    if not ops:
        return ""
    by_key = {}
    for b in ops:
        info = b["extra_info"]
        by_key.setdefault((info["op"], info["shape"], info["dtype"]), {})[info["backend"]] = b
    rows = []
    for (op, shape, dtype), backends in by_key.items():
        for backend, b in sorted(backends.items(), reverse=True):  # triton first
            info, median = b["extra_info"], _per_call(b)
            tflops = info["flops"] / median / 1e12 if info.get("flops") else None
            gbps = info["bytes"] / median / 1e9 if info.get("bytes") else None
            ceil = info.get("ceilings") or {}
            if info.get("bound") == "memory" and gbps and ceil.get("copy_GBps"):
                share = f"{100 * gbps / ceil['copy_GBps']:.0f}% of copy"
            elif tflops and ceil.get("gemm_TFLOPs"):
                share = f"{100 * tflops / ceil['gemm_TFLOPs']:.0f}% of GEMM"
            else:
                share = "–"
            other, cublas = backends.get("torch"), backends.get("cublas")
            speedup = _per_call(other) / median if backend == "triton" and other else None
            vs_cublas = _per_call(cublas) / median if backend == "triton" and cublas else None
            rows.append([op, shape, dtype, backend, f"{median * 1e6:.1f}", _fmt_num(tflops), _fmt_num(gbps), share,
                         _fmt_ratio(speedup), _fmt_ratio(vs_cublas)])
    return "\n".join(["### Ops: Triton vs torch twin and plain cuBLAS GEMM (median)", "",
                      _table(["op", "shape", "dtype", "backend", "µs", "TFLOP/s", "GB/s", "vs ceiling",
                              "triton speed-up", "x cuBLAS"], rows)])


def conditions(meta: list[dict]) -> str:
    lines = []
    for m in meta:
        env = m["env"]
        if not env:
            continue
        hw = env.get("gpu") or f"CPU {env.get('cpu')} ({env.get('torch_threads')} threads)"
        line = (f"- {os.path.basename(m['path'])}: {m.get('datetime') or env.get('date')}, {hw}, "
                f"torch {env.get('torch')}, triton {env.get('triton')}, transformers {env.get('transformers')}")
        ceil = env.get("ceilings")
        if ceil:
            line += (f"; measured ceilings: copy {ceil['copy_GBps']:.0f} GB/s, {ceil['gemm']} GEMM "
                     f"{ceil['gemm_TFLOPs']:.1f} TFLOP/s")
        if env.get("TRITON_INTERPRET") not in (None, "", "0"):
            line += "; TRITON_INTERPRET=1 (interpreter: Triton timings are meaningless)"
        lines.append(line)
    return "\n".join(["### Conditions", ""] + lines) if lines else ""


def ab_table(benchmarks: list[dict]) -> str:
    """The interleaved A/B runs (bench/test_bench_ab.py): per-variant medians from alternating rounds, against the
    HF variant each run names (hf-sdpa, or hf-eager for a family without sdpa; runs before it was named: hf-sdpa)."""
    rows = []
    for b in benchmarks:
        info = b.get("extra_info") or {}
        baseline = info.get("baseline", "hf-sdpa")
        ratio = f"ratio_fastbert_over_{baseline.replace('-', '_')}"
        if info.get("kind") != "ab" or ratio not in info:
            continue
        rows.append([info["model"], info["cell"], info["dtype"], info["device"], str(info["rounds"]),
                     _fmt_num(info["fastbert-torch_tokens_per_s"]), baseline,
                     _fmt_num(info[f"{baseline}_tokens_per_s"]), _fmt_ratio(info[ratio])])
    if not rows:
        return ""
    return "\n".join(["### Interleaved A/B (alternating rounds; real tokens/s, median)", "",
                      _table(["model", "batch×seq", "dtype", "device", "rounds", "fastbert-torch", "HF variant",
                              "HF", "fastbert ÷ HF"], rows)])


def encode_table(benchmarks: list[dict]) -> str:
    """Corpus embedding (bench/test_bench_encode.py): fastbert.encode and SentenceTransformer.encode, alternating."""
    rows = []
    for b in benchmarks:
        info = b.get("extra_info") or {}
        if info.get("kind") != "encode" or "ratio_fastbert_over_sentence_transformers" not in info:
            continue
        computed = info.get("computed_tokens") or {}
        rows.append([info["model"], info["dtype"], info["device"], f"{info['texts']} / {info['real_tokens']}",
                     str(info["rounds"]), _fmt_num(info["fastbert_texts_per_s"]),
                     _fmt_num(info["sentence-transformers_texts_per_s"]),
                     _fmt_ratio(info["ratio_fastbert_over_sentence_transformers"]),
                     f"{computed.get('fastbert', '-')} / {computed.get('sentence-transformers', '-')}"])
    if not rows:
        return ""
    return "\n".join(["### Encoding a corpus (alternating rounds; texts/s, median)", "",
                      _table(["model", "dtype", "device", "texts / real tokens", "rounds", "fastbert",
                              "sentence-transformers", "fastbert ÷ s-t", "tokens computed (fastbert / s-t)"],
                             rows)])


def render(benchmarks: list[dict], meta: list[dict]) -> str:
    parts = [conditions(meta), encode_table(benchmarks), ab_table(benchmarks), model_tables(model_cells(benchmarks)),
             op_table(benchmarks)]
    return "\n\n".join(p for p in parts if p) + "\n"


def plot(cells: dict, path: str) -> str | None:
    """Bars of real tokens/s per cell, one colour per variant, one panel per (model, dtype, device). Returns None
    on success, else why no plot was drawn."""
    if not cells:
        return "no whole-model results to plot"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"matplotlib is not importable ({e}); the table was still written"
    panels: dict = {}
    for (model, cell, dtype, device), c in cells.items():
        panels.setdefault((model, dtype, device), []).append((cell, c["variants"]))
    present = [v for v in VARIANTS if any(v in c["variants"] for c in cells.values())]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 1.6 * max(len(p) for p in panels.values()) + 2),
                                                       3.6 * len(panels)), squeeze=False)
    width = 0.8 / len(present)
    for ax, ((model, dtype, device), entries) in zip(axes[:, 0], panels.items()):
        for i, variant in enumerate(present):
            xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(entries))]
            ys = [v.get(variant, {}).get("tokens_per_s", 0.0) for _, v in entries]
            ax.bar(xs, ys, width, label=variant)
        ax.set_xticks(range(len(entries)), [cell for cell, _ in entries])
        rates = [v["tokens_per_s"] for _, vs in entries for v in vs.values() if v.get("tokens_per_s")]
        if rates and max(rates) > 20 * min(rates):  # 1x128 next to 32x512: a log axis, else bars from zero
            ax.set_yscale("log")
            ax.set_ylim(bottom=min(rates) / 2)
        ax.set_ylabel("real tokens/s")
        ax.set_title(f"{model}, {dtype}, {device}")
        ax.grid(axis="y", which="both", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(present), fontsize="small", frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.6 * len(panels))))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="pytest-benchmark JSON file(s) (--benchmark-json)")
    parser.add_argument("--out", help="folder for summary.md and tokens_per_s.png")
    args = parser.parse_args(argv)
    paths = [p for p in args.json if os.path.exists(p)]
    missing = sorted(set(args.json) - set(paths))
    if missing:
        print(f"summarize: skipping missing file(s): {', '.join(missing)}", file=sys.stderr)
    if not paths:
        print("summarize: no JSON to read", file=sys.stderr)
        return 1
    benchmarks, meta = load(paths)
    text = render(benchmarks, meta)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(text)
        why_not = plot(model_cells(benchmarks), os.path.join(args.out, "tokens_per_s.png"))
        if why_not:
            print(f"summarize: no plot: {why_not}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
