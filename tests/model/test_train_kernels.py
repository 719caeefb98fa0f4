"""Training forwards on the kernels, per architecture: with kernels="triton" in train mode (dropout off), every op
launches its kernels (forward and backward: each unit's autograd function, counted launch by launch) and every
parameter's gradient equals the twins' within the fp32 bar, over ragged rows (padding-free) and padded rows with a
key mask. Dropout on: every layer hands the config's p to its kernels, and with torch's own dropout off the
kernels' draws alone make the same seed give the same gradients and another seed others. Through Triton's
interpreter on CPU, the compiled kernels on CUDA (bench/gpu_check.py's tests-train step)."""
import pytest
import torch
import transformers
from helpers import (
    ARCHS,
    DEVICE,
    NEEDS_DEBERTA,
    NEEDS_MODERNBERT,
    NEEDS_ROTARY_POST_NORM,
    OP_KERNELS,
    arch_inputs,
    assert_trained_on_kernels,
    eurobert_config,
    gemma3_model,
    has_decoder_embedders,
    launches,
    modernbert_config,
    perturb_,
    qwen3_model,
    random_arch_model,
    torch_dropout_off,
    type_kwargs,
)

import fastbert
from fastbert import dispatch
from fastbert.numerics import FP32_TOL

pytestmark = pytest.mark.skipif(dispatch.triton_unavailable(torch.device(DEVICE)) is not None,
                                reason=f"the kernels cannot run on {DEVICE} here: "
                                       f"{dispatch.triton_unavailable(torch.device(DEVICE))}")


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
    """Every parameter's gradient after one forward + backward in train mode, and the kernel launches of that
    forward and of that backward."""
    fb = fastbert.BertModel.from_hf(hf, kernels=kernels, padding_free=padding_free).train()
    fb.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with launches() as forward:
        out = fb(ids, attention_mask=mask, **type_kwargs(tt))
    target = torch.randn(out.last_hidden_state.shape, generator=torch.Generator().manual_seed(1)).to(ids.device)
    loss = (out.last_hidden_state * target * mask[..., None]).sum()
    if getattr(out, "pooler_output", None) is not None:
        loss = loss + out.pooler_output.square().sum()
    with launches() as backward:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in fb.named_parameters() if p.grad is not None}
    fb.zero_grad(set_to_none=True)
    return grads, forward, backward


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
    got, forward, backward = gradients(hf, "triton", ids, tt, mask, padding_free)
    assert_trained_on_kernels(forward, backward)
    want, *twin_launches = gradients(hf, "torch", ids, tt, mask, padding_free)
    assert not any(twin_launches), twin_launches  # the reference is the twins' alone
    assert got.keys() == want.keys() and len(got) > 10
    for name, g in got.items():
        assert torch.isfinite(g).all(), f"{name}: NaN/inf"
        err = (g - want[name]).abs().max().item()
        assert err <= FP32_TOL * max(1.0, want[name].abs().max().item()), f"{name}: {err:.3g}"


@NEEDS_ROTARY_POST_NORM
def test_grouped_qkv_projection_trains_on_its_kernel():
    """EuroBERT's grouped key/value heads: the one q/k/v GEMM ([T, nh + 2 kv, hd]) runs qkv_projection's kernel,
    forward and backward, as kernels='triton' says."""
    hf = random_arch_model("eurobert-gqa")
    ids, tt, mask = arch_inputs(hf, "right")
    _, forward, backward = gradients(hf, "triton", ids, tt, mask, True)
    assert_trained_on_kernels(forward, backward)


def hf_gradients(hf, ids, mask):
    """transformers' own gradients of gradients()'s loss (train mode; these configs draw no dropout)."""
    hf = hf.train()
    hf.zero_grad(set_to_none=True)
    out = hf(ids, attention_mask=mask)
    target = torch.randn(out.last_hidden_state.shape, generator=torch.Generator().manual_seed(1)).to(ids.device)
    (out.last_hidden_state * target * mask[..., None]).sum().backward()
    grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad(set_to_none=True)
    return grads


def assert_gradients_equal(got: dict, want: dict):
    assert got.keys() == want.keys() and len(got) > 10
    for name, g in got.items():
        assert torch.isfinite(g).all(), f"{name}: NaN/inf"
        err = (g - want[name]).abs().max().item()
        assert err <= FP32_TOL * max(1.0, want[name].abs().max().item()), f"{name}: {err:.3g}"


NEEDS_DECODER_EMBEDDERS = pytest.mark.skipif(not has_decoder_embedders(),
                                             reason="fastbert runs Qwen3 and Gemma 3 from transformers 5 on")


@NEEDS_DECODER_EMBEDDERS
@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_qwen3_trains_on_the_kernels_but_causal_attention(padding_free, monkeypatch):
    """Qwen3's causal attention has no backward kernel: kernels="triton" in a training forward is refused by name
    before anything runs; "auto" says so once and trains attention on its twin. The other ops (the grouped QKV
    GEMM, the RMSNorm residual form, the SwiGLU epilogue) train on their kernels, forward and backward, and every
    gradient equals transformers' own (its parameter names are fastbert's)."""
    hf = qwen3_model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1000, 30000, (3, 40), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    mask[2, 9:] = 0  # short rows: query and key blocks partly padding
    ids = ids.masked_fill(mask == 0, 0)
    with pytest.raises(RuntimeError, match="causal attention has no backward in the kernels"):
        gradients(hf, "triton", ids, None, mask, padding_free)
    want = hf_gradients(hf.to(DEVICE), ids, mask)
    others = {op: "triton" for op in OP_KERNELS if op != "attention"}
    got, forward, backward = gradients(hf, {**others, "attention": "torch"}, ids, None, mask, padding_free)
    assert_trained_on_kernels(forward, backward, ops=tuple(others))
    assert not any(launch.op == "attention" for launch in (*forward, *backward))
    assert_gradients_equal(got, want)
    monkeypatch.setattr(dispatch, "_WARNED", set())  # "auto" says once why attention takes its twin
    with pytest.warns(UserWarning, match="'attention' runs on the PyTorch twin because causal attention has no "
                                         "backward"):
        auto, *_ = gradients(hf, "auto", ids, None, mask, padding_free)
    assert_gradients_equal(auto, want)


@NEEDS_DECODER_EMBEDDERS
def test_gemma3_trains_on_the_kernels():
    """Gemma 3 run both ways (EmbeddingGemma's layer at head_dim 32: the 300m's 256 is a head the attention kernel
    does not take): the QKV GEMM, attention (the window on the sliding layers included; packed rows: a window over
    padded rows is the twin's, said by the model) and the GeGLU epilogue train on their kernels, forward and
    backward, and every gradient equals transformers' own. Its sandwich norms sit between a GEMM and the residual
    add, where residual_layernorm's fused form does not apply: they run as modules (fastbert/layers/sandwich_norm.py),
    so that op launches nothing."""
    hf = gemma3_model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1000, 30000, (3, 40), generator=g).to(DEVICE)
    mask = torch.ones_like(ids)
    mask[1, 25:] = 0
    mask[2, 9:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    want = hf_gradients(hf.to(DEVICE), ids, mask)
    got, forward, backward = gradients(hf, "triton", ids, None, mask, True)
    assert_trained_on_kernels(forward, backward, ops=("qkv_projection", "attention", "bias_gelu"))
    assert not any(launch.op == "residual_layernorm" for launch in (*forward, *backward))
    assert_gradients_equal(got, want)


P = 0.1  # every dropout probability of the dropout test's models
# The hidden dropout each family's residual_layernorm draws at P: EuroBERT has none (its attention's alone)
HIDDEN_P = {"eurobert-gqa": 0.0}
# On a GPU the bias table's and DeBERTa's c2p / p2c gradients are summed with fp32 atomics (docs/training.md): their
# last bits, and those of every gradient they reach, vary from run to run
ATOMIC_SUMS = ("mpnet", "deberta-v2")


def largest_difference(a: dict, b: dict) -> float:
    """max over parameters of max |a - b|, relative to max(1, max |a|)."""
    return max((a[n] - b[n]).abs().max().item() / max(1.0, a[n].abs().max().item()) for n in a)


@pytest.mark.parametrize("arch", ["bert", "mpnet", pytest.param("modernbert", marks=NEEDS_MODERNBERT),
                                  pytest.param("deberta-v2", marks=NEEDS_DEBERTA),
                                  pytest.param("eurobert-gqa", marks=NEEDS_ROTARY_POST_NORM)])
def test_dropout_on_the_kernels_is_reproducible(arch, monkeypatch):
    """Attention and hidden dropout drawn in the kernels from torch's generator. Every launch of the attention
    kernels (forward, dK/dV, dQ) drops with the config's p, and so does every row kernel's (forward and backward)
    where the family has hidden dropout. With torch's own dropout the identity (the embeddings', ModernBERT's on
    the MLP, DeBERTa's on the positions: they would make two seeds differ on their own), the same seed gives the
    same gradients (bit for bit, but where a GPU sums with atomics: within the fp32 bar) and another seed others."""
    if arch == "modernbert":  # its dropouts are Identity modules unless the config has them at construction
        hf = perturb_(transformers.ModernBertModel(modernbert_config(64, 2, 2, 100, 24, attention_dropout=P,
                                                                     mlp_dropout=P)), weight_std=0.05)
    elif arch == "eurobert-gqa":  # its attention reads the probability once, at construction
        hf = perturb_(transformers.EuroBertModel(eurobert_config(64, 2, 2, 100, 24, gqa=True, biases=True,
                                                                 attention_dropout=P)), weight_std=0.05)
    else:
        hf = random_arch_model(arch)
    hf = hf.to(DEVICE)
    for m in hf.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = P
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
        if name in hf.config.to_dict():
            setattr(hf.config, name, P)
    torch_dropout_off(monkeypatch)
    ids, tt, mask = arch_inputs(hf, "right")
    a, forward, backward = gradients(hf, "triton", ids, tt, mask, True, seed=3)
    b, *_ = gradients(hf, "triton", ids, tt, mask, True, seed=3)
    c, *_ = gradients(hf, "triton", ids, tt, mask, True, seed=4)
    assert_trained_on_kernels(forward, backward)
    hidden = HIDDEN_P.get(arch, P)
    assert forward.dropouts("attention") == {"_attention_fwd_kernel": {P}}
    assert backward.dropouts("attention") == {"_attention_bwd_dkdv_kernel": {P}, "_attention_bwd_dq_kernel": {P}}
    assert forward.dropouts("residual_layernorm") == {"bias_residual_layernorm_kernel": {hidden}}
    assert backward.dropouts("residual_layernorm") == {"layernorm_backward_kernel": {hidden}}
    if DEVICE == "cuda" and arch in ATOMIC_SUMS:
        assert largest_difference(a, b) <= FP32_TOL
    else:
        assert all(torch.equal(a[n], b[n]) for n in a)
    moved = largest_difference(a, c)
    assert moved > FP32_TOL, f"another seed moved no gradient by more than {moved:.3g}: the kernels drew no dropout"
