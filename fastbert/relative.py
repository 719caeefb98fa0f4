"""Per-distance tables of an additive attention bias that depends only on (head, j - i).

Attention takes such a bias as a float32 table [nh, 2L - 1]: score(i, j) += table[h, (j - i) + L - 1], distances
beyond +-(L - 1) reading the end columns (fastbert.twins.relative_bias is the definition). The distance j - i does
not change when sequences are packed, so one table serves a whole padding-free batch, and nothing of size S x S is
formed. The tables are built by the model's own torch code, so that bucket boundaries are exactly its own.
"""
from __future__ import annotations

import torch


def relative_bias_table(weight: torch.Tensor, max_len: int, num_buckets: int = 32,
                        max_distance: int = 128) -> torch.Tensor:
    """MPNet's relative position bias as a table [nh, 2 * max_len - 1] (float32) for sequences of up to `max_len`
    tokens. `weight`: the `relative_attention_bias` embedding [num_buckets, nh]. The buckets come from transformers'
    own MPNetEncoder.relative_position_bucket (a float log: computed here in torch, never re-derived in a kernel).
    HF's MPNetEncoder.compute_position_bias always passes num_buckets=32, whatever the config says."""
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be the [num_buckets, num_heads] embedding, got shape {tuple(weight.shape)}")
    distance = torch.arange(-(max_len - 1), max_len, device=weight.device)  # j - i
    buckets = MPNetEncoder.relative_position_bucket(distance, num_buckets=num_buckets, max_distance=max_distance)
    return weight[buckets].t().float().contiguous()  # [nh, 2L - 1]
