"""Training forwards on the kernels, per architecture: with kernels="triton" in train mode (dropout off), every op
runs its train_kernel (forward and backward on the kernels: each unit's autograd function) and every parameter's
gradient equals the twins' within the fp32 bar, over ragged rows (padding-free) and padded rows with a key mask.
Dropout on: the kernels draw it, the same seed gives the same gradients."""
import pytest
import torch
import transformers
from helpers import arch_inputs, eurobert_config, modernbert_config, perturb_, random_arch_model, type_kwargs
from test_architectures import ARCHS, NEEDS_DEBERTA, NEEDS_MODERNBERT, NEEDS_ROTARY_POST_NORM

import fastbert
from fastbert import dispatch
from fastbert.numerics import FP32_TOL

pytestmark = pytest.mark.skipif(dispatch.triton_unavailable(torch.device("cpu")) is not None,
                                reason="the kernels need Triton's interpreter (TRITON_INTERPRET=1) on CPU")


def no_dropout_(model):
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout", "dropout",
                 "hidden_dropout", "embedding_dropout", "mlp_dropout", "pooler_dropout"):
        if isinstance(getattr(model.config, name, None), float):
            setattr(model.config, name, 0.0)
    return model


def gradients(hf, kernels, ids, tt, mask, padding_free, seed=0):
    """Every parameter's gradient after one forward + backward in train mode, and the ops that ran their kernel."""
    fb = fastbert.BertModel.from_hf(hf, kernels=kernels, padding_free=padding_free).train()
    fb.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = fb(ids, attention_mask=mask, **type_kwargs(tt))
    target = torch.randn(out.last_hidden_state.shape, generator=torch.Generator().manual_seed(1))
    loss = (out.last_hidden_state * target * mask[..., None]).sum()
    if getattr(out, "pooler_output", None) is not None:
        loss = loss + out.pooler_output.square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in fb.named_parameters() if p.grad is not None}
    fb.zero_grad(set_to_none=True)
    return grads, fb.resolve_ops(needs_grad=True).triton


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_on_the_kernels_equal_the_twins(arch, padding_free):
    hf = no_dropout_(random_arch_model(arch))
    ids, tt, mask = arch_inputs(hf, "right")
    mask[2, 2:] = 0  # a short row: query and key blocks partly padding
    if not padding_free and "modernbert" in arch:  # a window over padded rows: the twin's (said by the model)
        with pytest.raises(RuntimeError, match="a sliding window over padded rows has no backward"):
            gradients(hf, "triton", ids, tt, mask, padding_free)
        return
    got, on_kernels = gradients(hf, "triton", ids, tt, mask, padding_free)
    assert on_kernels == frozenset(dispatch.OPS)
    want, _ = gradients(hf, "torch", ids, tt, mask, padding_free)
    assert got.keys() == want.keys() and len(got) > 10
    for name, g in got.items():
        assert torch.isfinite(g).all(), f"{name}: NaN/inf"
        err = (g - want[name]).abs().max().item()
        assert err <= FP32_TOL * max(1.0, want[name].abs().max().item()), f"{name}: {err:.3g}"


@pytest.mark.parametrize("arch", ["bert", "mpnet", pytest.param("modernbert", marks=NEEDS_MODERNBERT),
                                  pytest.param("deberta-v2", marks=NEEDS_DEBERTA),
                                  pytest.param("eurobert-gqa", marks=NEEDS_ROTARY_POST_NORM)])
def test_dropout_on_the_kernels_is_reproducible(arch):
    """Attention and hidden dropout drawn in the kernels from torch's generator: the same seed, the same gradients;
    another seed, others."""
    if arch == "modernbert":  # its dropouts are Identity modules unless the config has them at construction
        hf = perturb_(transformers.ModernBertModel(modernbert_config(64, 2, 2, 100, 24, attention_dropout=0.1,
                                                                     mlp_dropout=0.1)), weight_std=0.05)
    elif arch == "eurobert-gqa":  # its attention reads the probability once, at construction
        hf = perturb_(transformers.EuroBertModel(eurobert_config(64, 2, 2, 100, 24, gqa=True, biases=True,
                                                                 attention_dropout=0.1)), weight_std=0.05)
    else:
        hf = random_arch_model(arch)
    for m in hf.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.1
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
        if name in hf.config.to_dict():
            setattr(hf.config, name, 0.1)
    ids, tt, mask = arch_inputs(hf, "right")
    a, on_kernels = gradients(hf, "triton", ids, tt, mask, True, seed=3)
    b, _ = gradients(hf, "triton", ids, tt, mask, True, seed=3)
    c, _ = gradients(hf, "triton", ids, tt, mask, True, seed=4)
    assert on_kernels == frozenset(dispatch.OPS)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert any(not torch.equal(a[n], c[n]) for n in a)
