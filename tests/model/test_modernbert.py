"""ModernBERT against transformers' ModernBertModel (sdpa and eager), random weights, fp32, the PyTorch path: its
real window (local_attention 128: +-64) with sequences of 1, 63, 64, 65, 129 and 1,000+ tokens, so that windows
reach past both ends and cross any block; the base shape (22 layers, hidden 768, 12 heads); packed input; caller
position ids; attention probabilities; and a training step's gradients. Bar: 1e-5 on real tokens."""
import pytest
import torch
import transformers
from helpers import has_modernbert, modernbert_config, perturb_

import fastbert

pytestmark = pytest.mark.skipif(not has_modernbert(), reason="this transformers has no ModernBERT (4.48+)")

LENGTHS = [1, 63, 64, 65, 129, 1030]
VOCAB = 99


def hf_model(impl="sdpa", seed=0, qk_gain=6.0, **shape):
    """Random weights; q and k scaled by `qk_gain` so that attention is sharp and positions matter (with small
    random weights every score is near 0: a wrong angle or window would hide under the bar)."""
    shape = {"hidden": 64, "heads": 4, "layers": 3, "intermediate": 96, "max_len": 2048, "window": 64, **shape}
    torch.manual_seed(seed)
    model = perturb_(transformers.ModernBertModel(modernbert_config(**shape, attn_implementation=impl)),
                     weight_std=0.05).eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.Wqkv.weight[:2 * shape["hidden"]] *= qk_gain
    return model


def ragged(lengths, seed=1, left=False):
    S = max(lengths)
    ids = torch.randint(2, VOCAB, (len(lengths), S), generator=torch.Generator().manual_seed(seed))
    mask = torch.zeros(len(lengths), S, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, S - n:] = 1 if left else 0
        mask[b, :n] = 0 if left else 1
    return ids.masked_fill(mask == 0, 0), mask


def max_error_on_real_tokens(got, want, mask):
    return (got - want)[mask.bool()].abs().max().item()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_window_edges_and_long_rows(impl, left):
    """Windows of +-64 against rows shorter than, equal to and longer than them, right and left padded; positions
    are HF's column indices, so a left-padded row's rotary angles start past 0."""
    hf = hf_model(impl)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged(LENGTHS, left=left)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_hidden_states=True)
        got = fb(ids, attention_mask=mask, output_hidden_states=True)
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert max_error_on_real_tokens(g, w, mask) <= 1e-5
    assert max_error_on_real_tokens(got.last_hidden_state, want.last_hidden_state, mask) <= 1e-5
    assert got.last_hidden_state[~mask.bool()].abs().max() == 0  # padding-free: padded positions are 0


def test_inference_forward_reuses_a_workspace_and_computes_what_autograd_does(monkeypatch):
    """Under no_grad on CPU the twins write into one twins.Workspace per forward (every layer takes its buffers);
    the result, and every kept hidden state, is bit for bit the forward with autograd on (which allocates), and no
    hidden state aliases another or a workspace buffer."""
    hf = hf_model("sdpa")
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged(LENGTHS)
    taken = []
    take = fastbert.twins.Workspace.take
    monkeypatch.setattr(fastbert.twins.Workspace, "take",
                        lambda self, name, shape, like: taken.append(name) or take(self, name, shape, like))
    with torch.no_grad():
        got = fb(ids, attention_mask=mask, output_hidden_states=True)
    assert {n: taken.count(n) for n in set(taken)} == {n: len(hf.layers) for n in (
        "qkv", "rotated_qk", "rotary_product", "context", "stream", "ffn", "gated")}
    taken.clear()
    want = fb(ids, attention_mask=mask, output_hidden_states=True)  # autograd on: no workspace
    assert not taken and want.last_hidden_state.requires_grad
    assert torch.equal(got.last_hidden_state, want.last_hidden_state.detach())
    for g, w in zip(got.hidden_states, want.hidden_states, strict=True):
        assert torch.equal(g, w.detach())
    assert len({h.data_ptr() for h in got.hidden_states}) == len(got.hidden_states)
    assert max_error_on_real_tokens(got.last_hidden_state, hf(ids, attention_mask=mask).last_hidden_state.detach(),
                                    mask) <= 1e-5


def test_base_shape():
    """ModernBERT-base's shape (22 layers, 768 wide, 12 heads of 64, MLP 1152, every third layer global)."""
    hf = hf_model("sdpa", hidden=768, heads=12, layers=22, intermediate=1152)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([3, 130, 300])
    with torch.no_grad():
        assert max_error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                        hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5


def test_packed_input_is_each_sequence_alone():
    hf = hf_model()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([65, 1, 200])
    lengths = mask.sum(1).tolist()
    packed = torch.cat([ids[b, :n] for b, n in enumerate(lengths)])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    with torch.no_grad():
        out = fb(packed, cu_seqlens=cu).last_hidden_state
        for b, n in enumerate(lengths):
            alone = hf(ids[b:b + 1, :n]).last_hidden_state[0]
            assert (out[cu[b]:cu[b + 1]] - alone).abs().max() <= 1e-5


def test_caller_position_ids_and_a_row_with_holes():
    """position_ids given by the caller rotate q and k as HF's do; a mask with holes (its real tokens are not one
    run) counts the holes as distance inside the window, as HF does, so that row runs padded."""
    hf = hf_model(window=4)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([20, 20])
    mask[1, 5:9] = 0
    positions = torch.arange(20).expand(2, 20) + (torch.arange(20) >= 10) * torch.tensor([[25], [3]])  # gaps
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, position_ids=positions).last_hidden_state
        got = fb(ids, attention_mask=mask, position_ids=positions).last_hidden_state
    assert max_error_on_real_tokens(got, want, mask) <= 1e-5
    shifted = hf(ids, attention_mask=mask).last_hidden_state
    assert max_error_on_real_tokens(shifted, want, mask) > 1e-4  # the gaps did change HF's answer (a shift would
    # not: rotary scores depend on position differences only)


def test_attention_probabilities_are_hf_eagers():
    hf = hf_model("eager", window=4, max_len=64)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([30, 12])
    with torch.no_grad():
        want = hf(ids, attention_mask=mask, output_attentions=True)
        got = fb(ids, attention_mask=mask, output_attentions=True)
    real = mask.bool()[:, None, :, None] & mask.bool()[:, None, None, :]
    for g, w, kind in zip(got.attentions, want.attentions, hf.config.layer_types, strict=True):
        assert (g - w).masked_fill(~real, 0).abs().max() <= 1e-6
        outside = g[1, :, 0, 5:12]  # query 0 of the 12-token row, real keys 5..11: past a window of +-4
        assert (outside == 0).all() if kind == "sliding_attention" else (outside > 0).all()


def test_training_step_gradients_equal_hfs():
    """A backward through fastbert's layers (packed, padding-free) gives HF's gradients for every parameter."""
    hf = hf_model(window=8, max_len=64)
    fb = fastbert.BertModel.from_hf(transformers.ModernBertModel(hf.config).eval(), kernels="torch")
    fb.load_state_dict(hf.state_dict())
    ids, mask = ragged([40, 17, 3])
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(3))
    for model in (hf.train(), fb.train()):
        out = model(ids, attention_mask=mask).last_hidden_state
        (out * weight * mask[..., None]).sum().backward()
    theirs, ours = dict(hf.named_parameters()), dict(fb.named_parameters())
    assert theirs.keys() == ours.keys()
    for name, p in theirs.items():
        assert (ours[name].grad - p.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max().item()), name


# ---- the kernels (Triton's interpreter on CPU: tests/conftest.py sets TRITON_INTERPRET=1) ---------------------------
def counting_kernels(monkeypatch):
    """op -> the number of calls its Triton kernel served (each unit's kernel, counted)."""
    from fastbert.units import UNITS
    calls = {}
    for op, unit in UNITS.items():
        def counted(*args, _launch=unit.kernel, _op=op, **kwargs):
            calls[_op] = calls.get(_op, 0) + 1
            return _launch(*args, **kwargs)
        monkeypatch.setattr(unit, "kernel", counted)
    return calls


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("left", [False, True], ids=["right", "left"])
def test_every_op_on_its_kernel(monkeypatch, left, padding_free):
    """kernels="triton": the QKV GEMM, the windowed rotary attention, the pre-norm residual LayerNorm and the gated
    epilogue all run as kernels, in every layer, and give HF's numbers (padded positions too with
    padding_free=False)."""
    hf = hf_model("eager", window=4, max_len=128)
    fb = fastbert.BertModel.from_hf(hf, kernels="triton", padding_free=padding_free)
    calls = counting_kernels(monkeypatch)
    ids, mask = ragged([70, 5, 1, 33], left=left)
    with torch.no_grad():
        want, got = hf(ids, attention_mask=mask).last_hidden_state, fb(ids, attention_mask=mask).last_hidden_state
    assert calls == {op: len(hf.layers) for op in ("qkv_projection", "attention", "bias_gelu", "residual_layernorm")}
    assert max_error_on_real_tokens(got, want, mask) <= 1e-5
    if not padding_free:
        assert (got - want).abs().max() <= 1e-5


def test_fp16_kernels_within_twice_hfs_own_fp16_error():
    from fastbert.numerics import error_bound, max_error
    hf = hf_model("eager", window=4, max_len=128)
    ids, mask = ragged([70, 5, 33])
    with torch.no_grad():
        want = hf(ids, attention_mask=mask).last_hidden_state
        half = hf.half()
        hf_error = max_error(half(ids, attention_mask=mask).last_hidden_state, want, mask.bool())
        got = fastbert.BertModel.from_hf(half, kernels="triton")(ids, attention_mask=mask).last_hidden_state
    assert max_error(got, want, mask.bool()) <= error_bound(torch.float16, hf_error)


def test_triton_refuses_what_only_the_padded_twin_serves(monkeypatch):
    """output_attentions and a custom mask run the padded twin under "auto" (saying so once); "triton" refuses them,
    naming why. A custom 4-D mask is the whole mask, as HF takes it: its sliding layers add no window to it."""
    from fastbert import dispatch
    monkeypatch.setattr(dispatch, "_WARNED", set())
    hf = hf_model("eager", window=4, max_len=64)
    ids, mask = ragged([30, 12])
    allowed = (mask[:, None, :, None] * mask[:, None, None, :]).bool()  # [B, 1, S, S]
    custom = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)  # additive, HF's form
    for kwargs, words in (({"output_attentions": True}, "output_attentions=True needs the probabilities"),
                          ({"attention_mask": custom}, "a custom 3-D/4-D attention mask")):
        call = {"attention_mask": mask, **kwargs}
        with torch.no_grad(), pytest.raises(RuntimeError, match=words):
            fastbert.BertModel.from_hf(hf, kernels="triton")(ids, **call)
        with torch.no_grad(), pytest.warns(UserWarning, match=words):
            got = fastbert.BertModel.from_hf(hf, kernels="auto")(ids, **call).last_hidden_state
            want = hf(ids, **call).last_hidden_state
        assert max_error_on_real_tokens(got, want, mask) <= 1e-5


def test_torch_compile_fullgraph_and_export():
    """A traced ModernBERT forward (padded rows, as every traced forward runs) gives the eager model's numbers; the
    exported graph holds one fastbert op per op and layer, the pre-norm residual LayerNorm as its own op."""
    hf = hf_model("eager", window=4, max_len=64)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").eval()
    ids, mask = ragged([30, 12, 1])
    torch._dynamo.reset()
    try:
        compiled = torch.compile(fb, fullgraph=True)
        with torch.no_grad():
            want = hf(ids, attention_mask=mask).last_hidden_state
            assert max_error_on_real_tokens(compiled(ids, attention_mask=mask).last_hidden_state, want, mask) <= 1e-5
            program = torch.export.export(fb, (ids, mask))
            got = program.module()(ids, mask)
    finally:
        torch._dynamo.reset()
    got = got["last_hidden_state"] if isinstance(got, dict) else got[0] if isinstance(got, tuple) else \
        got.last_hidden_state
    assert max_error_on_real_tokens(got, want, mask) <= 1e-5
    targets = [str(n.target) for n in program.graph.nodes]
    for op in ("qkv_projection", "attention", "bias_gelu", "residual_layernorm_pre"):
        assert targets.count(f"fastbert.{op}.default") == len(hf.layers), op


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}],
                         ids=["linear", "yarn"])
def test_scaled_rope_types_per_layer_type(rope):
    """A scaled rope type in each layer type's rope_parameters: transformers' own frequencies and attention factor
    (yarn scales cos and sin), past the original length."""
    hf = hf_model("sdpa", window=8, max_len=256)
    hf.config.rope_parameters = {kind: {**params, **rope} for kind, params in hf.config.rope_parameters.items()}
    hf = type(hf)(hf.config)  # rebuilt: its rotary embedding reads the rope parameters when built
    torch.manual_seed(0)
    perturb_(hf, weight_std=0.05).eval()
    fb = fastbert.BertModel.from_hf(hf, kernels="torch")
    ids, mask = ragged([100, 40])
    with torch.no_grad():
        assert max_error_on_real_tokens(fb(ids, attention_mask=mask).last_hidden_state,
                                        hf(ids, attention_mask=mask).last_hidden_state, mask) <= 1e-5
