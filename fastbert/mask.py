"""The padding mask a forward computes once, and whether the forward is being traced.

The rules for `attention_mask` are in `AttentionMask`'s docstring (and the README's "Masks"): 2-D masks are key
padding, 3-D/4-D masks are custom (only the PyTorch twin serves those), a floating 4-D mask is additive.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def tracing() -> bool:
    """True while torch.jit.trace, torch.compile or torch.export records the forward: then nothing may branch on a
    tensor's values or read one back to the host, because the recorded graph must serve every later input."""
    return torch.jit.is_tracing() or torch.compiler.is_compiling()


@dataclass(frozen=True)
class AttentionMask:
    """What attention needs to know about padding. Built once per forward by `AttentionMask.build`.

    The rules for `attention_mask` (README, "Masks"):
      2-D [B, S]           key padding: 1 / True = a real token, 0 / False = padding. Any dtype; values must be 0 or 1.
      3-D [B, S, S]        query i may attend to key j where 1 / True. Any dtype, float included; values 0 or 1.
      4-D [B, 1|nh, S, S]  bool or integer: 1 / True = may attend (values 0 or 1); floating: additive, added to the
                           scores as is (0 = attend, a large negative number = masked), as Hugging Face does.
    The model checks the 0/1 values (in its one host sync); this class trusts them.

    batch_size, seq_len: the padded shape; tokens are laid out row-major, T = batch_size * seq_len.
    key_valid: [B, S] bool, True where the key is a real token; None when every key is real (no mask work at all).
    additive:  the mask in the compute dtype, 0 where attended and finfo(dtype).min where masked, [B, 1, 1, S] from
               a 2-D mask or [B, 1|nh, S, S] from a 3-D/4-D one (torch path).
    custom:    True when the user gave a 3-D/4-D mask; only the torch twin serves those.
    empty_rows: [B, 1, 1, 1] bool, True for fully padded rows; None when there is none (decided once per forward).
    pairwise:  HF DeBERTa's rule, mask_i * mask_j: every padded query (in any row) attends uniformly to all S keys.

    A fully padded row (attention_mask all 0) follows HF's eager path: every score is finfo.min, softmax of equal
    values is uniform, so each query of that row attends uniformly to all S keys (its output is the mean of the
    row's values). It stays finite and does not touch other rows. (HF's sdpa path returns something else there.)
    """

    batch_size: int
    seq_len: int
    key_valid: torch.Tensor | None = None
    additive: torch.Tensor | None = None
    custom: bool = False
    empty_rows: torch.Tensor | None = None
    pairwise: bool = False

    @staticmethod
    def build(attention_mask: torch.Tensor | None, batch_size: int, seq_len: int, dtype: torch.dtype,
              flags: tuple | None = None) -> "AttentionMask":
        """flags: `padding_flags` of a 2-D mask, already read by the caller (the model reads them in the same host
        sync as its input checks); None = read them here. While tracing, nothing is read: the mask is always applied
        and the fully-padded-row rule always runs, so the recorded graph is right for any mask."""
        if attention_mask is None:
            return AttentionMask(batch_size, seq_len)
        min_value = torch.finfo(dtype).min
        if attention_mask.dim() == 2:
            keep = attention_mask != 0
            if tracing():
                all_real, no_empty_row = False, False
            else:
                all_real, no_empty_row = flags if flags is not None else padding_flags(keep).tolist()
            if all_real:  # the common unpadded batch: no mask at all, attention takes its dense path
                return AttentionMask(batch_size, seq_len)
            additive = torch.zeros(batch_size, 1, 1, seq_len, dtype=dtype, device=keep.device)
            additive.masked_fill_(~keep[:, None, None, :], min_value)
            empty_rows = None if no_empty_row else ~keep.any(dim=1)[:, None, None, None]
            return AttentionMask(batch_size, seq_len, keep, additive, empty_rows=empty_rows)
        mask = attention_mask[:, None] if attention_mask.dim() == 3 else attention_mask
        if attention_mask.dim() == 4 and mask.is_floating_point():
            additive = mask.to(dtype)  # already additive: Hugging Face adds a float 4-D mask to the scores as is
        else:
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask == 0, min_value)
        return AttentionMask(batch_size, seq_len, additive=additive, custom=True)


def padding_flags(keep: torch.Tensor) -> torch.Tensor:
    """[2] int64 for a [B, S] bool key mask: (every key is real, every row has a real key), for one host read."""
    return torch.stack([keep.all(), keep.any(dim=1).all()]).long()


def not_zero_one(mask: torch.Tensor) -> torch.Tensor:
    """0-dim bool: does a 0/1 mask hold any other value? (Always False for a bool mask.)"""
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=torch.bool, device=mask.device)
    if not mask.is_floating_point():  # 0 and 1 are the integers with no bit set above the lowest: one op, not three
        return mask.bitwise_and(-2).any()
    return ((mask != 0) & (mask != 1)).any()
