"""A fine-tuning step, side by side: fastbert on its kernels against HF sdpa, bf16 on the GPU.

One step is what training repeats: forward in train mode (dropout on), the classification loss, backward, AdamW's
step and zero_grad. Cells (bench/harness.py, TRAIN_*): BERT-base on 32 ragged rows of 16..512 tokens and on a dense
32x128 batch, full fine-tuning (BertForSequenceClassification); the same ragged cell with PEFT LoRA r=8 on query and
value; ModernBERT-base on the ragged cell. HF computes every padded position, fastbert only the real tokens.
Throughput counts real tokens. --bench-tiny: the tiny stand-ins (fp32 on CPU, the kernels through the interpreter).

Each case is checked before it is timed, with dropout off (eval mode, autograd on): the logits and the gradient of
every trainable parameter against HF eager fp32, bound 2x HF sdpa's own error in the case's dtype. Where fastbert's
dispatch cannot train on the kernels (a refusal naming its reason) the case is a skip that quotes it; which ops ran
their kernels is recorded (triton_ops).
"""
import pytest
import torch

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


def _train_step(case, benchmark, policy):
    device, dtype = case.device, harness.DTYPES[case.dtype]
    benchmark.group = f"{case.model} {case.cell.name} {case.dtype} ({device}): fine-tuning step"
    try:
        master = harness.train_master(case.model)
        model = harness.train_variant(case.model, case.variant, dtype, device, master)
        batch, labels = harness.train_batch(case.model, case.cell, device)
        triton_ops = harness.train_kernels(model, batch)
    except harness.Unavailable as e:
        pytest.skip(str(e))

    # Check before timing: the same function (dropout off) against HF eager fp32, bound 2x HF sdpa's own error.
    reference = harness.logits_and_grads(harness.train_variant(
        case.model, f"hf-{harness.reference_attention(case.model)}", torch.float32, device, master), batch, labels)
    hf_err = harness.train_error(harness.logits_and_grads(
        harness.train_variant(case.model, "hf-sdpa", dtype, device, master), batch, labels), reference)
    err = harness.train_error(harness.logits_and_grads(model, batch, labels), reference)
    bounds = tuple(harness.accuracy_bound(dtype, e) for e in hf_err)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    benchmark.extra_info.update(
        kind="train", model=case.model, cell=case.cell.name, batch=case.cell.batch, dtype=case.dtype,
        variant=case.variant, device=device, device_name=harness.device_name(device), real_tokens=batch.real_tokens,
        padded_tokens=batch.padded_tokens, max_abs_err=err[0], err_bound=bounds[0], hf_err=hf_err[0],
        grad_rel_err=err[1], grad_rel_bound=bounds[1], hf_grad_rel_err=hf_err[1], triton_ops=triton_ops,
        lora=harness.TRAIN_MODELS[case.model][1], trainable_params=trainable, optimizer="AdamW",
        step="forward (train mode, dropout on) + loss + backward + AdamW step + zero_grad",
        headline="tokens_per_s counts real tokens (padding excluded)")
    assert err[0] <= bounds[0] and err[1] <= bounds[1], (
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
