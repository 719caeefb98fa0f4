"""Where a batch's real tokens are: the packed, padding-free layout every token-wise op runs on.

A padded batch [B, S] with attention_mask holds T <= B*S real tokens. The model gathers them once, before the
embeddings, into a packed [T, ...] order (row by row, left to right) and scatters the result back once at the end;
in between, every GEMM, LayerNorm and activation touches real tokens only, and attention sees where each sequence
starts and ends through `cu_seqlens` (FlashAttention's varlen contract). Padding costs nothing but the two copies.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class TokenLayout:
    """The packed layout of one batch.

    cu_seqlens: [n + 1] int32 on the device: sequence i is packed tokens cu_seqlens[i] : cu_seqlens[i + 1].
    max_seqlen: the longest sequence (host int; sizes the attention grid).
    num_tokens: T, the number of real tokens (host int).
    lengths:    the n sequence lengths on the host, when known (the CPU twin's attention loops over them); None
                when the layout was built without reading the device (a captured CUDA graph).
    indices:    [T] int64: where each packed token sits in the flattened [B * S] batch; None when nothing is padded
                (packed order == batch order, no gather or scatter at all).
    batch_size, seq_len: the padded shape (B, S) the outputs are scattered back to.
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    num_tokens: int
    lengths: tuple | None = None
    indices: torch.Tensor | None = None
    batch_size: int = 0
    seq_len: int = 0
    # every sequence has the same length (no padding): attention can run as one dense batch of batch_size x seq_len
    # (set once here: every layer asks)
    uniform: bool = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "uniform", self.indices is None and self.num_tokens == self.batch_size * self.seq_len)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @staticmethod
    def dense(batch_size: int, seq_len: int, device) -> "TokenLayout":
        """B rows of S real tokens each: nothing to gather."""
        cu = torch.arange(0, (batch_size + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
        return TokenLayout(cu, seq_len, batch_size * seq_len, (seq_len,) * batch_size, None, batch_size, seq_len)

    @staticmethod
    def from_mask(keep: torch.Tensor, lengths: list, num_tokens: int) -> "TokenLayout":
        """From a [B, S] bool key mask whose row lengths (`lengths`, host ints) and total were read in the model's one
        host sync. No further host read: nonzero_static's size is given."""
        B, S = keep.shape
        counts = keep.sum(dim=1, dtype=torch.int32)
        cu = torch.zeros(B + 1, dtype=torch.int32, device=keep.device)
        torch.cumsum(counts, dim=0, out=cu[1:])
        indices = torch.nonzero_static(keep.reshape(-1), size=num_tokens).reshape(-1)
        return TokenLayout(cu, max(lengths, default=0), num_tokens, tuple(lengths), indices, B, S)

    @staticmethod
    def from_cu_seqlens(cu_seqlens: torch.Tensor, max_seqlen: int, lengths) -> "TokenLayout":
        """Sequences back to back: sequence i is tokens cu_seqlens[i] : cu_seqlens[i + 1], of lengths[i] (host ints,
        read from cu_seqlens), T = sum(lengths) tokens."""
        return TokenLayout(cu_seqlens.to(torch.int32), max_seqlen, sum(lengths), tuple(lengths), None, len(lengths),
                           max_seqlen)


def token_bucket(tokens: int) -> int:
    """The power of two at or above `tokens` (at least 16): one backend choice serves every T in (bucket/2, bucket]."""
    return max(16, 1 << max(0, tokens - 1).bit_length())


def unpad(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[B, S, ...] -> packed [T, ...]: the real tokens, row by row."""
    flat = x.reshape(layout.batch_size * layout.seq_len, *x.shape[2:])
    return flat if layout.indices is None else flat.index_select(0, layout.indices)


def pad(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """Packed [T, H] -> [B, S, H], zeros at padded positions."""
    B, S = layout.batch_size, layout.seq_len
    if layout.indices is None:
        return x.view(B, S, *x.shape[1:])
    out = x.new_zeros(B * S, *x.shape[1:])
    out.index_copy_(0, layout.indices, x)
    return out.view(B, S, *x.shape[1:])


def first_tokens(x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
    """[n, H]: each sequence's first real token (a zero vector for a sequence with none)."""
    if layout.uniform:  # sequences of seq_len tokens back to back: every seq_len-th row (a view, no gather)
        return x[::layout.seq_len]
    starts = layout.cu_seqlens[:-1].long()
    empty = layout.cu_seqlens[1:] == layout.cu_seqlens[:-1]
    x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])  # row T: the zero vector empty sequences point at
    return x.index_select(0, starts.masked_fill(empty, x.shape[0] - 1))
