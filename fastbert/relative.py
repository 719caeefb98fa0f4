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


def deberta_span(config) -> int:
    """DeBERTa-v2's attention span: rel_embeddings holds 2 * span rows (position_buckets when it buckets, else
    max_relative_positions, which HF reads as max_position_embeddings when < 1)."""
    buckets, max_relative = deberta_positions(config)
    return buckets if buckets > 0 else max_relative


def deberta_positions(config) -> tuple[int, int]:
    """(position_buckets, max_relative_positions) as HF's DisentangledSelfAttention and encoder read them."""
    max_relative = getattr(config, "max_relative_positions", -1)
    if max_relative < 1:
        max_relative = config.max_position_embeddings
    return getattr(config, "position_buckets", -1), max_relative


def deberta_column_distance(distance: torch.Tensor, span: int, buckets: int, max_relative: int) -> torch.Tensor:
    """The rel_embeddings row (HF's gathered column) of query i and key j at distance = j - i: HF's c2p index
    clamp(bucket(i - j) + span, 0, 2 * span - 1), bucket from transformers' own make_log_bucket_position (or i - j
    itself without buckets). HF's p2c index of the same pair is this same column (tests/model/test_deberta.py proves
    it with HF's own functions)."""
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    relative = -distance.long()  # HF's relative_pos[i, j] = i - j
    if buckets > 0 and max_relative > 0:  # as build_relative_position decides it
        relative = make_log_bucket_position(relative, buckets, max_relative).to(torch.long)
    return torch.clamp(relative + span, 0, 2 * span - 1)


def deberta_column_table(config, device=None) -> torch.Tensor:
    """int32 [2R - 1]: column[(j - i) + R - 1] = the rel_embeddings row that query i and key j read, for a reach R at
    which the column no longer changes outward (with log buckets some distance past max_relative_positions; without,
    at span). Distances beyond +-(R - 1) read the end entries, so one table serves every sequence length exactly."""
    with torch.device("cpu"):  # HF's bucket function makes tensors on the default device (meta, while a model is built)
        return _deberta_column_table(config).to(device=device)


def _deberta_column_table(config) -> torch.Tensor:
    buckets, max_relative = deberta_positions(config)
    span = deberta_span(config)
    # log buckets grow without bound, so the clamped column saturates: probe outward until the outer half of the probe
    # is constant on both sides (odd bucket counts saturate later than even ones)
    probe = 4 * max(span, max_relative) + 8
    while True:
        distance = torch.arange(-probe, probe + 1)
        columns = deberta_column_distance(distance, span, buckets, max_relative)
        changes = (columns[1:] != columns[:-1]).nonzero().flatten()  # a change between distance[k] and [k + 1]
        reach = 1 if changes.numel() == 0 else max(-int(distance[changes[0]]), int(distance[changes[-1] + 1])) + 1
        if 2 * reach <= probe:
            break
        if probe > 1 << 22:
            raise AssertionError(f"DeBERTa's relative-position columns still change at distance {reach - 1} "
                                 f"(position_buckets={buckets}, max_relative_positions={max_relative})")
        probe *= 4
    table = deberta_column_distance(torch.arange(-(reach - 1), reach), span, buckets, max_relative)
    return table.to(torch.int32)
