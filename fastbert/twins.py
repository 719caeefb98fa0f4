"""What the PyTorch twins of the four ops share (each op's twin is in its unit, fastbert/units/): train-mode
dropout, the workspace the CPU twins write into, the activations, rotary tables, the per-distance bias table, the
window band, and DeBERTa's per-token terms. Every op works on token-major 2-D matrices [T, features] (T = real
tokens, packed).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch
import torch.nn.functional as F

# hidden_act -> the activation name the kernels understand. HF's "gelu" is the exact erf GELU; "gelu_new" and
# "gelu_pytorch_tanh" are the same tanh approximation computed two ways; "silu" is x * sigmoid(x) (gated: SwiGLU).
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu",
               "silu": "silu"}


def dropout(x: torch.Tensor, p: float) -> torch.Tensor:
    """Train-mode dropout with F.dropout's semantics: each element kept with probability 1 - p and scaled by
    1 / (1 - p), the same mask in backward, drawn from torch's default generator (torch.manual_seed fixes it); p = 0
    returns x itself. On CPU in float32 the mask comes from torch.rand_like, measured faster there than F.dropout's
    bernoulli_ (bench/RESULTS.md, "train-mode dropout"); elsewhere (CUDA, other dtypes: not measured) F.dropout."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got p={p!r}")
    if p == 0.0:
        return x
    if p == 1.0 or x.device.type != "cpu" or x.dtype != torch.float32:
        return F.dropout(x, p)
    # F.dropout's CPU math (x * noise, autograd saves only the noise) with uniform draws instead of bernoulli_
    noise = torch.rand_like(x).ge_(p).mul_(1.0 / (1.0 - p))
    return x * noise


class Workspace:
    """Buffers one inference forward on CPU reuses from layer to layer, by name: glibc returns every allocation over
    32 MB to the OS when it is freed, so a fresh [T, 3H] GEMM output page-faults in again in every layer (4.4 M minor
    faults a ModernBERT-base forward of 17,942 tokens: bench/RESULTS.md). Only for calls that neither autograd nor a
    trace records; a name's buffer is overwritten by the next layer, so nothing in one may outlive its layer."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        """The buffer `name` of `shape` with `like`'s dtype and device (allocated when its shape or dtype changes)."""
        buf = self._buffers.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt=None) -> torch.Tensor:
    """A layer's linear that no fused op holds (a pre-norm layer's output GEMMs): F.linear, or the GEMM in number
    format `fmt` (formats.Format; fp32 out). x may be in the format's working dtype (bias_gelu's output is bf16 in
    the bf16 format: Format.hidden)."""
    return F.linear(x, weight, bias) if fmt is None else fmt.linear(x, weight, bias)


def add_linear(stream: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               fmt=None) -> torch.Tensor:
    """stream + (x @ W^T + b), a pre-norm layer's output linear added to the stream: without a bias one addmm that
    adds the stream; in a format, its GEMM (fp32 out) and then the stream added to that fresh output."""
    if fmt is not None:
        return fmt.linear(x, weight, bias).add_(stream)
    return torch.addmm(stream, x, weight.t()) if bias is None else stream + F.linear(x, weight, bias)


def linear_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, workspace: Workspace,
                 name: str) -> torch.Tensor:
    """F.linear(x [T, K], W [N, K], b) into the workspace's buffer `name` (the same GEMM F.linear calls: addmm with a
    bias, mm without). The twins call F.linear themselves when there is no workspace: a call frame here would be
    host work on every op of every layer."""
    out = workspace.take(name, (x.shape[0], weight.shape[0]), x)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


class Rotary(NamedTuple):
    """Rotary position embeddings for one attention call: cos and sin of position * inv_freq, float32 [T, hd/2], one
    row per token in the attention's token order (packed T, or B*S padded). q and k are rotated in float32 by
    rotate-half (HF's apply_rotary_pos_emb: the frequencies repeat over both halves of a head) and rounded back to
    their dtype before the product, as HF does."""
    cos: torch.Tensor
    sin: torch.Tensor


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float = 1.0) -> Rotary:
    """positions [T] (int) and inv_freq [hd/2] (float32) -> Rotary. The product is HF's (position as float32 times
    inv_freq), so every angle, and its cos and sin, is bit-identical to transformers'; `factor`: the attention factor
    of a scaled rope type, which HF multiplies cos and sin by."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    if factor != 1.0:
        return Rotary(freqs.cos() * factor, freqs.sin() * factor)
    return Rotary(freqs.cos(), freqs.sin())


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., L, hd] rotated by cos/sin [L, hd/2] (broadcast over the leading dims), in float32, back in x's dtype:
    HF's q * cos + rotate_half(q) * sin with cos = cat(c, c)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def window_mask(num_queries: int, num_keys: int, window: int, device, query_start: int = 0,
                key_start: int = 0) -> torch.Tensor:
    """bool [num_queries, num_keys]: True where |i - j| <= window, i = query_start + row, j = key_start + column
    (HF's bidirectional sliding window: inclusive)."""
    i = torch.arange(query_start, query_start + num_queries, device=device)
    j = torch.arange(key_start, key_start + num_keys, device=device)
    return (j[None, :] - i[:, None]).abs() <= window


def relative_bias(table: torch.Tensor, num_queries: int, num_keys: int, dtype: torch.dtype, query_start: int = 0,
                  key_start: int = 0) -> torch.Tensor:
    """The scores bias of one sequence, [nh, num_queries, num_keys] in `dtype`, from a per-distance table:
    B[h, i, j] = table[h, (j - i) + L - 1] for a table [nh, 2L - 1], i = query_start + row, j = key_start + column.
    Distances beyond +-(L - 1) read the table's end columns (T5/MPNet buckets are constant from some distance on: a
    table reaching it is exact at every distance)."""
    reach = (table.shape[1] - 1) // 2
    keys = torch.arange(key_start, key_start + num_keys, device=table.device)
    queries = torch.arange(query_start, query_start + num_queries, device=table.device)
    distance = keys[None, :] - queries[:, None]  # [num_queries, num_keys]: j - i
    return table[:, (distance + reach).clamp_(0, 2 * reach)].to(dtype)


@dataclasses.dataclass(frozen=True)
class Disentangled:
    """DeBERTa-v2's position terms of one attention call, per token, never per (i, j) pair:
        score(i, j) = (q_i . k_j) * scale + c2p[tok(i), h, col] + p2c[tok(j), h, col],  col = column[j - i + L - 1]
    c2p: [T, nh, P] per query token, q_t . pk[h, p] / sqrt(d * sf) (None: no c2p term); p2c: [T, nh, P] per key token,
    k_t . pq[h, p] / sqrt(d * sf) (None: no p2c term); any float dtype, unit stride along P, any strides on T and nh.
    column: int32 [2L - 1], the rel_embeddings row (P = 2 * span of them) each distance j - i reads; |j - i| > L - 1
    reads the end entries (fastbert.relative.deberta_column_table). tok(i): the row of qkv holding query i. The terms
    are added in float32 before the softmax; at least one of c2p / p2c is given."""
    c2p: torch.Tensor | None
    p2c: torch.Tensor | None
    column: torch.Tensor


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    if activation == "gelu":
        return F.gelu(h)
    if activation == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if activation == "relu":
        return F.relu(h)
    if activation == "silu":
        return F.silu(h)
    raise ValueError(f"activation={activation!r} is not one of {sorted(set(ACTIVATIONS.values()))}")


def activate_into(a: torch.Tensor, activation: str, out: torch.Tensor) -> torch.Tensor:
    """activate(a) written into `out` (the same kernels: gelu's out= variant, not gelu_, which rounds
    differently)."""
    if activation == "gelu":
        return torch._C._nn.gelu(a, out=out)
    if activation == "gelu_tanh":
        return torch._C._nn.gelu(a, approximate="tanh", out=out)
    if activation == "relu":
        return torch.clamp_min(a, 0, out=out)
    if activation == "silu":
        return torch._C._nn.silu(a, out=out)  # F.silu's own kernel
    raise ValueError(f"activation={activation!r} is not one of {sorted(set(ACTIVATIONS.values()))}")


def default_scale(head_dim: int) -> float:
    return head_dim ** -0.5  # written as HF writes it, so the float is bit-identical
