"""DeBERTa-v2/v3's layer: the post-norm layer whose attention adds disentangled position terms.

    scores = (q k^T + c2p + p2c) * scale,  scale = 1 / sqrt(hd * (1 + number of terms))
    c2p[i, j] = q_i . pk[column(j - i)]     pk = rel_embeddings through key_proj (or pos_key_proj)
    p2c[i, j] = k_j . pq[column(i - j)]     pq = rel_embeddings through query_proj (or pos_query_proj)

Per token the terms are two batched GEMMs against the P relative embeddings (`terms`); attention gathers them at
one bucketed column per distance (twins.Disentangled), so no [T, T] tensor of positions is ever built. The rest of
the layer is post_norm.py's.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import config as configs
from .. import families, twins
from ..mask import tracing
from ..units.attention import NONE, Extras
from .post_norm import PostNormLayer


class DisentangledLayer(PostNormLayer):
    """DeBERTa-v2's layer (HF's DebertaV2Layer) at its module paths."""

    def __init__(self, config, family: families.Family = families.DEBERTA_V2, index: int = 0):
        super().__init__(config, family, index)
        H = config.hidden_size
        pos_att_type = configs.deberta_pos_att_type(config)
        factor = 1 + ("c2p" in pos_att_type) + ("p2c" in pos_att_type)
        # HF's float32 sqrt, so that the scale is bit-identical (on the CPU: a model may be built on meta). HF counts
        # the terms even without relative_attention.
        head_dim = torch.tensor(H // config.num_attention_heads, dtype=torch.float, device="cpu")
        self.pos_scale = float(torch.sqrt(head_dim * factor))
        self.scale = 1.0 / self.pos_scale
        relative_attention = getattr(config, "relative_attention", False)
        self.c2p = relative_attention and "c2p" in pos_att_type
        self.p2c = relative_attention and "p2c" in pos_att_type
        self.share_att_key = getattr(config, "share_att_key", False)
        sa = self.self_attention  # pos_key_proj / pos_query_proj: HF's module names, after value_proj
        if relative_attention and not self.share_att_key:
            if self.c2p:
                sa.add_module("pos_key_proj", nn.Linear(H, H))
            if self.p2c:
                sa.add_module("pos_query_proj", nn.Linear(H, H))
        self.__dict__["_columns"] = {}  # the model's column table per device (BertModel shares one with every layer)

    def dropout_paths(self, config) -> dict:
        paths = dict(self.family.dropouts)
        if not getattr(config, "relative_attention", False):  # pos_dropout exists with relative attention only
            del paths["positions"]
        return paths

    def extras(self, qkv, w_qkv, b_qkv, positions, p_pos: float) -> Extras:
        terms = self.terms(qkv, w_qkv, b_qkv, positions, p_pos)
        return NONE if terms is None else Extras(disentangled=terms)

    def terms(self, qkv, w_qkv, b_qkv, positions, p_pos: float) -> twins.Disentangled | None:
        """The per-token terms from this forward's rel_embeddings [P, H] (`positions`: that tensor or None; a
        positional tensor, so that reentrant checkpointing hands it its gradient): pk / pq through the modules HF
        uses (key_proj / query_proj: the fused weight's rows while they are plain linears, else the module, adapter
        included; or pos_key_proj / pos_query_proj), then c2p = q @ pk^T and p2c = k @ pq^T per head as two batched
        GEMMs over the tokens, float32, scaled."""
        if positions is None or not (self.c2p or self.p2c):
            return None
        rel, column = positions, _column_table(self._columns, positions.device)
        if p_pos > 0:  # HF's pos_dropout (its p now), drawn in every layer
            rel = twins.dropout(rel, p_pos)
        P, H = rel.shape
        nh = self.num_heads
        sa = self.self_attention

        def project(part: int, own: str) -> torch.Tensor:  # -> [nh, hd, P]
            if not self.share_att_key:
                out = sa._modules[own](rel)
            else:
                module = sa._modules[sa.names[part]]
                out = F.linear(rel, w_qkv[part * H:(part + 1) * H], b_qkv[part * H:(part + 1) * H]) \
                    if type(module) is nn.Linear else module(rel)
            return out.view(P, nh, H // nh).permute(1, 2, 0)

        def term(part: int, positional: torch.Tensor) -> torch.Tensor:  # [T, nh, P] (a view of [nh, T, P])
            content = qkv[:, part].transpose(0, 1)                                            # [nh, T, hd]
            return torch.bmm(content, positional).float().div_(self.pos_scale).transpose(0, 1)

        c2p = term(0, project(1, "pos_key_proj")) if self.c2p else None
        p2c = term(1, project(0, "pos_query_proj")) if self.p2c else None
        return twins.Disentangled(c2p, p2c, column)


def _column_table(columns: dict, device) -> torch.Tensor:
    """DeBERTa's column table (relative.deberta_column_table, built once per model on the CPU) on `device`."""
    key = str(device)
    if key not in columns:
        if tracing():  # a constant of the traced graph
            return columns["cpu"].to(device)
        columns[key] = columns["cpu"].to(device)
    return columns[key]
