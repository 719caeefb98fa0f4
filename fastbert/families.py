"""The encoder families fastbert runs, as data: one layer, read along a few axes.

A family says where its checkpoints keep each tensor (HF's module paths, so state_dict keys, PEFT targets and
optimizer groups are HF's own), what its config calls each field, and which value each axis takes:

    family      embeddings                            attention bias          pooler  output
    bert        word + type + position (index)        none                    yes     ...AndCrossAttentions
    roberta     word + type + position (padding_idx)  none                    yes     ...AndCrossAttentions
    electra     as bert, narrower, then a projection  none                    no      ...WithPastAndCross...
    distilbert  word + position (index)               none                    no      BaseModelOutput
    mpnet       word + position (padding_idx = 1)     per-distance buckets    yes     ...WithPooling
    modernbert  word, LayerNorm; rotary q/k (index)   none; a window on the   no      BaseModelOutput
                                                      "sliding" layers
    deberta-v2  word (+ position) (+ type), a         disentangled c2p + p2c  no      BaseModelOutput
                projection, LayerNorm, times the mask  (column by bucket)

DeBERTa-v2/v3's attention adds content-to-position and position-to-content terms gathered at one bucketed column
per distance (twins.Disentangled); its heads keep their ContextPooler themselves.

All but ModernBERT are post-norm: x = LN(x + attention), x = LN(x + FFN). ModernBERT is pre-norm with a final norm
and a gated MLP: x = x + attention(LN1(x)), x = x + Wo(act(a) * g) for [a, g] = LN2(x) @ Wi^T; its checkpoints
already hold q/k/v as one Wqkv, and its linears and LayerNorms carry biases only where its config says. The same
four ops run every family, with the parameters each axis adds (fastbert/units/).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# A post-norm layer's tensors by role, in HF's module order (a model built from a config gets that order too:
# optimizer states are saved by position). A family's `layer` dict lists its roles in its own HF order.
ROLES = ("query", "key", "value", "attn_out", "ln1", "ffn_in", "ffn_out", "ln2")


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # as people write it, for messages
    prefix: str  # where a head checkpoint keeps the encoder (transformers' base_model_prefix)
    positions: str  # "index": each token's index in its sequence; "padding_idx": fairseq's, counted from it + 1;
    # "rotary": the index, rotating q and k in attention (no position table)
    layer: dict  # role -> HF's module path inside one layer
    token_types: bool = True
    projection: bool = False  # embeddings of embedding_size widened to hidden_size (ELECTRA)
    pooler: bool = True  # a pooler unless the caller says otherwise
    relative_bias: bool = False  # MPNet: a bias by (head, bucket of j - i), one table per forward
    layers: str = "encoder"  # the module holding the ModuleList `layer` (ModernBERT: "layers", the list itself)
    attention_output_dropout: bool = True  # DistilBERT applies none after out_lin
    selects_hidden_states: bool = True  # output_hidden_states=[indices] keeps only those (MPNet's HF code: all)
    resizable_positions: bool = False  # resize_position_embeddings, as the family's transformers class has it
    tuple_keeps_pooler: bool = False  # return_dict=False: pooler_output holds its slot even when None (MPNet)
    fields: dict = field(default_factory=dict)  # fastbert's (BERT's) field name -> this family's config attribute
    fixed: dict = field(default_factory=dict)  # fields the family's modeling file hard-codes instead of reading
    padding_idx: int | None = None  # a fixed padding_idx (MPNet's embeddings use 1, whatever pad_token_id says)
    output: str = "BaseModelOutputWithPoolingAndCrossAttentions"  # transformers.modeling_outputs class
    pre_norm: bool = False  # ModernBERT: LN before each sublayer, a final norm, rotary q/k, windows, a gated MLP
    min_transformers: str | None = None  # the first transformers release that has the family
    disentangled: bool = False  # DeBERTa-v2: c2p/p2c score terms from rel_embeddings, HF's embeddings and mask rule
    bounds: dict = field(default_factory=dict)  # fields whose lower bound is not BERT's (DeBERTa: type_vocab_size 0)

    def get(self, config, name: str):
        """Config field `name` (BERT's spelling) as this family's config holds it; None when it has none."""
        if name in self.fixed:
            return self.fixed[name]
        return getattr(config, self.fields.get(name, name), None)

    def raw_name(self, name: str) -> str:
        return self.fields.get(name, name)


_BERT_LAYER = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
               "attn_out": "attention.output.dense", "ln1": "attention.output.LayerNorm",
               "ffn_in": "intermediate.dense", "ffn_out": "output.dense", "ln2": "output.LayerNorm"}

BERT = Family("bert", "BERT", "bert.", "index", _BERT_LAYER)
ROBERTA = Family("roberta", "RoBERTa", "roberta.", "padding_idx", _BERT_LAYER)
ELECTRA = Family("electra", "ELECTRA", "electra.", "index", _BERT_LAYER, projection=True, pooler=False,
                 output="BaseModelOutputWithPastAndCrossAttentions")
DISTILBERT = Family(
    "distilbert", "DistilBERT", "distilbert.", "index",
    {"query": "attention.q_lin", "key": "attention.k_lin", "value": "attention.v_lin", "attn_out": "attention.out_lin",
     "ln1": "sa_layer_norm", "ffn_in": "ffn.lin1", "ffn_out": "ffn.lin2", "ln2": "output_layer_norm"},
    token_types=False, pooler=False, layers="transformer", attention_output_dropout=False, resizable_positions=True,
    fields={"hidden_size": "dim", "num_attention_heads": "n_heads", "num_hidden_layers": "n_layers",
            "intermediate_size": "hidden_dim", "hidden_act": "activation", "hidden_dropout_prob": "dropout",
            "attention_probs_dropout_prob": "attention_dropout"},
    fixed={"layer_norm_eps": 1e-12},  # HF's DistilBERT builds every LayerNorm with eps=1e-12
    output="BaseModelOutput")
MPNET = Family(
    "mpnet", "MPNet", "mpnet.", "padding_idx",
    {"query": "attention.attn.q", "key": "attention.attn.k", "value": "attention.attn.v",
     "attn_out": "attention.attn.o", "ln1": "attention.LayerNorm", "ffn_in": "intermediate.dense",
     "ffn_out": "output.dense", "ln2": "output.LayerNorm"},
    token_types=False, relative_bias=True, padding_idx=1, selects_hidden_states=False, tuple_keeps_pooler=True,
    output="BaseModelOutputWithPooling")

# ModernBERT's layer roles, in HF's module order (ModernBertEncoderLayer: attn_norm, attn, mlp_norm, mlp). Its
# checkpoints fuse q/k/v already ("qkv"); "ln1" is the norm before attention (the identity in layer 0), "ln2" before
# the MLP.
_MODERNBERT_LAYER = {"ln1": "attn_norm", "qkv": "attn.Wqkv", "attn_out": "attn.Wo", "ln2": "mlp_norm",
                     "ffn_in": "mlp.Wi", "ffn_out": "mlp.Wo"}
MODERNBERT = Family(
    "modernbert", "ModernBERT", "model.", "rotary", _MODERNBERT_LAYER,
    token_types=False, pooler=False, layers="layers", pre_norm=True, min_transformers="4.48.0",
    fields={"layer_norm_eps": "norm_eps", "hidden_act": "hidden_activation",
            "hidden_dropout_prob": "mlp_dropout", "attention_probs_dropout_prob": "attention_dropout"},
    output="BaseModelOutput")

# DeBERTa-v2/v3 and mDeBERTa (one model_type). HF's DebertaV2Model has no pooler: the sequence heads hold their own
# ContextPooler ("pooler."), outside the encoder.
_DEBERTA_LAYER = {"query": "attention.self.query_proj", "key": "attention.self.key_proj",
                  "value": "attention.self.value_proj", "attn_out": "attention.output.dense",
                  "ln1": "attention.output.LayerNorm", "ffn_in": "intermediate.dense", "ffn_out": "output.dense",
                  "ln2": "output.LayerNorm"}
DEBERTA_V2 = Family(
    "deberta-v2", "DeBERTa-v2", "deberta.", "index", _DEBERTA_LAYER,
    pooler=False, disentangled=True, bounds={"type_vocab_size": 0},
    selects_hidden_states=False,  # HF's encoder always returns every hidden state; the model keeps all or none
    output="BaseModelOutput",
    min_transformers="4.48.0")  # the DeBERTa-v2 definition fastbert follows (earlier: StableDropout, XSoftmax)

# model_type -> (family, transformers' encoder class of that model_type)
MODEL_TYPES = {"bert": (BERT, "BertModel"), "roberta": (ROBERTA, "RobertaModel"),
               "xlm-roberta": (ROBERTA, "XLMRobertaModel"), "camembert": (ROBERTA, "CamembertModel"),
               "electra": (ELECTRA, "ElectraModel"), "distilbert": (DISTILBERT, "DistilBertModel"),
               "mpnet": (MPNET, "MPNetModel"), "modernbert": (MODERNBERT, "ModernBertModel"),
               "deberta-v2": (DEBERTA_V2, "DebertaV2Model")}


def of(config) -> Family:
    """The family of a (checked) transformers config."""
    return MODEL_TYPES[config.model_type][0]


def encoder_class(model_type: str) -> str:
    return MODEL_TYPES[model_type][1]
