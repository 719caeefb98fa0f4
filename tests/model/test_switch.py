"""The per-op switch: names, validation, "auto" resolution, explicit "triton" never falling back silently."""
import warnings

import pytest
import torch
from helpers import random_hf_bert

import fastbert
from fastbert import dispatch, ops
from fastbert.kernels import utils as kernel_utils

IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])


@pytest.fixture(scope="module")
def hf():
    return random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16)


def test_names():
    assert fastbert.OPS == ("qkv_projection", "attention", "bias_gelu", "residual_layernorm")
    assert fastbert.BACKENDS == ("auto", "torch", "triton")


def test_set_kernels_all_and_per_op(hf):
    fb = fastbert.BertModel.from_hf(hf)
    assert fb.kernels == dict.fromkeys(fastbert.OPS, "auto")
    fb.set_kernels("torch")
    assert fb.kernels == dict.fromkeys(fastbert.OPS, "torch")
    fb.set_kernels(attention="triton", bias_gelu="auto")
    assert fb.kernels == {"qkv_projection": "torch", "attention": "triton", "bias_gelu": "auto",
                          "residual_layernorm": "torch"}
    fb2 = fastbert.BertModel.from_hf(hf, kernels={"attention": "torch"})
    assert fb2.kernels["attention"] == "torch" and fb2.kernels["bias_gelu"] == "auto"
    fb.kernels["attention"] = "torch"  # a copy: changing it changes nothing
    assert fb.kernels["attention"] == "triton"


@pytest.mark.parametrize("call, words", [
    (lambda m: m.set_kernels("cuda"),
     "unknown backend 'cuda' for op 'qkv_projection'; the backends are auto, torch, triton"),
    (lambda m: m.set_kernels(softmax="torch"),
     "unknown op 'softmax'; the ops are qkv_projection, attention, bias_gelu, residual_layernorm"),
    (lambda m: m.set_kernels(attention="fast"), "unknown backend 'fast' for op 'attention'"),
])
def test_unknown_names_raise_listing_valid_ones(hf, call, words):
    with pytest.raises(ValueError) as info:
        call(fastbert.BertModel.from_hf(hf))
    assert words in str(info.value)


def test_auto_is_torch_on_cpu_without_the_interpreter(hf, monkeypatch):
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    cpu = torch.device("cpu")
    assert not dispatch.resolve("attention", "auto", cpu, lambda: None)
    fb = fastbert.BertModel.from_hf(hf, kernels="auto")
    ref = fastbert.BertModel.from_hf(hf, kernels="torch")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU is the expected place for the twin: nothing to warn about
        assert torch.equal(fb(IDS, attention_mask=MASK).last_hidden_state,
                           ref(IDS, attention_mask=MASK).last_hidden_state)


def test_explicit_triton_on_cpu_without_the_interpreter_raises(hf, monkeypatch):
    monkeypatch.setattr(kernel_utils, "INTERPRET", False)
    fb = fastbert.BertModel.from_hf(hf, kernels="torch").set_kernels(bias_gelu="triton")
    with pytest.raises(RuntimeError, match=r"op 'bias_gelu': backend 'triton' was requested but the tensors are on "
                                           r"cpu \(Triton kernels need CUDA tensors"):
        with torch.no_grad():
            fb(IDS, attention_mask=MASK)


def test_explicit_triton_without_triton_installed_raises(hf, monkeypatch):
    monkeypatch.setattr(dispatch, "_TRITON_IMPORT_ERROR", ["Triton could not be imported (ImportError: no triton)"])
    with pytest.raises(RuntimeError, match=r"asked for 'triton' but Triton could not be imported"):
        fastbert.BertModel.from_hf(hf, kernels="triton")
    fb = fastbert.BertModel.from_hf(hf, kernels="auto")  # auto quietly uses the twins
    with torch.no_grad():
        assert torch.isfinite(fb(IDS, attention_mask=MASK).last_hidden_state).all()


@pytest.mark.parametrize("reason_call, words", [
    (lambda qkv, mask: ops.attention(qkv, mask, 0.25, return_probs=True, backend="triton"), "output_attentions=True"),
    (lambda qkv, mask: ops.attention(qkv.requires_grad_(), mask, 0.25, backend="triton", window=1),
     "a window over padded rows has no backward"),
    (lambda qkv, mask: ops.attention(qkv, mask, 0.25, dropout_p=1.0, backend="triton"), "dropout_p=1.0"),
    (lambda qkv, mask: ops.attention(qkv[..., :8], ops.AttentionMask(2, 5), 0.25, backend="triton"),
     "head_dim=8 is not one of (16, 32, 64, 128)"),
    (lambda qkv, mask: ops.attention(qkv, ops.AttentionMask.build(torch.ones(2, 5, 5), 2, 5, torch.float32), 0.25,
                                     backend="triton"), "a custom 3-D/4-D attention mask"),
    (lambda qkv, mask: ops.attention(qkv.double(), mask, 0.25, backend="triton"), "dtype torch.float64"),
])
def test_explicit_triton_says_why_it_cannot_serve_a_call(reason_call, words):
    qkv = torch.randn(10, 3, 2, 16)
    mask = ops.AttentionMask.build(MASK, 2, 5, torch.float32)
    with pytest.raises(RuntimeError) as info:
        reason_call(qkv, mask)
    assert "backend 'triton' was requested but" in str(info.value) and words in str(info.value)


def test_auto_falls_back_per_call_and_warns_once(monkeypatch):
    """On a Triton-capable device (here: the interpreter), "auto" leaves a call it cannot serve to the twin, with one
    warning per op and reason, and gives the twin's numbers."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)  # CPU tensors count as Triton-capable here
    monkeypatch.setattr(dispatch, "_WARNED", set())
    qkv = torch.randn(10, 3, 2, 16)
    mask = ops.AttentionMask.build(MASK, 2, 5, torch.float32)
    with pytest.warns(UserWarning, match="op 'attention' runs on the PyTorch twin because output_attentions=True"):
        ctx, probs = ops.attention(qkv, mask, 0.25, return_probs=True, backend="auto")
    ref, ref_probs = ops.attention_torch(qkv, mask, 0.25, return_probs=True)
    assert torch.equal(ctx, ref) and torch.equal(probs, ref_probs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        ops.attention(qkv, mask, 0.25, return_probs=True, backend="auto")


# ---- calls a kernel cannot serve correctly: "auto" takes the twin (said once), "triton" raises, naming why ----------
def test_bf16_dots_under_the_interpreter(hf, monkeypatch):
    """Triton's interpreter cannot run a bf16 tl.dot (it returned errors of 1e10 in bias_gelu, 4.6 end to end).
    Under it, "auto" runs the twins of the three ops that use tl.dot and warns once per op; "triton" raises."""
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)  # CPU tensors count as Triton-capable, as in CI
    monkeypatch.setattr(dispatch, "_WARNED", set())
    bf16 = random_hf_bert(hidden=32, heads=2, layers=1, intermediate=40, vocab=50, max_pos=16).to(torch.bfloat16)
    ids, mask = IDS, MASK
    with torch.no_grad():
        want = fastbert.BertModel.from_hf(bf16, kernels="torch")(ids, attention_mask=mask).last_hidden_state
        # (residual_layernorm has no tl.dot and runs bf16 in the interpreter: tests/kernels/test_residual_layernorm.py.
        # It stays on its twin here so that this test means the same on a CUDA machine, where these are CPU tensors.)
        auto = fastbert.BertModel.from_hf(bf16, kernels="auto").set_kernels(residual_layernorm="torch")
        with pytest.warns(UserWarning) as record:
            got = auto(ids, attention_mask=mask).last_hidden_state
        warned = sorted(str(w.message).split("'")[1] for w in record)
        assert warned == ["attention", "bias_gelu", "qkv_projection"]
        assert all("interpreter" in str(w.message) and "bf16 tl.dot" in str(w.message) for w in record)
        assert torch.equal(got, want)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            auto(ids, attention_mask=mask)  # said once
        for op in ("qkv_projection", "attention", "bias_gelu"):
            strict = fastbert.BertModel.from_hf(bf16, kernels="torch").set_kernels(**{op: "triton"})
            with pytest.raises(RuntimeError, match=f"op '{op}': backend 'triton' was requested but Triton's "
                                                   f"interpreter .* cannot run a bf16 tl.dot"):
                strict(ids, attention_mask=mask)


def test_bf16_dot_launchers_refuse_under_the_interpreter(monkeypatch):
    """Called directly, the kernels' own launchers refuse rather than return garbage."""
    from fastbert.kernels import attention as attention_kernel
    from fastbert.kernels import bias_gelu as bias_gelu_kernel
    monkeypatch.setattr(kernel_utils, "INTERPRET", True)
    x, w = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(16, 32, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="cannot run a bf16 tl.dot"):
        bias_gelu_kernel.bias_gelu(x, w, None)
    with pytest.raises(NotImplementedError, match="cannot run a bf16 tl.dot"):
        attention_kernel.attention(torch.randn(8, 3, 2, 16, dtype=torch.bfloat16),
                                   torch.tensor([0, 4, 8], dtype=torch.int32), 4, 0.25)
