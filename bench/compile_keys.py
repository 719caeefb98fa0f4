"""What a cold GPU compiles: the JIT keys of the launches a step makes, modelled as Triton 3.6 builds them.

Triton compiles a kernel once per key and keeps the binary on disk (~/.triton/cache), so a second process with the
same key only loads it. On a machine that has never run fastbert every distinct key is a fresh compile: about 1-6 s
each (the ahead-of-time compile of the slowest kernel here takes ~3 s per config). The key of one launch is

    (kernel, specialization of each argument, the launch options)

  - a constexpr argument: its value;
  - a tensor: its element type, and whether its address is a multiple of 16 ("D");
  - an integer: i32 / i64 / u64 by range, and unless the kernel lists it in `do_not_specialize`: whether it is a
    multiple of 16 ("D"), and the value 1 becomes the constant 1;
  - None: the constant None; a float: fp32; a bool: u1;
  - the options: every launch keyword that is not an argument (num_warps, num_stages, maxnreg, ...).

This is Triton 3.6's `create_function_from_signature` + `native_specialize_impl` + `compute_cache_key`
(triton/runtime/jit.py), restated so that it can run where Triton cannot launch (the CPU); tests/kernels/
test_compile_keys.py checks it against Triton's own binder for every kernel fastbert launches.

An autotuned launch compiles every config its prune keeps, the first time its autotune key is met on the machine
(Triton's on-disk autotune cache then remembers the winner, whose binary is already there).

`Launches` intercepts Triton's launch entry points (JITFunction.run, Autotuner.run) and either records the keys
without launching anything ("record": on a CPU, under `pretend_sm90`, to count what the GPU will compile) or compiles
them without launching (`warmup`: on the GPU, in a background process, so that the foreground finds them on disk).
`job_keys` runs one job of bench/gpu_check.py (a smoke list, a model's forward on a cell, a config sweep) that way.

    python -m bench.compile_keys --estimate                 every job of bench/gpu_check.py's plan, into
                                                            bench/compile_keys.json (the plan's compile estimate)
    python -m bench.compile_keys OUT.json JOB [JOB ...]      record the keys of the jobs given (CPU; no GPU needed)
"""
from __future__ import annotations

import contextlib
import json
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DTYPE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.bool: "u1"}


def _divisibility(value: int, specialize: bool, align: bool):
    """The second field: None when not specialised at all, "D" for a multiple of 16, "" otherwise."""
    if not specialize:
        return None
    return "D" if align and value % 16 == 0 else ""


def _specialize(param, value) -> tuple:
    """One argument's entry in the key (see the module docstring)."""
    if param.is_constexpr:
        return ("constexpr", value)
    specialize = not param.do_not_specialize
    align = not param.do_not_specialize_on_alignment
    if value is None:
        return ("constexpr", None)
    if isinstance(value, bool):
        return ("u1", None)
    if isinstance(value, int):
        if specialize and value == 1:
            return ("constexpr", 1)
        kind = "i32" if -2 ** 31 <= value < 2 ** 31 else ("u64" if value >= 2 ** 63 else "i64")
        return (kind, _divisibility(value, specialize, align))
    if isinstance(value, float):
        return ("fp32", None)
    if hasattr(value, "data_ptr"):
        kind = ("*k" if param.is_const else "*") + _DTYPE[value.dtype]
        return (kind, _divisibility(value.data_ptr(), specialize, align))
    raise TypeError(f"no key model for an argument of type {type(value).__name__} ({param.name})")


def launch_key(fn, args, kwargs) -> tuple:
    """The JIT key of `fn.run(*args, **kwargs)` (a triton.JITFunction): (kernel name, specialization, options)."""
    names = [p.name for p in fn.params]
    values = dict(zip(names, args))
    values.update({k: v for k, v in kwargs.items() if k in names})
    spec = []
    for p in fn.params:
        if p.name in values:
            value = values[p.name]
        elif p.has_default:
            value = p.default
        else:
            raise TypeError(f"{fn.__name__}: missing argument {p.name!r}")
        spec.append(_specialize(p, value))
    options = tuple((k, v) for k, v in kwargs.items() if k not in names and k not in ("grid", "warmup"))
    return (fn.__name__, tuple(spec), options)


def triton_key(fn, args, kwargs, arch: int = 90) -> tuple:
    """The same launch's (specialization, options) as the installed Triton's own binder computes them for a CUDA
    target of compute capability `arch` (no GPU needed): what `launch_key` is checked against. JITFunction.run adds
    `debug` and `instrumentation_mode` to the options before binding; they are the same for every launch of a
    process, so the model leaves them out, and so does this."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    _, specialization, options = binder(*args, **{k: v for k, v in kwargs.items() if k not in ("grid", "warmup")})
    return tuple(tuple(s) for s in specialization), tuple(options.items())


def key_text(key: tuple) -> str:
    """A key as one stable line (for files and for counting distinct keys across processes)."""
    name, spec, options = key
    return f"{name}|{spec!r}|{options!r}"


# --------------------------------------------------------------------------------------------------------------------
# Intercepting launches
# --------------------------------------------------------------------------------------------------------------------
class Launches:
    """A context that catches every Triton launch in this process. mode "record": nothing is compiled or launched
    (kernel outputs stay as allocated); "warmup": each key is compiled (JITFunction.warmup: no launch), only where
    `mine(key)` says so (a background worker's share). `keys` lists the distinct keys in the order first met."""

    def __init__(self, mode: str = "record", mine=None, keep_calls: bool = False):
        if mode not in ("record", "warmup"):
            raise ValueError(f"mode must be 'record' or 'warmup', got {mode!r}")
        self.mode, self.mine = mode, mine
        self.calls: list | None = [] if keep_calls else None  # (fn, args, kwargs) of every launch, for the tests
        self.keys: list = []
        self._seen: set = set()
        self._stack = contextlib.ExitStack()

    def _met(self, fn, args, kwargs, original) -> None:
        if self.calls is not None:
            self.calls.append((fn, args, dict(kwargs)))
        key = launch_key(fn, args, kwargs)
        text = key_text(key)
        if text not in self._seen:
            self._seen.add(text)
            self.keys.append(text)
            if self.mode == "warmup" and (self.mine is None or self.mine(text)):
                run_kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
                original(fn, *args, grid=(1,), warmup=True, **run_kwargs)

    def __enter__(self):
        from triton.runtime import autotuner, jit

        original = jit.JITFunction.run
        launches = self

        def run(fn, *args, grid=None, warmup=False, **kwargs):
            launches._met(fn, args, kwargs, original)
            return None

        def tune(tuner, *args, **kwargs):
            tuner.nargs = dict(zip(tuner.arg_names, args))
            configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
            for config in configs:
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
            tuner.nargs = None
            return None

        self._stack.enter_context(_patched(jit.JITFunction, "run", run))
        self._stack.enter_context(_patched(autotuner.Autotuner, "run", tune))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return False


@contextlib.contextmanager
def _patched(owner, name, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def pretend_sm90(sms: int = 132):
    """The launch path as an H200 takes it, on CPU tensors: the kernels count as runnable on this device, the GEMM
    picks its TMA kernel where the layout allows and sizes its persistent grid by `sms`. Only for `Launches("record")`
    (nothing can run): the kernels must be imported without TRITON_INTERPRET, so that they are JITFunctions."""
    from fastbert.kernels import gemm, utils

    if utils.INTERPRET:
        raise RuntimeError("pretend_sm90 needs the compiled kernels: unset TRITON_INTERPRET")

    def num_programs(device, M, N, block_m, block_n):
        return max(1, min(sms, -(-M // block_m) * -(-N // block_n)))

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(utils, "device_unsupported", lambda device: None))
        stack.enter_context(_patched(gemm, "use_tma", gemm.tma_compatible))
        stack.enter_context(_patched(gemm, "num_programs", num_programs))
        yield


# --------------------------------------------------------------------------------------------------------------------
# Jobs: what one step of bench/gpu_check.py launches
# --------------------------------------------------------------------------------------------------------------------
def job_keys(job: str, rows: int | None = None) -> list:
    """The keys (key_text) job `job` launches, in order:
      smoke:DTYPE              the kernel-variant smoke list at its GPU sizes (bench/gpu_check.py KernelChecks)
      smoke-backward:DTYPE     each train_kernel's forward and backward, every variant (KernelChecks.smoke_backward)
      configs:FAMILY           every autotune config of a family (KernelChecks.every_config)
      forward:MODEL:CELL:DTYPE one forward of that benchmark model on that cell on the kernels (bench/harness.py)
      invariant:MODEL:CELL:DTYPE the same forward inside fastbert.batch_invariant (the tiles the server pins)
      train:MODEL:CELL:DTYPE   one fine-tuning step (forward in train mode, backward, AdamW) of that training model
                               on that cell on the kernels (bench/harness.py, TRAIN_MODELS), recorded on
                               RECORD_TRAIN_ROWS of the cell's rows
    rows: a forward or training job on that many of its cell's rows (`fewer_rows`)."""
    with Launches("record") as launches, pretend_sm90(), torch.inference_mode(), SkipProducts():
        run_job(job, rows=rows if rows is not None or not job.startswith("train:") else RECORD_TRAIN_ROWS)
    return launches.keys


class SkipProducts(TorchDispatchMode):
    """torch's matrix products return uninitialised tensors of their result's shape, dtype and strides instead of
    computing: what recording a training job needs (its launches depend on shapes, dtypes and alignment, never on
    values), without a BERT-base backward's GEMMs in bf16 on a CPU, over half an hour a step on this CPU."""

    PRODUCTS = ("mm", "addmm", "bmm", "baddbmm")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ not in self.PRODUCTS or "out" in kwargs:
            return func(*args, **kwargs)
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        on_meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
        shaped = func(*on_meta, **kwargs)
        return torch.empty_strided(shaped.shape, shaped.stride(), dtype=shaped.dtype, device=device)


# A training job is recorded on this many of its cell's rows, the longest among them: its GEMMs' and attention's keys
# depend on the token count only through buckets (the GEMMs' M_BUCKET prunes tiles taller than the tokens; attention's
# seq_bucket, the longest row), which a few rows holding the longest already reach, while a BERT-base step in bf16 on
# all 32 rows is over half an hour of bf16 GEMMs on this CPU (tests/kernels/test_compile_keys.py checks the keys agree).
RECORD_TRAIN_ROWS = 4


def fewer_rows(batch, labels, rows: int):
    """`rows` rows of a bench batch, the longest first (so the padded width and the longest row are the cell's)."""
    from bench import harness

    order = batch.real.sum(1).argsort(descending=True, stable=True)[:rows].sort().values
    inputs = {k: v[order] for k, v in batch.inputs.items()}
    real = batch.real[order]
    return harness.Batch(inputs, real, int(real.sum()), real.numel()), labels[order]


def run_job(job: str, device: str = "cpu", rows: int | None = None) -> None:
    """Runs `job` on `device`: the launch sequence the GPU run makes (under `Launches`, nothing runs). rows: a
    training or forward job on that many of its cell's rows (`fewer_rows`), not all of them."""
    kind, _, rest = job.partition(":")
    if kind in ("smoke", "smoke-backward", "configs"):
        from bench.gpu_check import KernelChecks, Skipped

        checks = KernelChecks(device, dry_run=False, launch_only=True)
        items = {"smoke": checks.smoke, "smoke-backward": checks.smoke_backward,
                 "configs": checks.every_config}[kind](rest)
        for _, check in items:
            try:
                check()
            except Skipped:  # a variant not built yet (smoke-backward) launches nothing
                pass
    elif kind in ("forward", "invariant"):
        import fastbert
        from bench import harness

        model, cell, dtype = rest.split(":")
        bank = harness.ModelBank()
        fast = bank.fastbert(model, harness.DTYPES[dtype], device).set_kernels("triton")
        batch = bank.batch(model, parse_cell(cell), device)
        if rows is not None:
            batch = fewer_rows(batch, torch.zeros(batch.real.shape[0]), rows)[0]
        with torch.inference_mode(), fastbert.batch_invariant(kind == "invariant"):
            fast(**batch.inputs)
    elif kind == "train":
        from bench import harness

        model, cell, dtype = rest.split(":")
        with torch.inference_mode(False), torch.enable_grad():  # the callers record under inference mode
            classifier = harness.train_variant(model, "fastbert-triton", harness.DTYPES[dtype], device)
            batch, labels = harness.train_batch(model, parse_cell(cell), device)
            if rows is not None:
                batch, labels = fewer_rows(batch, labels, rows)
            classifier.train()
            harness.train_step(classifier, harness.train_optimizer(classifier), batch, labels)()
    else:
        raise ValueError(f"unknown job {job!r}: smoke:DTYPE, smoke-backward:DTYPE, configs:FAMILY, "
                         f"forward:MODEL:CELL:DTYPE, invariant:MODEL:CELL:DTYPE or train:MODEL:CELL:DTYPE")


def parse_cell(name: str):
    """A bench cell from its name: "32x128" (fixed rows) or "32xvar16-512" (lengths drawn from [16, 512])."""
    from bench import harness

    batch, _, rest = name.partition("x")
    if rest.startswith("var"):
        lo, hi = rest[3:].split("-")
        return harness.Cell(name, int(batch), int(hi), min_len=int(lo))
    return harness.Cell(name, int(batch), int(rest))


def estimate() -> dict:
    """The keys of every job bench/gpu_check.py's plan runs, with the versions they were recorded under."""
    import triton

    from bench import gpu_check

    jobs = gpu_check.background_jobs(gpu_check.plan(dry_run=False, with_estimate=False))
    return {"recorded_with": {"torch": torch.__version__, "triton": triton.__version__},
            "jobs": {job: job_keys(job) for job in jobs}}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--estimate"]:
        from bench import gpu_check

        result = estimate()
        with open(gpu_check.ESTIMATE, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        for job, keys in result["jobs"].items():
            print(f"{job}: {len(keys)} keys", flush=True)
        return 0
    if len(argv) < 2:
        print(__doc__)
        return 2
    out, jobs = argv[0], argv[1:]
    result = {job: job_keys(job) for job in jobs}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    for job, keys in result.items():
        print(f"{job}: {len(keys)} keys", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
