"""What the four units share: when a kernel serves a forward (inference or training), a custom op's backend
switch, and random inputs to time."""
from __future__ import annotations

import torch

from ..fallback import with_net
from ..mask import tracing


def op_dropout(op: str, situation) -> float:
    """The dropout probability `op` draws in `situation`: attention's on its probabilities, residual_layernorm's on
    the dense output; the GEMM ops draw none."""
    if op == "attention":
        return situation.attention_dropout
    return situation.hidden_dropout if op == "residual_layernorm" else 0.0


def trains(op: str, situation) -> bool:
    """Whether `op` runs its training path in `situation`: autograd records the forward, or the op draws dropout
    (a train-mode forward, even under no_grad). Its kernel is then the unit's `train_kernel`."""
    return situation.needs_grad or op_dropout(op, situation) > 0


def kernel_reason(op: str, situation, facts, train_reason, head_dim: int | None = None) -> str | None:
    """Why `op`'s kernel cannot serve `situation` (None when it can): in a forward that trains, why its train_kernel
    cannot (`train_reason(situation)`; a traced one runs the twins), then what the kernels support (`facts`:
    fastbert.kernels.utils)."""
    if trains(op, situation):
        if tracing():
            return "the forward is traced while it trains (the training kernels are autograd functions that " \
                   "torch.compile and export do not trace): the twins serve it"
        why = train_reason(situation)
        if why is not None:
            return why
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
