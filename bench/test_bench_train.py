"""A fine-tuning step, side by side: fastbert on its kernels against HF sdpa, bf16 on the GPU.

One step is what training repeats: forward in train mode (dropout on), the classification loss, backward, AdamW's
step and zero_grad. Cells (bench/harness.py, TRAIN_*): BERT-base on 32 ragged rows of 16..512 tokens and on a dense
32x128 batch, full fine-tuning (BertForSequenceClassification); the same ragged cell with PEFT LoRA r=8 on query and
value; ModernBERT-base on the ragged cell. HF computes every padded position, fastbert only the real tokens.
Throughput counts real tokens. --bench-tiny: the tiny stand-ins (fp32 on CPU, the kernels through the interpreter).

Each case is checked before it is timed, with dropout off (eval mode, autograd on): the logits and the gradient of
every trainable parameter against HF eager fp32, bound 2x HF sdpa's own error in the case's dtype. Where fastbert's
dispatch cannot train on the kernels (a refusal naming its reason) the case is a skip that quotes it; which ops the
dispatch put on their kernels (triton_ops) and which kernels that checked step launched (kernels_launched) are
recorded. CI (`pytest bench --benchmark-disable`, no GPU) runs that check alone on the tiny stand-in of each
training model (test_train_check_on_the_tiny_models), so a wrong step fails there before the GPU times it.
"""
from dataclasses import dataclass

import pytest
import torch

import fastbert
from bench import harness
from bench.conftest import Selection, option, skip_reason_for_device


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        config = metafunc.config
        selection = Selection(config)
        cases = [c for c in harness.train_cases(option(config, "--bench-tiny"), torch.cuda.is_available())
                 if selection.keep_model(c)]
        metafunc.parametrize("case", cases, ids=[c.id for c in cases])


def test_train_step(case, benchmark, policy, request):
    reason = skip_reason_for_device(request.config, case.device)
    if reason:
        pytest.skip(reason)
    if harness.TRAIN_MODELS[case.model][1]:
        pytest.importorskip("peft")
    with torch.inference_mode(False), torch.enable_grad():  # bench/conftest.py runs every benchmark in inference mode
        _train_step(case, benchmark, policy)


@dataclass
class Checked:
    """A training case built and checked (`check_step`): the model, its batch, what ran on the kernels, and the
    errors against HF eager fp32 with their bounds, (logits, gradients) each."""
    model: object
    batch: harness.Batch
    labels: torch.Tensor
    triton_ops: list | None
    kernels_launched: list
    err: tuple
    hf_err: tuple
    bounds: tuple
    got: tuple  # (logits, {name: gradient}) of the case's model, and of HF eager fp32
    reference: tuple

    @property
    def ok(self) -> bool:
        return self.err[0] <= self.bounds[0] and self.err[1] <= self.bounds[1]


def check_step(case) -> Checked:
    """Builds `case` and runs the check every case passes before it is timed: the same function (dropout off) as HF
    eager fp32, the logits and each trainable parameter's gradient within 2x HF sdpa's own error in the case's
    dtype. Raises harness.Unavailable where fastbert cannot train on its kernels here."""
    device, dtype = case.device, harness.DTYPES[case.dtype]
    master = harness.train_master(case.model)
    model = harness.train_variant(case.model, case.variant, dtype, device, master)
    batch, labels = harness.train_batch(case.model, case.cell, device)
    triton_ops = harness.train_kernels(model, batch)
    reference = harness.logits_and_grads(harness.train_variant(
        case.model, f"hf-{harness.reference_attention(case.model)}", torch.float32, device, master), batch, labels)
    hf_err = harness.train_error(harness.logits_and_grads(
        harness.train_variant(case.model, "hf-sdpa", dtype, device, master), batch, labels), reference)
    with harness.kernel_launches() as launched:
        got = harness.logits_and_grads(model, batch, labels)
    err = harness.train_error(got, reference)
    bounds = tuple(harness.accuracy_bound(dtype, e) for e in hf_err)
    return Checked(model, batch, labels, triton_ops, sorted(launched), err, hf_err, bounds, got, reference)


def _train_step(case, benchmark, policy):
    device = case.device
    benchmark.group = f"{case.model} {case.cell.name} {case.dtype} ({device}): fine-tuning step"
    try:
        checked = check_step(case)
    except harness.Unavailable as e:
        pytest.skip(str(e))
    model, batch, labels, err, bounds = checked.model, checked.batch, checked.labels, checked.err, checked.bounds
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    benchmark.extra_info.update(
        kind="train", model=case.model, cell=case.cell.name, batch=case.cell.batch, dtype=case.dtype,
        variant=case.variant, device=device, device_name=harness.device_name(device), real_tokens=batch.real_tokens,
        padded_tokens=batch.padded_tokens, max_abs_err=err[0], err_bound=bounds[0], hf_err=checked.hf_err[0],
        grad_rel_err=err[1], grad_rel_bound=bounds[1], hf_grad_rel_err=checked.hf_err[1],
        triton_ops=checked.triton_ops, kernels_launched=checked.kernels_launched,
        lora=harness.TRAIN_MODELS[case.model][1], trainable_params=trainable, optimizer="AdamW",
        step="forward (train mode, dropout on) + loss + backward + AdamW step + zero_grad",
        headline="tokens_per_s counts real tokens (padding excluded)")
    assert checked.ok, (
        f"{case.id}: logits err {err[0]:.3g} (bound {bounds[0]:.3g}), gradients' relative err {err[1]:.3g} (bound "
        f"{bounds[1]:.3g}) against HF eager fp32; not timing a wrong step")

    model.train()
    step = harness.train_step(model, harness.train_optimizer(model), batch, labels)
    _, first_call_s = harness.first_call(benchmark, step, device)  # pays the kernels' compiles and autotuning
    benchmark.extra_info["first_call_s"] = first_call_s
    median = harness.run_timed(benchmark, step, device, policy(device))
    if median is not None:
        benchmark.extra_info.update(median_s=median, tokens_per_s=batch.real_tokens / median,
                                    padded_tokens_per_s=batch.padded_tokens / median)


# CI's form of the check: the ragged tiny cell (rows of 3..32 tokens, padding-free), fastbert on its kernels
CHECK_CELL = "4xvar3-32"
# Each gradient against its own size in fp32: max |g - g_ref| <= FP32_BOUND x max(max |g_ref|, FLOOR x the largest
# gradient of any parameter). The gate's one scale (the largest gradient, the classifier's) sits 10^4 above the tiny
# models' query and key gradients, so it cannot see an error in those; the floor keeps the gradients that are zero in
# exact arithmetic (a key bias), whose rounding noise is all there is, from counting as wrong.
FLOOR = 1e-3


def gradient_errors(got: tuple, ref: tuple) -> dict:
    """{parameter: max |g - g_ref| / max(max |g_ref|, FLOOR x the largest reference gradient)}."""
    (_, grads), (_, ref_grads) = got, ref
    largest = max(r.abs().max().item() for r in ref_grads.values() if r.numel())
    return {name: (grads[name] - r).abs().max().item() / max(r.abs().max().item(), FLOOR * largest)
            for name, r in ref_grads.items() if r.numel()}


@pytest.mark.parametrize("model", harness.TRAIN_TINY_MODELS)
def test_train_check_on_the_tiny_models(model):
    """The check every training cell passes before it is timed, on the tiny stand-in of each training model (BERT,
    BERT with LoRA, ModernBERT; fp32, the kernels through the interpreter on CPU), run by CI without --bench-tiny:
    fastbert on its kernels gives HF eager fp32's logits and gradients within the gate's bound, every gradient is
    also within it against its own size, and the step it checked launched every op's forward kernel and every
    backward kernel. No timing."""
    if harness.TRAIN_MODELS[model][1]:
        pytest.importorskip("peft")
    case, = [c for c in harness.train_cases(True, torch.cuda.is_available())
             if c.model == model and c.cell.name == CHECK_CELL and c.variant == "fastbert-triton"]
    with torch.inference_mode(False), torch.enable_grad():  # bench/conftest.py runs every test in inference mode
        checked = check_step(case)
    assert checked.triton_ops == sorted(fastbert.OPS)
    missing = [" or ".join(kernels) for kernels in harness.TRAIN_STEP_KERNELS
               if not set(kernels) & set(checked.kernels_launched)]
    assert not missing, f"the checked step never launched {missing}"
    assert checked.ok, (f"{case.id}: logits err {checked.err[0]:.3g} (bound {checked.bounds[0]:.3g}), gradients' "
                        f"relative err {checked.err[1]:.3g} (bound {checked.bounds[1]:.3g}) against HF eager fp32")
    if case.dtype == "fp32":
        wrong = {n: f"{e:.3g}" for n, e in gradient_errors(checked.got, checked.reference).items()
                 if not e <= harness.FP32_BOUND}
        assert not wrong, f"{case.id}: gradients off by more than {harness.FP32_BOUND} of their size: {wrong}"
