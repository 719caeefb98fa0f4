"""pytest setup for `pytest bench/`: options, the session-wide model bank and device ceilings, the report hooks.

    pytest bench/                          the grid for this machine (CUDA grid on a GPU, the CPU grid otherwise)
    pytest bench/ --benchmark-disable      every case checked and run once, no timing (what CI runs)
    pytest bench/ --bench-compile          add torch.compile(HF sdpa) (compile time in extra_info, never timed)
    pytest bench/ --bench-tiny             a tiny random BERT, DistilBERT and MPNet at tiny shapes (the GPU check's
                                           --dry-run; the op benchmarks always take the tiny shapes on CPU)
    pytest bench/ --benchmark-json r.json  then: python -m bench.summarize r.json --out DIR

The --bench-* options are only accepted when bench/ (or a file in it) is on the command line: pytest registers
a sub-folder's conftest options only then (a run that loads this file later uses the defaults).
"""
import os
import time

import pytest
import torch

from bench import harness

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no hub: MiniLM comes from a PyPI package or FASTBERT_MINILM_PATH


def _csv(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


OPTION_DEFAULTS = {"--bench-device": "auto", "--bench-tiny": False, "--bench-compile": False,
                   "--bench-compile-cells": "", "--bench-compile-mode": "default", "--bench-models": "",
                   "--bench-cells": "", "--bench-dtypes": "", "--bench-variants": "", "--bench-ops": "",
                   "--bench-target-s": None, "--bench-min-rounds": None, "--bench-deadline": None}


def option(config, name: str):
    """config.getoption with this file's default, so that a run which loaded this conftest late (bench/ not on the
    command line) still works with the defaults instead of failing on an unknown option."""
    return config.getoption(name, default=OPTION_DEFAULTS[name])


def pytest_addoption(parser):
    group = parser.getgroup("fastbert bench")
    group.addoption("--bench-device", default="auto", choices=("auto", "cpu", "cuda", "all"),
                    help="which grid runs: auto = the CUDA grid when CUDA is available, else the CPU grid")
    group.addoption("--bench-tiny", action="store_true",
                    help="a tiny random BERT at tiny shapes instead of the grids (dry run of the whole flow; on CPU "
                         "the Triton variants run through the interpreter, TRITON_INTERPRET=1)")
    group.addoption("--bench-compile", action="store_true",
                    help="also time torch.compile(HF sdpa); its compile time goes to extra_info, not the rounds")
    group.addoption("--bench-compile-cells", default="",
                    help="comma list of cells the compile variant runs on (default: every cell)")
    group.addoption("--bench-compile-mode", default="default",
                    help="torch.compile mode for hf-compile (default, reduce-overhead, max-autotune...)")
    group.addoption("--bench-models", default="",
                    help="comma list: keep only these models (bert-base, minilm, distilbert-base, mpnet-base, "
                         "modernbert-base, deberta-v3-base; with --bench-tiny: tiny, tiny-distilbert, tiny-mpnet, "
                         "tiny-modernbert)")
    group.addoption("--bench-cells", default="", help="comma list: keep only these cells (e.g. 32x128,8x512)")
    group.addoption("--bench-dtypes", default="", help="comma list: keep only these dtypes (fp16, bf16, fp32)")
    group.addoption("--bench-variants", default="", help="comma list: keep only these variants / op backends")
    group.addoption("--bench-ops", default="", help="comma list: keep only these ops in test_bench_ops")
    group.addoption("--bench-target-s", type=float, default=None,
                    help="timed work per benchmark in seconds (default 0.25 on CUDA, 4 on CPU)")
    group.addoption("--bench-min-rounds", type=int, default=None, help="minimum timed rounds (default 10 CUDA, 9 CPU)")
    group.addoption("--bench-deadline", type=float, default=None,
                    help="Unix time after which the remaining cases skip (gpu_check's budget: the session then "
                         "ends normally and writes its JSON)")


def pytest_configure(config):
    # The Triton interpreter is a switch read when Triton first compiles a kernel module, so it must be set before
    # any fastbert kernel is imported. Without CUDA the op benchmarks check the kernels at tiny sizes through it
    # (test_bench_ops.tiny_ops); the model benchmarks on CPU run no Triton kernel.
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    config._fastbert_ceilings = None


class Selection:
    """The command-line filters; an empty filter keeps everything."""

    def __init__(self, config):
        self.models = _csv(option(config, "--bench-models"))
        self.cells = _csv(option(config, "--bench-cells"))
        self.dtypes = _csv(option(config, "--bench-dtypes"))
        self.variants = _csv(option(config, "--bench-variants"))
        self.ops = _csv(option(config, "--bench-ops"))

    @staticmethod
    def _keep(values, value) -> bool:
        return not values or value in values

    def keep_model(self, case: harness.ModelCase) -> bool:
        return (self._keep(self.models, case.model) and self._keep(self.cells, case.cell.name)
                and self._keep(self.dtypes, case.dtype) and self._keep(self.variants, case.variant))

    def keep_op(self, op: str, dtype: str, backend: str) -> bool:
        return self._keep(self.ops, op) and self._keep(self.dtypes, dtype) and self._keep(self.variants, backend)


def skip_reason_for_device(config, case_device: str) -> str | None:
    """Why a case meant for `case_device` does not run on this machine (None when it runs)."""
    if option(config, "--bench-tiny"):
        return None
    cuda = torch.cuda.is_available()
    choice = option(config, "--bench-device")
    if case_device == "cuda" and not cuda:
        return "CUDA case: no CUDA device here (the CPU grid runs instead)"
    if choice == "all":
        return None
    if choice == "auto":
        choice = "cuda" if cuda else "cpu"
    if case_device != choice:
        return (f"{case_device.upper()} case: this run benchmarks the {choice.upper()} grid "
                "(--bench-device=all runs both)")
    return None


@pytest.fixture(scope="session")
def bank():
    return harness.ModelBank()


@pytest.fixture(scope="session")
def ceilings(request):
    """Copy GB/s and GEMM TFLOP/s of the device, measured once per session (only when an op benchmark asks)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    measured = harness.measure_ceilings(device)
    request.config._fastbert_ceilings = measured
    return measured


@pytest.fixture(autouse=True)
def _deadline(request):
    deadline = option(request.config, "--bench-deadline")
    if deadline is not None and time.time() > deadline:
        pytest.skip("time budget of this run is spent (--bench-deadline)")


@pytest.fixture(autouse=True)
def _inference_mode():
    """Every benchmark is inference: no autograd bookkeeping in any variant (fastbert's Triton ops require it)."""
    with torch.inference_mode():
        yield


@pytest.fixture
def policy(request):
    def make(device: str) -> harness.TimingPolicy:
        return harness.TimingPolicy.for_device(device, option(request.config, "--bench-target-s"),
                                               option(request.config, "--bench-min-rounds"))

    return make


# --------------------------------------------------------------------------------------------------------------------
# Reporting: versions and ceilings into the JSON, tokens/s and ratios into the terminal
# --------------------------------------------------------------------------------------------------------------------
def pytest_benchmark_update_machine_info(config, machine_info):
    info = harness.environment()
    info["ceilings"] = getattr(config, "_fastbert_ceilings", None)
    info["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET")
    machine_info["fastbert_bench"] = info


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    from bench import summarize

    benchmarks = [b.as_dict(include_data=False) for b in session.benchmarks if not b.has_error and b.stats]
    text = summarize.render(benchmarks, meta=[])
    if text.strip():
        terminalreporter.write_sep("=", "fastbert: tokens/s and ratios (python -m bench.summarize for the plot)")
        terminalreporter.write_line(text)
