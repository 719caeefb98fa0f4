"""Whole-model throughput, side by side in one run: fastbert (Triton, torch) against HF (eager, sdpa, torch.compile).

One pytest-benchmark group per (model, batch x seq, dtype, device), so its table compares the variants of a cell
directly. The headline is tokens/s counting real tokens (padding excluded): that is the work a user asked for, and
it is the number padding-free execution improves. Padded tokens/s (batch x padded length) is in extra_info too.

Each case: build the variant, run it once and check it against HF eager fp32 on the same device (that first call
also pays Triton autotuning / torch.compile, reported as first_call_s, never timed), then time it.
"""
import pytest
import torch

from bench import harness
from bench.conftest import Selection, option, skip_reason_for_device


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        config = metafunc.config
        selection = Selection(config)
        cases = [c for c in harness.model_cases(option(config, "--bench-tiny"), torch.cuda.is_available())
                 if selection.keep_model(c)]
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def _interpreting() -> bool:
    """Triton kernels can run on CPU tensors here: the interpreter is on."""
    from fastbert import ops

    return ops.triton_unavailable(torch.device("cpu")) is None


def build_variant(case: harness.ModelCase, bank: harness.ModelBank, device: str, dtype: torch.dtype, config,
                  cell: harness.Cell):
    """The callable to time (one forward on `cell`'s batch: the case's, or CI's few rows of it) and what to record
    about it."""
    batch = bank.batch(case.model, cell, device)
    info = {}
    if case.variant == "fastbert-graphs":
        if device != "cuda" and not option(config, "--bench-tiny"):
            raise harness.Unavailable("CUDA graphs: CUDA only")
        model = bank.fastbert(case.model, dtype, device)
        model.set_kernels("auto").set_kernels(attention="triton")  # a graph needs the varlen kernel (no host loop)
        graph_class = None
        if device != "cuda":  # the tiny dry run: the runner's own logic, replayed eagerly
            from fastbert.graphs import EagerGraph
            graph_class = EagerGraph
        from fastbert.graphs import GraphRunner
        # one bucket per cell, just above its real tokens (harness.graph_bucket): a replay is what is timed; the
        # capture (and the autotuning before it) is reported as capture_s
        runner = GraphRunner(model, token_buckets=(harness.graph_bucket(batch.real_tokens),),
                             max_seqs=cell.batch, graph_class=graph_class)
        runner.capture()  # now, not in the first timed call
        info.update(kernels=dict(model.kernels), capture_s=runner.stats.capture_s,
                    graph_pool_bytes=runner.stats.pool_bytes, buckets=list(runner.buckets))
        return (lambda: runner(**batch.inputs)), info
    if case.variant.startswith("fastbert-"):
        backend = case.variant.split("-", 1)[1]
        if backend == "triton" and device == "cpu" and not _interpreting():
            raise harness.Unavailable("fastbert-triton runs Triton kernels: CUDA only (on CPU the tiny dry run "
                                      "alone uses the interpreter)")
        model = bank.fastbert(case.model, dtype, device)
        model.set_kernels(backend)
        info["kernels"] = dict(model.kernels)
        info["interpreter"] = backend == "triton" and device == "cpu"
        return (lambda: model(**batch.inputs)), info
    if case.variant in ("hf-eager", "hf-sdpa"):
        model = bank.hf(case.model, case.variant.split("-", 1)[1], dtype, device)
        return (lambda: model(**batch.inputs)), info
    if case.variant == "hf-compile":
        if not option(config, "--bench-compile"):
            raise harness.Unavailable("torch.compile variant is off (pass --bench-compile)")
        cells = [c for c in option(config, "--bench-compile-cells").split(",") if c]
        if cells and case.cell.name not in cells:
            raise harness.Unavailable(f"torch.compile runs only on cells {cells} (--bench-compile-cells)")
        mode = option(config, "--bench-compile-mode")
        torch._dynamo.reset()  # a fresh compile per case, so compile_s is comparable between cells
        impl = harness.hf_attention(case.model)[-1]  # HF at its best: sdpa, eager for MPNet (it has no sdpa)
        model = torch.compile(bank.hf(case.model, impl, dtype, device), mode=None if mode == "default" else mode)
        info.update(compile_mode=mode, compiled_attention=impl)
        return (lambda: model(**batch.inputs)), info
    raise ValueError(f"unknown variant {case.variant!r}; the variants are {harness.VARIANTS}")


def test_model(case, bank, benchmark, policy, request):
    reason = skip_reason_for_device(request.config, case.device)
    if reason:
        pytest.skip(reason)
    device = case.device
    dtype = harness.DTYPES[case.dtype]
    benchmark.group = case.group
    # CI (--benchmark-disable) checks each case once on a few rows of its cell; the timed runs take the whole cell
    cell = harness.ci_cell(case.cell) if benchmark.disabled else case.cell
    try:
        fn, info = build_variant(case, bank, device, dtype, request.config, cell)
        batch = bank.batch(case.model, cell, device)
        reference = bank.reference(case.model, cell, device)
        hf_error = bank.hf_error(case.model, cell, dtype, device)
    except harness.Unavailable as e:
        pytest.skip(str(e))

    # Check before timing. This first call also pays every one-time cost (autotuning, compilation).
    out, first_call_s = harness.first_call(benchmark, fn, device)
    error = harness.max_error(harness.Outputs.of(out, batch), reference)
    bound = harness.accuracy_bound(dtype, hf_error)
    del out
    benchmark.extra_info.update(
        kind="model", model=case.model, cell=cell.name, batch=cell.batch,
        padded_len=batch.padded_tokens // cell.batch, dtype=case.dtype, variant=case.variant, device=device,
        device_name=harness.device_name(device), real_tokens=batch.real_tokens, padded_tokens=batch.padded_tokens,
        max_abs_err=error, err_bound=bound, hf_err=hf_error, first_call_s=first_call_s,
        headline="tokens_per_s counts real tokens (padding excluded)", **info)
    if case.variant == "hf-compile":
        benchmark.extra_info["compile_s"] = first_call_s  # the first call is trace + compile + one forward
    assert error <= bound, (f"{case.id}: max |out - HF eager fp32| = {error:.3g} > bound {bound:.3g} "
                            f"(HF's own {case.dtype} error {hf_error:.3g}); not timing a wrong result")

    median = harness.run_timed(benchmark, fn, device, policy(device))
    if median is not None:
        benchmark.extra_info.update(median_s=median, tokens_per_s=batch.real_tokens / median,
                                    padded_tokens_per_s=batch.padded_tokens / median)
