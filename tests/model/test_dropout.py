"""Train-mode dropout of the PyTorch path (fastbert.twins.dropout): torch's semantics, the mask reused in backward,
reproducible under torch.manual_seed."""
import math

import pytest
import torch
import torch.nn.functional as F

from fastbert import twins


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
