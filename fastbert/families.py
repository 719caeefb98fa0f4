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
    jina-v3     word + type, LayerNorm; rotary q/k     none                    yes     ...WithPooling
    nomic_bert  word + type, LayerNorm; rotary q/k     none                    asked   ...WithPooling
    gte         word (+ type), LayerNorm; rotary q/k   none                    asked   ...WithPooling
    eurobert    word alone (embed_tokens); rotary q/k  none                    no      BaseModelOutput
    qwen3       word alone (embed_tokens); rotary q/k  none; causal            no      BaseModelOutputWithPast
    gemma3_text word alone times sqrt(H); rotary q/k    none; a window on the   no      BaseModelOutputWithPast
                                                      "sliding" layers

DeBERTa-v2/v3's attention adds content-to-position and position-to-content terms gathered at one bucketed column
per distance (twins.Disentangled); its heads keep their ContextPooler themselves.

The layer's axes, each named for what it does, and the shape they pick (fastbert/layers/):

    family      norm  final_norm  mlp    attention_bias  windows  embeddings  positions    layer shape
    bert ...    post  no          plain  none            no       sum         index        post_norm
    mpnet       post  no          plain  buckets         no       sum         padding_idx  post_norm
    modernbert  pre   yes         gated  none            yes      tokens      rotary       pre_norm
    deberta-v2  post  no          plain  disentangled    no       masked      index        disentangled
    jina-v3     post  no          plain  none            no       sum         rotary       rotary_post_norm
    nomic, gte  post  no          gated  none            no       sum         rotary       rotary_post_norm
    eurobert    pre   yes (RMS)   gated  none            no       table       rotary       rms_pre_norm
    qwen3       pre   yes (RMS)   gated  none            no       table       rotary       rms_pre_norm (causal,
                                                                                           q/k RMSNorm per head)
    gemma3_text sandwich yes (1+w) gated none            yes      table       rotary       sandwich_norm

Post-norm: x = LN(x + attention), x = LN(x + FFN). Pre-norm with a final norm and a gated MLP: x = x +
attention(LN1(x)), x = x + Wo(act(a) * g) for [a, g] = LN2(x) @ Wi^T; ModernBERT's checkpoints already hold q/k/v
as one Wqkv, and its linears and LayerNorms carry biases only where its config says. The same four ops run every
family, with the parameters each axis adds (fastbert/units/).
"""
from __future__ import annotations

from dataclasses import dataclass, field

# A post-norm layer's tensors by role, in HF's module order (a model built from a config gets that order too:
# optimizer states are saved by position). A family's `layer` dict lists its roles in its own HF order.
ROLES = ("query", "key", "value", "attn_out", "ln1", "ffn_in", "ffn_out", "ln2")

# A layer's dropouts, in the order a layer's `dropouts()` gives them: on the attention probabilities, after the
# attention output's dense, in the FFN (after its output dense; ModernBERT's: on act(a) * g), on DeBERTa's
# rel_embeddings, on a post-norm gated MLP's act(a) * g before its down projection (GTE's).
DROPOUT_KINDS = ("attention", "attention_output", "ffn", "positions", "gated")
_ATTN_P, _HIDDEN_P = "attention_probs_dropout_prob", "hidden_dropout_prob"


@dataclass(frozen=True)
class Family:
    name: str
    title: str  # as people write it, for messages
    prefix: str  # where a head checkpoint keeps the encoder (transformers' base_model_prefix)
    positions: str  # "index": each token's index in its sequence; "padding_idx": fairseq's, counted from it + 1;
    # "rotary": the index, rotating q and k in attention (no position table)
    layer: dict  # role -> HF's module path inside one layer
    dropouts: dict  # kind (DROPOUT_KINDS) -> (HF's module path inside one layer, the config field of its p)
    # ---- the axes a layer is read along (fastbert/layers/ holds one file per layer shape) ----
    norm: str = "post"  # "post": x = LN(x + sublayer(x)); "pre": x = x + sublayer(LN(x)), layer 0 without the first LN;
    # "sandwich": x = x + LN_after(sublayer(LN_before(x))), a norm before and after each sublayer (Gemma 3)
    final_norm: bool = False  # a norm after the last layer
    final_norm_name: str = "final_norm"  # its HF module name on the model (EuroBERT: "norm")
    norm_kind: str = "layer"  # "layer": LayerNorm; "rms": RMSNorm, no bias, no mean (EuroBERT); "rms_offset": RMSNorm
    # scaled by (1 + w), in float32 throughout (Gemma's)
    mlp: str = "plain"  # "plain": act(x W1 + b1) W2 + b2; "gated": act(a) * g for [a, g] = x Wi^T, then Wo
    attention_bias: str = "none"  # what attention adds to its scores: "none"; "buckets": a bias by (head, bucket of
    # j - i), one table per forward (MPNet); "disentangled": content-to-position and position-to-content terms from
    # rel_embeddings (DeBERTa-v2)
    windows: bool = False  # a sliding window on the layers the config names local
    causal: bool = False  # attention direction: query i sees keys j <= i only (Qwen3); False: both ways
    qk_norm: bool = False  # an RMSNorm over each head's q and k before rotary (Qwen3's q_norm / k_norm)
    embed_scale: bool = False  # the token table's rows times sqrt(hidden_size) (Gemma)
    attention_scale: str = "head_dim"  # the scores' scale: 1/sqrt(head_dim), or "query_pre_attn_scalar":
    # 1/sqrt(config.query_pre_attn_scalar) (Gemma)
    head_dim_field: bool = False  # the config's head_dim sets the heads' width, whatever hidden_size / heads is
    # (Qwen3: 16 heads of 128 over hidden 1,024); the attention output dense maps nh * head_dim back to hidden_size
    embeddings: str = "sum"  # "sum": word (+ type) + position tables, LayerNorm; "tokens": the word table, LayerNorm
    # (positions rotate q and k); "masked": the tables the config keeps, a projection, LayerNorm, zero at padding;
    # "table": the word table alone, held by the model at HF's name (EuroBERT's embed_tokens)
    # ---- the rest of the family's contract ----
    token_types: bool = True
    projection: bool = False  # embeddings of embedding_size widened to hidden_size (ELECTRA)
    pooler: bool = True  # a pooler unless the caller says otherwise
    poolable: bool | None = None  # the caller may ask for a pooler (None: where the family has one by default)
    unbiased: tuple = ()  # roles whose linears have no bias (NomicBERT: all of them; GTE: gate and up)
    layers: str = "encoder"  # the module holding the ModuleList `layer` (ModernBERT: "layers", the list itself)
    selects_hidden_states: bool = True  # output_hidden_states=[indices] keeps only those (MPNet's HF code: all)
    resizable_positions: bool = False  # resize_position_embeddings, as the family's transformers class has it
    tuple_keeps_pooler: bool = False  # return_dict=False: pooler_output holds its slot even when None (MPNet)
    fields: dict = field(default_factory=dict)  # fastbert's (BERT's) field name -> this family's config attribute
    fixed: dict = field(default_factory=dict)  # fields the family's modeling file hard-codes instead of reading
    padding_idx: int | None = None  # a fixed padding_idx (MPNet's embeddings use 1, whatever pad_token_id says)
    output: str = "BaseModelOutputWithPoolingAndCrossAttentions"  # transformers.modeling_outputs class
    min_transformers: str | None = None  # the first transformers release that has the family
    bounds: dict = field(default_factory=dict)  # fields whose lower bound is not BERT's (DeBERTa: type_vocab_size 0)

    @property
    def can_pool(self) -> bool:
        """A caller may ask for a pooler (transformers' add_pooling_layer=True builds one)."""
        return self.pooler if self.poolable is None else self.poolable

    @property
    def reads_distances(self) -> bool:
        """Attention reads j - i (a bias by distance, a window, disentangled terms), which packing a row whose real
        tokens are not one run would change."""
        return self.attention_bias != "none" or self.windows

    def get(self, config, name: str):
        """Config field `name` (BERT's spelling) as this family's config holds it; None when it has none."""
        if name in self.fixed:
            return self.fixed[name]
        return getattr(config, self.fields.get(name, name), None)

    def raw_name(self, name: str) -> str:
        return self.fields.get(name, name)

    def head_dim(self, config) -> int:
        """The width of one attention head: the config's head_dim where the family reads one, else hidden / heads."""
        if self.head_dim_field and getattr(config, "head_dim", None):
            return config.head_dim
        return config.hidden_size // config.num_attention_heads


_BERT_LAYER = {"query": "attention.self.query", "key": "attention.self.key", "value": "attention.self.value",
               "attn_out": "attention.output.dense", "ln1": "attention.output.LayerNorm",
               "ffn_in": "intermediate.dense", "ffn_out": "output.dense", "ln2": "output.LayerNorm"}

_BERT_DROPOUTS = {"attention": ("attention.self.dropout", _ATTN_P),
                  "attention_output": ("attention.output.dropout", _HIDDEN_P), "ffn": ("output.dropout", _HIDDEN_P)}

BERT = Family("bert", "BERT", "bert.", "index", _BERT_LAYER, _BERT_DROPOUTS)
ROBERTA = Family("roberta", "RoBERTa", "roberta.", "padding_idx", _BERT_LAYER, _BERT_DROPOUTS)
ELECTRA = Family("electra", "ELECTRA", "electra.", "index", _BERT_LAYER, _BERT_DROPOUTS, projection=True, pooler=False,
                 output="BaseModelOutputWithPastAndCrossAttentions")
DISTILBERT = Family(
    "distilbert", "DistilBERT", "distilbert.", "index",
    {"query": "attention.q_lin", "key": "attention.k_lin", "value": "attention.v_lin", "attn_out": "attention.out_lin",
     "ln1": "sa_layer_norm", "ffn_in": "ffn.lin1", "ffn_out": "ffn.lin2", "ln2": "output_layer_norm"},
    {"attention": ("attention.dropout", _ATTN_P), "ffn": ("ffn.dropout", _HIDDEN_P)},  # none after out_lin
    token_types=False, pooler=False, layers="transformer", resizable_positions=True,
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
    {"attention": ("attention.attn.dropout", _ATTN_P), "attention_output": ("attention.dropout", _HIDDEN_P),
     "ffn": ("output.dropout", _HIDDEN_P)},
    attention_bias="buckets", token_types=False, padding_idx=1, selects_hidden_states=False, tuple_keeps_pooler=True,
    output="BaseModelOutputWithPooling")

# ModernBERT's layer roles, in HF's module order (ModernBertEncoderLayer: attn_norm, attn, mlp_norm, mlp). Its
# checkpoints fuse q/k/v already ("qkv"); "ln1" is the norm before attention (the identity in layer 0), "ln2" before
# the MLP.
_MODERNBERT_LAYER = {"ln1": "attn_norm", "qkv": "attn.Wqkv", "attn_out": "attn.Wo", "ln2": "mlp_norm",
                     "ffn_in": "mlp.Wi", "ffn_out": "mlp.Wo"}
MODERNBERT = Family(
    "modernbert", "ModernBERT", "model.", "rotary", _MODERNBERT_LAYER,
    # its attention_dropout is a float on the attention module, and also the p of out_drop after Wo
    {"attention": ("attn.attention_dropout", _ATTN_P), "attention_output": ("attn.out_drop", _ATTN_P),
     "ffn": ("mlp.drop", _HIDDEN_P)},
    norm="pre", final_norm=True, mlp="gated", windows=True, embeddings="tokens",
    token_types=False, pooler=False, layers="layers", min_transformers="4.48.0",
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
    {**_BERT_DROPOUTS, "positions": ("attention.self.pos_dropout", _HIDDEN_P)},  # pos_dropout: relative_attention's
    attention_bias="disentangled", embeddings="masked", pooler=False, bounds={"type_vocab_size": 0},
    selects_hidden_states=False,  # HF's encoder always returns every hidden state; the model keeps all or none
    output="BaseModelOutput",
    min_transformers="4.48.0")  # the DeBERTa-v2 definition fastbert follows (earlier: StableDropout, XSoftmax)

# Jina-Embeddings-v3, NomicBERT and GTE: transformers' JinaEmbeddingsV3Layer (GPT-NeoX's module order:
# post_attention_layernorm, the MLP, self_attn, post_mlp_layernorm), rotary q/k with one rope for every layer, and
# word (+ type) embeddings without a position table. Jina's MLP is CLIP's (fc1, fc2); NomicBERT's and GTE's are gated
# (act(gate_proj) * up_proj, down_proj), which fastbert runs as one GEMM over [gate; up].
_ROTARY_ATTENTION = {"query": "self_attn.q_proj", "key": "self_attn.k_proj", "value": "self_attn.v_proj",
                     "attn_out": "self_attn.o_proj"}
_JINA_LAYER = {"ln1": "post_attention_layernorm", "ffn_in": "mlp.fc1", "ffn_out": "mlp.fc2", **_ROTARY_ATTENTION,
               "ln2": "post_mlp_layernorm"}
_GATED_LAYER = {"ln1": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_out": "mlp.down_proj", **_ROTARY_ATTENTION, "ln2": "post_mlp_layernorm"}
_ROTARY_DROPOUTS = {"attention": ("self_attn.attention_dropout", _ATTN_P),  # a float on the attention module
                    "attention_output": ("post_attention_dropout", _HIDDEN_P),
                    "ffn": ("post_mlp_dropout", _HIDDEN_P)}
_LINEARS = ("query", "key", "value", "attn_out", "ffn_in", "ffn_gate", "ffn_up", "ffn_out")
JINA_V3 = Family(
    "jina_embeddings_v3", "Jina-Embeddings-v3", "roberta.", "rotary", _JINA_LAYER, _ROTARY_DROPOUTS,
    layers="layers", output="BaseModelOutputWithPooling", min_transformers="5.24.0")
NOMIC_BERT = Family(
    "nomic_bert", "NomicBERT", "nomic_bert.", "rotary", _GATED_LAYER, _ROTARY_DROPOUTS, mlp="gated",
    unbiased=_LINEARS, pooler=False, poolable=True, layers="layers", output="BaseModelOutputWithPooling",
    min_transformers="5.24.0")
GTE = Family(
    "gte", "GTE", "gte.", "rotary", _GATED_LAYER, {**_ROTARY_DROPOUTS, "gated": ("mlp.dropout", _HIDDEN_P)},
    mlp="gated", unbiased=("ffn_gate", "ffn_up"), pooler=False, poolable=True, layers="layers",
    bounds={"type_vocab_size": 0},  # gte-base-en-v1.5: no token type table
    output="BaseModelOutputWithPooling", min_transformers="5.24.0")

# EuroBERT: Llama's layer as an encoder (transformers' EuroBertModel is a LlamaModel with bidirectional attention):
# pre-norm with RMSNorm, a final RMSNorm ("norm"), rotary q/k, grouped-query attention where num_key_value_heads <
# num_attention_heads, a SwiGLU MLP over gate_proj / up_proj, biases as attention_bias / mlp_bias say, the token table
# at the model's top (embed_tokens) with no norm and no token types.
_EUROBERT_LAYER = {**_ROTARY_ATTENTION, "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                   "ffn_out": "mlp.down_proj", "ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
EUROBERT = Family(
    "eurobert", "EuroBERT", "model.", "rotary", _EUROBERT_LAYER,
    {"attention": ("self_attn.attention_dropout", _ATTN_P)},  # a float on the attention module, its only dropout
    norm="pre", final_norm=True, final_norm_name="norm", norm_kind="rms", mlp="gated", embeddings="table",
    token_types=False, pooler=False, layers="layers",
    fields={"layer_norm_eps": "rms_norm_eps", "attention_probs_dropout_prob": "attention_dropout"},
    fixed={"hidden_dropout_prob": 0.0}, output="BaseModelOutput", min_transformers="5.24.0")

# Qwen3 (Qwen3-Embedding): Llama's layer with causal attention, an RMSNorm over each head's q and k (q_norm, k_norm,
# on head_dim) before rotary, head_dim read from the config, no biases in the MLP (attention_bias for q/k/v/o), HF's
# module order self_attn (q, k, v, o, q_norm, k_norm), mlp, input_layernorm, post_attention_layernorm.
_QWEN3_LAYER = {**_ROTARY_ATTENTION, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_out": "mlp.down_proj",
                "ln1": "input_layernorm", "ln2": "post_attention_layernorm"}
QWEN3 = Family(
    "qwen3", "Qwen3", "model.", "rotary", _QWEN3_LAYER,
    {"attention": ("self_attn.attention_dropout", _ATTN_P)},  # a float on the attention module, its only dropout
    norm="pre", final_norm=True, final_norm_name="norm", norm_kind="rms", mlp="gated", embeddings="table",
    causal=True, qk_norm=True, head_dim_field=True, token_types=False, pooler=False, layers="layers",
    fields={"layer_norm_eps": "rms_norm_eps", "attention_probs_dropout_prob": "attention_dropout"},
    fixed={"hidden_dropout_prob": 0.0}, output="BaseModelOutputWithPast", min_transformers="5.0.0")

# Gemma 3 run both ways (EmbeddingGemma: transformers' Gemma3TextModel with use_bidirectional_attention): sandwich
# norms (input_layernorm and post_attention_layernorm around attention, pre_ / post_feedforward_layernorm around the
# MLP), every norm Gemma's (1 + w) RMSNorm, q/k norms of that kind per head, the scores scaled by
# 1/sqrt(query_pre_attn_scalar), sliding and full layers from layer_types (a sliding layer sees |i - j| <
# sliding_window), a rope per layer type, a tanh-GELU gated MLP, the token table times sqrt(hidden_size).
_GEMMA3_LAYER = {**_ROTARY_ATTENTION, "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_out": "mlp.down_proj",
                 "ln1": "input_layernorm", "ln_after_attention": "post_attention_layernorm",
                 "ln2": "pre_feedforward_layernorm", "ln_after_ffn": "post_feedforward_layernorm"}
GEMMA3_TEXT = Family(
    "gemma3_text", "Gemma 3", "model.", "rotary", _GEMMA3_LAYER,
    {"attention": ("self_attn.attention_dropout", _ATTN_P)},
    norm="sandwich", final_norm=True, final_norm_name="norm", norm_kind="rms_offset", mlp="gated", windows=True,
    embeddings="table", qk_norm=True, embed_scale=True, attention_scale="query_pre_attn_scalar", head_dim_field=True,
    token_types=False, pooler=False, layers="layers",
    fields={"layer_norm_eps": "rms_norm_eps", "hidden_act": "hidden_activation",
            "attention_probs_dropout_prob": "attention_dropout"},
    fixed={"hidden_dropout_prob": 0.0}, output="BaseModelOutputWithPast", min_transformers="5.0.0")

# model_type -> (family, transformers' encoder class of that model_type)
MODEL_TYPES = {"bert": (BERT, "BertModel"), "roberta": (ROBERTA, "RobertaModel"),
               "xlm-roberta": (ROBERTA, "XLMRobertaModel"), "camembert": (ROBERTA, "CamembertModel"),
               "electra": (ELECTRA, "ElectraModel"), "distilbert": (DISTILBERT, "DistilBertModel"),
               "mpnet": (MPNET, "MPNetModel"), "modernbert": (MODERNBERT, "ModernBertModel"),
               "deberta-v2": (DEBERTA_V2, "DebertaV2Model"),
               "jina_embeddings_v3": (JINA_V3, "JinaEmbeddingsV3Model"), "nomic_bert": (NOMIC_BERT, "NomicBertModel"),
               "gte": (GTE, "GteModel"), "eurobert": (EUROBERT, "EuroBertModel"),
               "qwen3": (QWEN3, "Qwen3Model"), "gemma3_text": (GEMMA3_TEXT, "Gemma3TextModel")}


def of(config) -> Family:
    """The family of a (checked) transformers config."""
    return MODEL_TYPES[config.model_type][0]


def encoder_class(model_type: str) -> str:
    return MODEL_TYPES[model_type][1]
