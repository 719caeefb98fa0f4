"""What the four units share: the inference-only rule, a custom op's backend switch, and random inputs to time."""
from __future__ import annotations

import torch

from ..fallback import with_net


def inference_only(op: str, situation, facts, dropout: float = 0.0, head_dim: int | None = None) -> str | None:
    """Why `op`'s kernel cannot serve `situation` for the reasons every op shares: autograd, dropout, and what the
    kernels support (`facts`: fastbert.kernels.utils); None when it can."""
    if situation.needs_grad:
        return "autograd is needed (the kernels serve inference: wrap it in torch.no_grad())"
    if dropout > 0:
        return f"dropout is active (p={dropout}; the kernels serve inference: call model.eval())"
    return facts.call_unsupported(op, situation.dtype, head_dim)


def run_backend(op: str, backend: str, x: torch.Tensor, kernel, twin):
    """A custom op's body: the twin ("torch"), the kernel ("triton": its error reaches the caller), or the kernel
    under the safety net ("auto")."""
    if backend == "torch":
        return twin()
    if backend == "triton":
        return kernel()
    return with_net(op, x, x.device, kernel, twin)


def random_inputs(device, dtype):
    """rand(*shape, scale=1.0): seeded normal values in `dtype` on `device`, for the calls "auto" times."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)

    return rand, g
