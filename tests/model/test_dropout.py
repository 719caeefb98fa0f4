"""Train-mode dropout of the PyTorch path (fastbert.twins.dropout) and the attention twin's dropout on the
probabilities: torch's semantics, the mask reused in backward, reproducible under torch.manual_seed."""
import math

import pytest
import torch
import torch.nn.functional as F

from fastbert import ops, twins
from fastbert.layout import TokenLayout
from fastbert.mask import AttentionMask


def _nonzero(*shape, seed=0):
    """Values bounded away from 0, so an output of 0 means dropped."""
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) + 0.5) * torch.where(torch.rand(*shape, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_kept_fraction_is_one_minus_p(p):
    x = torch.ones(2048, 2048)
    kept = (twins.dropout(x, p) != 0).double().mean().item()
    sigma = math.sqrt(p * (1 - p) / x.numel())  # binomial standard deviation of the kept fraction
    assert abs(kept - (1 - p)) <= 6 * sigma, f"kept {kept:.6f} of the elements for p={p} (6 sigma = {6 * sigma:.2e})"


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_kept_values_are_scaled_by_one_over_keep_and_dropped_ones_are_zero(p):
    x = _nonzero(512, 768)
    y = twins.dropout(x, p)
    kept = y != 0
    assert 0 < kept.sum() < x.numel()
    assert torch.equal(y[kept], x[kept] * torch.tensor(1 / (1 - p), dtype=torch.float32))
    assert torch.allclose(y[kept].double(), x[kept].double() / (1 - p), rtol=2 ** -23, atol=0)
    ref = F.dropout(x, p)  # torch's own scaling, where both happen to keep an element
    both = kept & (ref != 0)
    assert both.sum() > 0 and torch.equal(y[both], ref[both])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_gradient_is_the_forward_mask_times_the_scale(p):
    x = _nonzero(300, 257).requires_grad_()
    grad_out = torch.randn(300, 257)
    y = twins.dropout(x, p)
    y.backward(grad_out)
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    assert torch.equal(x.grad, torch.where(y != 0, grad_out * scale, torch.zeros(())))


def test_same_seed_same_mask_other_seed_other_mask():
    x = torch.ones(64, 768)
    torch.manual_seed(3)
    a = twins.dropout(x, 0.1)
    torch.manual_seed(3)
    b = twins.dropout(x, 0.1)
    torch.manual_seed(4)
    c = twins.dropout(x, 0.1)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_p_zero_returns_the_input_and_draws_no_random_numbers():
    x = torch.randn(16, 768, requires_grad=True)
    state = torch.get_rng_state()
    assert twins.dropout(x, 0.0) is x
    assert torch.equal(torch.get_rng_state(), state)


def test_p_one_drops_everything():
    x = torch.randn(4, 8, requires_grad=True)
    y = twins.dropout(x, 1.0)
    y.sum().backward()
    assert torch.equal(y, torch.zeros(4, 8)) and torch.equal(x.grad, torch.zeros(4, 8))


@pytest.mark.parametrize("p", [-0.1, 1.5])
def test_probability_outside_zero_one_is_refused(p):
    with pytest.raises(ValueError, match=f"p={p}"):
        twins.dropout(torch.ones(3), p)


def test_other_dtypes_are_torch_dropout():
    x = torch.randn(64, 768, dtype=torch.bfloat16)
    torch.manual_seed(5)
    ref = F.dropout(x, 0.1)
    torch.manual_seed(5)
    assert torch.equal(twins.dropout(x, 0.1), ref)


# ---- the attention twin with dropout on the probabilities -----------------------------------------------------
def _reference_attention(q, k, v, scale, p, additive=None):
    """fp64 softmax(q k^T * scale + additive) with the probabilities dropped by the mask the twin draws next from
    the default generator (one [.., nq, nk] float32 uniform draw per call), then @ v."""
    probs = torch.softmax(q.double() @ k.double().transpose(-1, -2) * scale
                          + (0 if additive is None else additive.double()), dim=-1)
    keep = torch.rand(probs.shape, dtype=torch.float32) >= p
    return (probs * keep / (1 - p)) @ v.double()


def test_varlen_attention_drops_the_probabilities_of_each_sequence():
    lengths, nh, hd, scale, p = [5, 17, 1, 33], 3, 8, 8 ** -0.5, 0.2
    qkv = torch.randn(sum(lengths), 3, nh, hd, requires_grad=True)
    layout = TokenLayout.from_cu_seqlens(torch.tensor([0] + lengths).cumsum(0), max(lengths), lengths)
    grad_out = torch.randn(sum(lengths), nh * hd)
    torch.manual_seed(11)
    ctx = ops.attention_varlen_torch(qkv, layout, scale, dropout_p=p)
    ctx.backward(grad_out)
    grad = qkv.grad
    qkv64 = qkv.detach().double().requires_grad_()
    torch.manual_seed(11)  # the twin's draws in its order: one per sequence
    ref = []
    for piece in qkv64.split(lengths):
        q, k, v = piece.permute(1, 2, 0, 3)  # [nh, L, hd] each
        ref.append(_reference_attention(q, k, v, scale, p).transpose(0, 1).reshape(piece.shape[0], nh * hd))
    ref = torch.cat(ref)
    ref.backward(grad_out.double())
    assert (ctx.double() - ref).abs().max() <= 1e-5
    assert (grad.double() - qkv64.grad).abs().max() <= 1e-4


def test_padded_attention_drops_the_probabilities_after_the_mask():
    B, S, nh, hd, scale, p = 2, 6, 2, 4, 0.5, 0.3
    keep = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    additive = torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]  # [B, 1, 1, S]
    mask = AttentionMask(batch_size=B, seq_len=S, key_valid=keep, additive=additive)
    qkv = torch.randn(B * S, 3, nh, hd)
    torch.manual_seed(2)
    ctx, _ = ops.attention_padded_torch(qkv, mask, scale, dropout_p=p)
    q, k, v = qkv.view(B, S, 3, nh, hd).permute(2, 0, 3, 1, 4)
    torch.manual_seed(2)
    ref = _reference_attention(q, k, v, scale, p, additive).transpose(1, 2).reshape(B * S, nh * hd)
    assert (ctx.double() - ref).abs().max() <= 1e-5


def test_windowed_attention_with_dropout_drops_within_the_window():
    L, nh, hd, window, scale, p = 40, 2, 8, 3, 0.25, 0.5
    qkv = torch.randn(L, 3, nh, hd)
    layout = TokenLayout.from_cu_seqlens(torch.tensor([0, L]), L, [L])
    torch.manual_seed(9)
    ctx = ops.attention_varlen_torch(qkv, layout, scale, p, window=window)
    q, k, v = qkv.permute(1, 2, 0, 3)
    i = torch.arange(L)
    band = torch.where((i[None, :] - i[:, None]).abs() <= window, 0.0, float("-inf"))  # [L, L]
    torch.manual_seed(9)
    ref = _reference_attention(q[None], k[None], v[None], scale, p, band)[0].transpose(0, 1).reshape(L, nh * hd)
    assert (ctx.double() - ref).abs().max() <= 1e-5
