"""The model's modules, one file per layer shape; a family's axes pick its shape (`layer_class`).

    post_norm.py     x = LN(x + attention(x)), x = LN(x + FFN(x))        BERT, RoBERTa, ELECTRA, DistilBERT, MPNet
    disentangled.py  post-norm, attention adds c2p + p2c terms            DeBERTa-v2/v3
    pre_norm.py      x = x + attention(LN(x)), x = x + gated MLP(LN(x))   ModernBERT
    rotary_post_norm.py  post-norm, rotary q/k, plain or gated MLP       Jina-Embeddings-v3, NomicBERT, GTE
    rms_pre_norm.py  pre-norm with RMSNorm, grouped-query attention, SwiGLU    EuroBERT; Qwen3 (causal, q/k norms)
    sandwich_norm.py a (1 + w) RMSNorm before and after each sublayer      Gemma 3 (EmbeddingGemma)
    base.py          what the shapes share: HF's module paths, the dropouts' p, the module at a role now
    embeddings.py    token ids -> the first layer's input, per family
    fused_qkv.py     query/key/value as HF's modules over one fused weight
    host.py          the host-cost shortcuts the forwards take where nothing can tell

Each forward reads as its math through the four ops (fastbert/units/); what attention adds to its scores travels as
one units.attention.Extras.
"""
from __future__ import annotations

from .. import families
from .disentangled import DisentangledLayer
from .embeddings import embeddings_class
from .post_norm import PostNormLayer
from .pre_norm import PreNormLayer
from .rms_pre_norm import RMSPreNormLayer
from .rotary_post_norm import RotaryPostNormLayer
from .sandwich_norm import SandwichNormLayer

__all__ = ["DisentangledLayer", "PostNormLayer", "PreNormLayer", "RMSPreNormLayer", "RotaryPostNormLayer",
           "SandwichNormLayer", "embeddings_class", "layer_class"]


def layer_class(family: families.Family) -> type:
    """The layer shape a family's axes name (norm placement, MLP kind, attention bias kind, windows)."""
    if family.norm == "sandwich" and family.mlp == "gated" and family.attention_bias == "none":
        return SandwichNormLayer
    if family.norm == "pre" and family.norm_kind == "rms" and family.mlp == "gated" and family.attention_bias == "none":
        return RMSPreNormLayer
    if family.norm == "pre" and family.mlp == "gated" and family.attention_bias == "none":
        return PreNormLayer
    if family.norm == "post" and family.positions == "rotary" and family.attention_bias == "none" \
            and not family.windows:
        return RotaryPostNormLayer
    if family.norm == "post" and family.mlp == "plain" and not family.windows:
        return DisentangledLayer if family.attention_bias == "disentangled" else PostNormLayer
    raise NotImplementedError(f"{family.title}: no layer shape has norm={family.norm!r}, mlp={family.mlp!r}, "
                              f"attention_bias={family.attention_bias!r}, windows={family.windows}")
