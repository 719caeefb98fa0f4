"""EuroBERT against transformers' EuroBertModel (sdpa and eager), random weights, fp32: the PyTorch path and the
Triton kernels through the interpreter; EuroBERT-210m's shape, grouped-query attention (key/value heads shared by
2 and by 4 query heads) with and without biases, rows of 1 to 1,030 tokens right and left padded, a fully padded row,
packed input, the refusals. q and k are scaled up so that a wrong angle or a wrong key/value head cannot hide under
the bar. Bar: 1e-5 on real tokens."""
import copy

import pytest
import torch
import transformers
from helpers import error_on_real_tokens, eurobert_config, has_rotary_post_norm, perturb_, ragged_rows, sharpen_qk_

import fastbert

pytestmark = pytest.mark.skipif(not has_rotary_post_norm(), reason="this transformers has no EuroBERT (5.24+)")

LENGTHS = [1, 63, 64, 65, 129, 1030]


def hf_model(impl="sdpa", seed=0, qk_gain=4.0, hidden=64, heads=4, kv_heads=2, layers=2, intermediate=96, **extra):
    config = eurobert_config(hidden=hidden, heads=heads, layers=layers, intermediate=intermediate, max_len=2048,
                             num_key_value_heads=kv_heads, attn_implementation=impl, **extra)
    torch.manual_seed(seed)
    model = perturb_(transformers.EuroBertModel(config), weight_std=0.05).eval()
    return sharpen_qk_(model, qk_gain)


def ragged(lengths, seed=1, left=False):
    return ragged_rows(lengths, low=4, seed=seed, left=left)


error = error_on_real_tokens


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_long_and_short_rows(kv_heads, impl, left):
    hf = hf_model(impl, kv_heads=kv_heads, attention_bias=kv_heads == 1, mlp_bias=kv_heads == 1)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged(LENGTHS, left=left)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True)
        got = fb(ids, attention_mask=mask, output_hidden_states=True)
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert error(g, w, mask) <= 1e-5
    assert error(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5
    assert got.last_hidden_state[~mask.bool()].abs().max() == 0


@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa2", "gqa4"])
def test_kernels_through_the_interpreter(kv_heads):
    """kernels="triton": the fused QKV GEMM (or, grouped, one GEMM whose key/value heads the attention kernel reads
    for their groups), the rotary attention kernel, the SwiGLU epilogue; rows past one key block."""
    hf = hf_model("eager", kv_heads=kv_heads)
    fb = fastbert.BertModel.from_hf(hf, kernels="triton")
    ids, mask = ragged([1, 70, 33])
    with torch.no_grad():
        assert error(fb(ids, attention_mask=mask).last_hidden_state,
                     hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def record_attention_inputs(monkeypatch) -> list:
    """(qkv's shape, Extras.kv_heads) of every call of the attention op's twin and kernel from now on."""
    from fastbert.units import attention as unit
    seen = []

    def recording(fn):
        def run(qkv, attn, scale, dropout_p=0.0, return_probs=False, extras=unit.NONE, *rest, **kwargs):
            seen.append((tuple(qkv.shape), extras.kv_heads))
            return fn(qkv, attn, scale, dropout_p, return_probs, extras, *rest, **kwargs)
        return run

    monkeypatch.setattr(unit, "twin", recording(unit.twin))
    monkeypatch.setattr(unit, "kernel", recording(unit.kernel))
    return seen


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("kv_heads", [4, 1], ids=["mha", "gqa4"])
def test_attention_takes_the_key_value_heads_unrepeated(kernels, kv_heads, monkeypatch):
    """With fewer key/value heads the attention op receives the QKV GEMM's output per head, [T, nh + 2 kv, hd] with
    Extras.kv_heads, on the twin and on the kernel: no [T, 3, nh, hd] of repeated key/value heads is built on the way.
    With as many, the [T, 3, nh, hd] of qkv_projection, as before."""
    seen = record_attention_inputs(monkeypatch)
    hf = hf_model("eager", kv_heads=kv_heads)
    fb = fastbert.BertModel.from_hf(hf, kernels=kernels)
    ids, mask = ragged([9, 33, 1])
    with torch.no_grad():
        got, want = fb(ids, attention_mask=mask), hf(ids, attention_mask=mask)
    T, hd = int(mask.sum()), 16
    call = ((T, 4 + 2 * kv_heads, hd), kv_heads) if kv_heads < 4 else ((T, 3, 4, hd), None)
    assert seen == [call, call]  # one a layer
    assert error(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5


def test_attention_probabilities_over_grouped_heads(monkeypatch):
    """output_attentions=True runs HF's eager math on padded rows over the grouped heads: transformers' probabilities
    (each key/value head repeated for its group), a fully padded row's among them."""
    seen = record_attention_inputs(monkeypatch)
    hf = hf_model("eager", kv_heads=2)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([9, 70, 4])
    mask[2] = 0
    with torch.no_grad():
        got = fb(ids, attention_mask=mask, output_attentions=True)
        want = hf(ids, attention_mask=mask, output_attentions=True)
    assert seen == [((3 * 70, 4 + 2 * 2, 16), 2)] * 2
    for g, w in zip(got.attentions, want.attentions, strict=True):
        rows = mask.bool()[:, None, :, None].expand_as(w)  # every key of each real query
        assert (g - w)[rows].abs().max() <= 1e-5
    assert error(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5


def test_eurobert_210m_shape():
    """EuroBERT-210m's shape: 12 layers of 768, 12 heads (as many key/value heads), SwiGLU 3,072, theta 250,000."""
    hf = hf_model(qk_gain=1.0, hidden=768, heads=12, kv_heads=12, layers=12, intermediate=3072,
                  rope_parameters={"rope_type": "default", "rope_theta": 250000.0})
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([3, 70, 130])
    with torch.no_grad():
        assert error(fb(ids, attention_mask=mask).last_hidden_state,
                     hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_fully_padded_row_and_packed_input():
    hf = hf_model("eager")
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([9, 70, 1, 4])
    mask[2] = 0
    with torch.no_grad():
        got = fb(ids, attention_mask=mask).last_hidden_state
        assert torch.isfinite(got).all() and got[2].abs().max() == 0
        lengths = [9, 70, 4]
        rows = [0, 1, 3]
        packed = torch.cat([ids[b, :n] for b, n in zip(rows, lengths)])
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        out = fb(packed, cu_seqlens=cu).last_hidden_state
        for i, (b, n) in enumerate(zip(rows, lengths)):
            alone = hf(ids[b:b + 1, :n]).last_hidden_state[0]
            assert (got[b, :n] - alone).abs().max() <= 1e-5
            assert (out[cu[i]:cu[i + 1]] - alone).abs().max() <= 1e-5


def test_the_model_holds_hf_modules_and_keys():
    """HF's state_dict keys (embed_tokens at the top, norm after the layers), HF's own modules after from_hf (the
    RMSNorms included: one copy of every weight), and transformers' class name."""
    hf = hf_model()
    fb = fastbert.AutoModel.from_hf(hf, kernels="torch")
    assert type(fb).__name__ == "EuroBertModel" and isinstance(fb, fastbert.BertModel)
    assert list(fb.state_dict()) == list(hf.state_dict())
    assert fb.get_input_embeddings() is hf.embed_tokens
    assert fb.layers[0].input_layernorm is hf.layers[0].input_layernorm and fb.norm is hf.norm
    assert fb.layers[1].self_attn.k_proj.weight.shape == (32, 64)  # 2 key/value heads of 16


def test_num_key_value_heads_must_divide_the_heads():
    config = eurobert_config(hidden=64, heads=4, layers=1, intermediate=32, max_len=64)
    config.num_key_value_heads = 3
    with pytest.raises(ValueError, match="num_key_value_heads=3"):
        fastbert.BertModel(config)


# ---- the attention output and post_attention_layernorm as one op: residual_layernorm's pre-norm RMSNorm form ------
def set_rms_eps(model, eps):
    """transformers' set_model_for_less_flaky_test sets every norm's eps; an RMSNorm's is its variance_epsilon."""
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    for m in norms:
        m.variance_epsilon = eps
    assert len(norms) == 5  # two a layer, and the final norm


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_rms_eps_set_after_optimize_is_read_at_every_forward(kernels):
    """Each RMSNorm's variance_epsilon is read off the module at every forward, as transformers reads it: set on one
    post_attention_layernorm alone (the norm the fused op runs) after optimize and a first forward, then on every
    norm. Each change moves transformers' answer by more than ten times the bar, and fastbert's with it."""
    hf = hf_model("eager")
    fb = fastbert.optimize(copy.deepcopy(hf), kernels=kernels)
    ids, mask = ragged([9, 33, 1])

    def outputs():
        with torch.no_grad():
            return fb(ids, attention_mask=mask).last_hidden_state, hf(ids, attention_mask=mask).last_hidden_state

    got, before = outputs()
    assert error(got, before, mask) <= 1e-5
    for eps in (None, 1.0, 0.25):
        for m in (hf, fb):
            if eps is None:
                m.layers[0].post_attention_layernorm.variance_epsilon = 1.0
            else:
                set_rms_eps(m, eps)
        got, want = outputs()
        assert error(want, before, mask) > 1e-4 and error(got, want, mask) <= 1e-5, eps
        before = want


class _DoubledRMSNorm(transformers.models.eurobert.modeling_eurobert.EuroBertRMSNorm
                      if has_rotary_post_norm() else torch.nn.Module):
    """A norm of the same parameters whose forward differs: it must be called, not read for its weight."""

    def forward(self, x):
        return 2.0 * super().forward(x)


class _ShiftedLinear(torch.nn.Module):
    """An adapter-like wrapper around a linear (PEFT keeps the original as base_layer)."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x) + 0.25


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("replaced", ["post_attention_layernorm", "o_proj"])
def test_a_replaced_norm_or_wrapped_o_proj_is_called_as_the_module_it_is(kernels, replaced):
    hf = hf_model("eager")
    fb = fastbert.optimize(copy.deepcopy(hf), kernels=kernels)
    for m in (hf, fb):
        layer = m.layers[0]
        if replaced == "o_proj":
            layer.self_attn.o_proj = _ShiftedLinear(layer.self_attn.o_proj)
        else:
            norm = _DoubledRMSNorm(64, eps=layer.post_attention_layernorm.variance_epsilon)
            norm.load_state_dict(layer.post_attention_layernorm.state_dict())
            layer.post_attention_layernorm = norm
    ids, mask = ragged([9, 33, 1])
    with torch.no_grad():
        assert error(fb(ids, attention_mask=mask).last_hidden_state,
                     hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_the_kernel_runs_the_rms_form(monkeypatch):
    """kernels="triton": after attention, residual_layernorm's kernel in its pre-norm RMSNorm form, once a layer, with
    the norm's own weight and eps; "auto" keys and times that form."""
    from fastbert import units
    unit = units.residual_layernorm
    calls = []

    def spy(*args, **kwargs):
        calls.append((args[4], args[5], args[6], kwargs.get("pre_norm"), kwargs.get("rms")))
        return kernel(*args, **kwargs)

    kernel = unit.kernel
    monkeypatch.setattr(unit, "kernel", spy)
    hf = hf_model("eager")
    fb = fastbert.BertModel.from_hf(hf, kernels="triton")
    ids, mask = ragged([5, 17])
    with torch.no_grad():
        assert error(fb(ids, attention_mask=mask).last_hidden_state,
                     hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5
    norms = [layer.post_attention_layernorm for layer in hf.layers]
    assert len(calls) == len(norms)
    for (weight, ln_bias, eps, pre_norm, rms), norm in zip(calls, norms):
        assert weight is norm.weight and ln_bias is None and eps == norm.variance_epsilon and pre_norm and rms
    assert fb._variants[2] == unit.Variant(pre_norm=True, rms=True)
