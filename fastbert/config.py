"""Configs: the model's config is the transformers config of its architecture, checked once at the boundary.

fastbert keeps no config class of its own. A model built from a folder gets the transformers config that
`transformers.AutoConfig` would build for that folder; a model built from an in-memory transformers model (from_hf,
fastbert.optimize) keeps that model's config object itself, the one its head shares. So everything that reads or sets
a config (a head's `config.use_return_dict`, sentence-transformers' `config.output_hidden_states`, Trainer, a
pipeline, `save_pretrained`) sees one object, and what transformers writes to config.json is what fastbert writes.

What fastbert adds is the check: every field the model reads is validated when a config reaches it (a config.json's
raw contents before transformers sees them, so that the error names the file and the field), and a `model_type`
outside the families fastbert runs (fastbert/families.py), or a feature of one it does not run (decoders,
cross-attention, BERT's relative positions), is refused by name rather than run as something else.
"""
from __future__ import annotations

import json
import os

from . import families, rotary
from .twins import ACTIVATIONS

# model_type -> its family (fastbert/families.py: where its tensors live, what its config calls each field, and the
# value of each axis: embeddings, attention bias, pooler). The layers are the same four ops for all of them.
MODEL_TYPES = tuple(families.MODEL_TYPES)

# Field -> (what it must be, the bound). Checked when a config reaches the model, so a bad config.json fails at
# load time naming the file and the field, not later inside torch.
_INT, _FLOAT, _STR, _BOOL = "an integer", "a number", "a string", "true or false"
_FIELD_RULES = {
    "vocab_size": (_INT, 1), "hidden_size": (_INT, 1), "num_hidden_layers": (_INT, 0),
    "num_attention_heads": (_INT, 1), "intermediate_size": (_INT, 1), "max_position_embeddings": (_INT, 1),
    "type_vocab_size": (_INT, 1), "pad_token_id": (_INT, 0), "embedding_size": (_INT, 1),
    "hidden_dropout_prob": (_FLOAT, (0.0, 1.0)), "attention_probs_dropout_prob": (_FLOAT, (0.0, 1.0)),
    "layer_norm_eps": (_FLOAT, (0.0, None)), "initializer_range": (_FLOAT, (0.0, None)),
    "hidden_act": (_STR, None), "position_embedding_type": (_STR, None),
    "is_decoder": (_BOOL, None), "add_cross_attention": (_BOOL, None),
    "relative_attention_num_buckets": (_INT, 32),  # MPNet: HF's forward always reads 32 buckets
}
# May be null or absent: pad_token_id (BERT only), position_embedding_type (transformers 5 dropped it: absolute),
# embedding_size (ELECTRA only), the decoder flags (absent = False); type_vocab_size and the bucket count where the
# family has no such table.
_OPTIONAL = {"pad_token_id", "position_embedding_type", "embedding_size", "is_decoder", "add_cross_attention",
             "type_vocab_size", "relative_attention_num_buckets"}


def check_fields(values: dict, where: str = "config", family: families.Family = families.BERT,
                 absent_ok: bool = False) -> None:
    """Each field the model reads has the right type and range; raises ValueError naming `where` and the field as
    the family's config spells it. `values`: a config.json's contents (or a config's attributes), by those names.
    absent_ok: a field missing from `values` is left to the config class's default (checked once it is built)."""
    for name, (kind, bound) in _FIELD_RULES.items():
        if absent_ok and family.raw_name(name) not in values and name not in family.fixed:
            continue
        value = family.fixed.get(name, values.get(family.raw_name(name)))
        if value is None and name in _OPTIONAL:
            continue
        bound = family.bounds.get(name, bound)
        name = family.raw_name(name)
        if kind == _INT:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= bound
            wanted = f"an integer >= {bound}"
        elif kind == _FLOAT:
            low, high = bound
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= low
                  and (high is None or value <= high))
            wanted = f"a number in [{low}, {high}]" if high is not None else f"a number >= {low}"
        elif kind == _STR:
            ok, wanted = isinstance(value, str), kind
        else:
            ok, wanted = isinstance(value, bool), kind
        if not ok:
            raise ValueError(f"{where}: field {name!r} must be {wanted}, got {value!r} ({type(value).__name__})")


def check_model_type(model_type, where: str = "config") -> str:
    if model_type not in families.MODEL_TYPES:
        raise NotImplementedError(f"{where}: model_type={model_type!r} is not implemented by fastbert (it implements "
                                  f"{', '.join(MODEL_TYPES)}); loading it as BERT would give wrong numbers")
    family = families.MODEL_TYPES[model_type][0]
    if family.min_transformers is not None:
        import transformers
        from packaging.version import Version
        if Version(transformers.__version__) < Version(family.min_transformers):
            raise NotImplementedError(f"{where}: model_type={model_type!r} needs transformers >= "
                                      f"{family.min_transformers} (its {family.title} definition and config), but "
                                      f"transformers {transformers.__version__} is installed; upgrade it")
    return model_type


def check_supported(config, where: str = "config") -> None:
    """Raise for any config the model cannot run faithfully (rather than silently running something else). `config`
    is a transformers config; `where` names it in the error (a file, or the module that holds it)."""
    model_type = check_model_type(getattr(config, "model_type", None), where)
    family = families.of(config)
    values = {family.raw_name(name): family.get(config, name) for name in _FIELD_RULES}
    check_fields(values, where, family)
    values = {name: family.get(config, name) for name in _FIELD_RULES}
    position = values["position_embedding_type"] or "absolute"
    if position != "absolute":
        raise NotImplementedError(f"{where}: position_embedding_type={position!r} is not supported (only 'absolute')")
    if values["is_decoder"]:
        raise NotImplementedError(f"{where}: is_decoder=True is not supported: fastbert is an encoder "
                                  f"(bidirectional attention)")
    if values["add_cross_attention"]:
        raise NotImplementedError(f"{where}: add_cross_attention=True is not supported: fastbert has no "
                                  f"cross-attention")
    if values["hidden_act"] not in ACTIVATIONS:
        raise NotImplementedError(f"{where}: {family.raw_name('hidden_act')}={values['hidden_act']!r} is not "
                                  f"supported; supported: {', '.join(ACTIVATIONS)}")
    if values["hidden_size"] % values["num_attention_heads"] and not family.head_dim_field:
        raise ValueError(f"{where}: {family.raw_name('hidden_size')}={values['hidden_size']} is not a multiple of "
                         f"{family.raw_name('num_attention_heads')}={values['num_attention_heads']}")
    kv_heads = getattr(config, "num_key_value_heads", None)  # EuroBERT's grouped-query attention
    if kv_heads is not None and (not isinstance(kv_heads, int) or kv_heads < 1
                                 or values["num_attention_heads"] % kv_heads):
        raise ValueError(f"{where}: num_key_value_heads={kv_heads!r} must be a positive integer dividing "
                         f"num_attention_heads={values['num_attention_heads']}")
    head_dim = getattr(config, "head_dim", None)  # NomicBERT's config may set one apart from hidden / heads
    if family.head_dim_field:  # Qwen3: the heads' width is the config's own
        if head_dim is not None and (not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 2
                                     or head_dim % 2):
            raise ValueError(f"{where}: head_dim={head_dim!r} must be an even positive integer (rotary halves it)")
    elif isinstance(head_dim, int) and head_dim * values["num_attention_heads"] != values["hidden_size"]:
        raise NotImplementedError(f"{where}: head_dim={head_dim} is not supported: fastbert's heads split "
                                  f"hidden_size={values['hidden_size']} into num_attention_heads="
                                  f"{values['num_attention_heads']}")
    if family.causal and (getattr(config, "use_sliding_window", False)
                          or rotary.SLIDING in (getattr(config, "layer_types", None) or ())):
        raise NotImplementedError(f"{where}: use_sliding_window=True is not supported for model_type={model_type!r}: "
                                  f"fastbert runs its causal layers over the whole sequence (Qwen3-Embedding's "
                                  f"checkpoints have no sliding layers)")
    if family.norm == "sandwich":
        check_gemma(config, where)
    if family.attention_bias == "buckets" and values["relative_attention_num_buckets"] is None:
        raise ValueError(f"{where}: field 'relative_attention_num_buckets' must be set for model_type={model_type!r}")
    if family.attention_bias == "disentangled":
        check_deberta(config, where)
    if family.positions == "rotary":  # each layer's type and its rotary theta are readable (else ValueError)
        for layer_type in set(rotary.layer_types(config)):
            rotary.rope_theta(config, layer_type)
    if family.positions == "padding_idx":
        pad = family.padding_idx if family.padding_idx is not None else values["pad_token_id"]
        if pad is None:
            raise ValueError(f"{where}: field 'pad_token_id' must be set for model_type={model_type!r} (its "
                             f"position ids count from pad_token_id + 1)")
        if values["max_position_embeddings"] <= pad + 1:
            raise ValueError(f"{where}: max_position_embeddings={values['max_position_embeddings']} leaves no "
                             f"position after padding_idx={pad} (positions start at padding_idx + 1)")


def check_gemma(config, where: str = "config") -> None:
    """Gemma 3 as EmbeddingGemma runs it: attending both ways, no logit soft-capping, a positive sliding window and a
    query_pre_attn_scalar; anything else is refused by name."""
    if not getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError(f"{where}: use_bidirectional_attention=False is not supported: fastbert runs Gemma 3 "
                                  f"as an encoder, attending both ways (EmbeddingGemma's configuration)")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise NotImplementedError(f"{where}: attn_logit_softcapping={softcap!r} is not supported (EmbeddingGemma has "
                                  f"none)")
    for name in ("sliding_window", "query_pre_attn_scalar"):
        value = getattr(config, name, None)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: field {name!r} must be a positive number, got {value!r}")


# DeBERTa-v2's attention terms (HF's DisentangledSelfAttention: "p2p" and others are not computed there either)
DEBERTA_POS_ATT_TYPES = ("c2p", "p2c")
DEBERTA_NORM_REL_EBD = ("layer_norm", "none")


def deberta_pos_att_type(config) -> list:
    """pos_att_type as HF's attention reads it: a list ("p2c|c2p" strings are split and lower-cased, as its config
    class does; None is no term). HF computes c2p and p2c where the list holds exactly those names, nothing else:
    transformers' own model tests run pos_att_type="None" (["none"]) as plain attention."""
    value = getattr(config, "pos_att_type", None)
    if value is None:
        return []
    if isinstance(value, str):
        return [x.strip() for x in value.lower().split("|")]
    return list(value)


def _no_term(entry) -> bool:
    """An entry that asks for no term: "none" in any case, or empty ("c2p|" leaves one)."""
    return isinstance(entry, str) and entry.strip().lower() in ("none", "")


def deberta_norm_rel_ebd(config) -> list:
    return [x.strip() for x in str(getattr(config, "norm_rel_ebd", "none")).lower().split("|")]


def check_deberta(config, where: str = "config") -> None:
    """The DeBERTa-v2/v3 fields fastbert's layer reads; anything it does not implement is refused by name."""
    conv = getattr(config, "conv_kernel_size", 0)
    if not isinstance(conv, int) or isinstance(conv, bool) or conv > 0:
        raise NotImplementedError(f"{where}: conv_kernel_size={conv!r} is not supported: DeBERTa-v2's ConvLayer "
                                  f"after the first layer (deberta-v2-xlarge/xxlarge) is not implemented by fastbert")
    value = getattr(config, "pos_att_type", None)
    if not isinstance(value, (str, list, tuple, type(None))):
        raise ValueError(f"{where}: field 'pos_att_type' must be a string like \"p2c|c2p\", a list of names or null, "
                         f"got {value!r} ({type(value).__name__})")
    # HF computes no term for an entry it does not know, silently: an entry naming a term it skips ("p2p", "C2P" in a
    # list) is refused rather than run as less than it says; "none" asks for no term, and gets none
    bad = [t for t in deberta_pos_att_type(config) if t not in DEBERTA_POS_ATT_TYPES and not _no_term(t)]
    if bad:
        raise NotImplementedError(f"{where}: pos_att_type={value!r} is not supported: its entries must be among "
                                  f"{', '.join(DEBERTA_POS_ATT_TYPES)} or 'none' (transformers computes no term for "
                                  f"{', '.join(map(repr, bad))})")
    norms = deberta_norm_rel_ebd(config)
    if any(n not in DEBERTA_NORM_REL_EBD for n in norms):
        raise NotImplementedError(f"{where}: norm_rel_ebd={getattr(config, 'norm_rel_ebd', None)!r} is not "
                                  f"supported (only {' or '.join(map(repr, DEBERTA_NORM_REL_EBD))})")
    head = getattr(config, "attention_head_size", None)
    if head is not None and head * config.num_attention_heads != config.hidden_size:
        raise NotImplementedError(f"{where}: attention_head_size={head!r} is not supported: fastbert's heads split "
                                  f"hidden_size={config.hidden_size} into num_attention_heads="
                                  f"{config.num_attention_heads}")
    for name, default in (("relative_attention", False), ("share_att_key", False), ("position_biased_input", True)):
        value = getattr(config, name, default)
        if not isinstance(value, bool):
            raise ValueError(f"{where}: field {name!r} must be true or false, got {value!r}")
    for name in ("position_buckets", "max_relative_positions"):
        value = getattr(config, name, -1)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if getattr(config, "relative_attention", False) and getattr(config, "position_buckets", -1) == 1:
        raise ValueError(f"{where}: position_buckets=1 leaves no bucket on either side (HF's make_log_bucket_position "
                         f"divides by position_buckets // 2 = 0); use -1 for no buckets or >= 2")
    if getattr(config, "type_vocab_size", 0) is None:
        raise ValueError(f"{where}: field 'type_vocab_size' must be an integer >= 0, got None")


# Fields that set a tensor's shape (BERT's names): a config.json without one gets the config class's default.
_SIZE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size", "max_position_embeddings",
                "type_vocab_size", "embedding_size")


def absent_size_fields(values: dict, config) -> list[str]:
    """The size fields a config.json's contents (`values`) leave out that the family's config reads, as the family
    spells them: the model got transformers' default for each."""
    family = families.of(config)
    return [family.raw_name(name) for name in _SIZE_FIELDS
            if name not in family.fixed and family.raw_name(name) not in values
            and getattr(config, family.raw_name(name), None) is not None]


def from_dict(values: dict, where: str = "config"):
    """A config.json's contents -> the transformers config of its model_type, checked (first the raw values, so the
    error names the field as written; transformers 5 would name neither the file nor refuse the model_type)."""
    from transformers import AutoConfig
    if not isinstance(values, dict):
        raise ValueError(f"{where} must hold a JSON object, got {type(values).__name__}")
    model_type = check_model_type(values.get("model_type", "bert"), where)  # hand-written configs often omit it
    check_fields(values, where, families.MODEL_TYPES[model_type][0], absent_ok=True)
    values = {k: v for k, v in values.items() if k != "model_type"}
    config = AutoConfig.for_model(model_type, **values)
    check_supported(config, where)
    return config


def read_json(path: str):
    """config.json's contents; a file that is not JSON is a ValueError naming it."""
    with open(path, encoding="utf-8") as f:
        try:
            return json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"config {path} is not valid JSON: {e}") from None


def load(config):
    """A transformers config (kept as is: the very object), a dict, or a path to config.json or its folder."""
    if isinstance(config, dict):
        return from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        return from_dict(read_json(path), where=f"config {path}")
    if hasattr(config, "to_dict") and hasattr(config, "model_type"):  # transformers.PretrainedConfig
        check_supported(config)
        return config
    raise TypeError(f"cannot build a model from a config of type {type(config).__name__}; give a transformers "
                    f"config, a dict, or a config.json path")
