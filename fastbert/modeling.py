"""fastbert.BertModel: Hugging Face's BertModel, same checkpoints, same calls, same numbers, four fused ops.

One model for every family fastbert runs (fastbert/families.py): BERT and the BERT-architecture embedding models
(BGE, E5, GTE), RoBERTa, XLM-RoBERTa, CamemBERT, ELECTRA discriminators, DistilBERT and MPNet run the same layer. A
family is data: HF's module path of each of the layer's tensors, and its values along a few axes: token types or
none, positions from an index or from padding_idx + 1 (`EMBEDDINGS`), an embeddings projection (ELECTRA), a pooler,
a relative position bias added to the attention scores (MPNet: one per-distance table per forward).

One forward in three parts:

    prepare (host, fastbert/inputs.py): validate, fill defaults, one host read; a padded batch [B, S] becomes its
        T real tokens, packed, and a TokenLayout (cu_seqlens: where each sequence starts)
    encode (device only; what a CUDA graph captures):
        x = LayerNorm(word[ids] + type[types] + position[positions])      [T, H]   (ELECTRA: [T, E] @ W_proj)
        per layer:
            qkv = qkv_projection(x)                          [T, 3, nh, hd]   one GEMM over the fused W_qkv
            ctx = attention(qkv, layout, bias)               [T, H]           per sequence, never across
            x   = residual_layernorm(ctx @ W_o + b_o + x)    [T, H]
            h   = bias_gelu(x @ W_1 + b_1)                   [T, I]
            x   = residual_layernorm(h @ W_2 + b_2 + x)      [T, H]
    finish: scatter back to [B, S, H] once (zeros at padding); pooler = tanh(first token @ W_p + b_p); HF's outputs

Each op runs on the backend named in `model.kernels`, resolved once per forward (fastbert/dispatch.py). Module and
parameter names are HF's (query/key/value included: named_parameters, state_dict, PEFT targets); underneath, query/
key/value's weights are rows of one fused W_qkv, so the projection is one GEMM (docs/contract.md says why).
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers
from torch.nn.modules import module as _torch_module
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    BaseModelOutputWithPooling,
    BaseModelOutputWithPoolingAndCrossAttentions,
)

from . import adapters, dispatch, fallback, families, measure, relative, rotary, twins
from . import config as configs
from .compat import TransformersModelMixin
from .dispatch import OPS
from .inputs import Batch, prepare
from .layout import first_tokens, pad, unpad
from .mask import AttentionMask, tracing
from .units.attention import NONE, Extras

# MPNet's buckets stop changing at 128 tokens apart (HF's max_distance): a table reaching 128 is exact at any length
RELATIVE_REACH = 129

# With output_attentions, transformers 5 reports an empty cross_attentions tuple alongside attentions (part of the
# return_dict=False tuple); 4.x reports None, which the tuple leaves out.
_EMPTY_CROSS_ATTENTIONS = () if int(transformers.__version__.split(".")[0]) >= 5 else None


def _plain(module: nn.Module | None, cls: type) -> bool:
    """`module` is exactly a `cls` whose forward nothing could tell from the op the caller runs on its tensors instead:
    no hook of its own or on every module, its forward neither replaced nor compiled on the instance. nn.Module's
    call and its attribute lookups cost 10-20 k instructions of host work a module (bench/RESULTS.md, the host-bound
    cell), more than a small batch's op itself."""
    return type(module) is cls and not (
        module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        or module._compiled_call_impl is not None or "forward" in module.__dict__
        or _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks
        or _torch_module._global_backward_hooks or _torch_module._global_backward_pre_hooks)


def _embed(table: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """table(ids): nn.Embedding's forward (F.embedding without max_norm) on its weight where nothing can tell."""
    if _plain(table, nn.Embedding) and table.max_norm is None:
        pad = table.padding_idx
        return torch.embedding(table._parameters["weight"], ids, -1 if pad is None else pad,
                               table.scale_grad_by_freq, table.sparse)
    return table(ids)


def _norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """norm(x): nn.LayerNorm's forward on its parameters where nothing can tell."""
    if _plain(norm, nn.LayerNorm):
        p = norm._parameters
        return torch.layer_norm(x, norm.normalized_shape, p["weight"], p["bias"], norm.eps)
    return norm(x)


def _drop(dropout: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """dropout(x): nn.Dropout's forward where nothing can tell (in eval mode, x itself)."""
    if _plain(dropout, nn.Dropout):
        return F.dropout(x, dropout.p, True, dropout.inplace) if dropout.training else x
    return dropout(x)


class BertEmbeddings(nn.Module):
    """word (+ token type) + position embeddings, LayerNorm, dropout, at `width` (hidden_size; ELECTRA:
    embedding_size). Position ids are each token's index in its sequence. DistilBERT and MPNet have no token types."""

    word_embeddings_name = "word_embeddings"

    def __init__(self, config, width: int, family: families.Family = families.BERT):
        super().__init__()
        pad = family.padding_idx if family.padding_idx is not None else config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=pad)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width) if family.token_types else None
        self.LayerNorm = nn.LayerNorm(width, eps=family.get(config, "layer_norm_eps"))
        self.dropout = nn.Dropout(family.get(config, "hidden_dropout_prob"))

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers (read off the table: resize_position_embeddings swaps it)."""
        return self.position_embeddings.num_embeddings

    def tables(self) -> tuple:
        """(word, token type, position) tables as they are now; None where the family has none."""
        tables = self._modules
        return tables["word_embeddings"], tables.get("token_type_embeddings"), tables.get("position_embeddings")

    def position_ids(self, input_ids, index):
        """The default position ids: `index` holds each token's index in its sequence (the shape of input_ids, [B, S]
        or packed [T]; input_ids is None when the caller gave inputs_embeds)."""
        return index

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        tables = self._modules  # (read once: each nn.Module attribute lookup is Python work on the host)
        if inputs_embeds is None:
            inputs_embeds = _embed(tables["word_embeddings"], input_ids)
        # HF's order of additions, so that fp32 sums round identically
        x = inputs_embeds
        types = tables.get("token_type_embeddings")  # (None: the family has no token types)
        if types is not None:
            x = x + _embed(types, token_type_ids)
        x = x + _embed(tables["position_embeddings"], position_ids)
        return _drop(tables["dropout"], _norm(tables["LayerNorm"], x))           # [T, width]


class RobertaEmbeddings(BertEmbeddings):
    """RoBERTa, XLM-RoBERTa, CamemBERT, MPNet: fairseq's positions. A token that is not padding_idx sits at
    padding_idx + its count among its sequence's non-padding tokens (1, 2, ...); a padding_idx token sits at
    padding_idx (HF's create_position_ids_from_input_ids). From inputs_embeds, where padding cannot be seen, positions
    run padding_idx + 1, padding_idx + 2, ... So the usable length is max_position_embeddings - padding_idx - 1.
    padding_idx is pad_token_id (MPNet: 1, as HF's MPNetEmbeddings fixes it)."""

    def __init__(self, config, width: int, family: families.Family = families.ROBERTA):
        super().__init__(config, width, family)
        self.padding_idx = self.word_embeddings.padding_idx
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width, padding_idx=self.padding_idx)

    @property
    def max_length(self) -> int:
        return self.position_embeddings.num_embeddings - self.padding_idx - 1

    def position_ids(self, input_ids, index):
        if input_ids is None:
            return index + (self.padding_idx + 1)
        real = (input_ids != self.padding_idx).long()
        if real.dim() == 2:  # padded rows: HF's cumsum along each row
            counts = real.cumsum(dim=1)
        else:  # packed sequences: the same count restarted at each sequence's first token (index 0)
            counts = real.cumsum(dim=0)
            first = torch.arange(real.shape[0], device=real.device) - index
            counts = counts - (counts[first] - real[first])
        return counts * real + self.padding_idx


class TokenEmbeddings(nn.Module):
    """ModernBERT: the token embedding, LayerNorm (with a bias where norm_bias says), dropout. No position table:
    positions (each token's index in its sequence, or the caller's position_ids) rotate q and k in attention."""

    position_embeddings = token_type_embeddings = None
    word_embeddings_name = "tok_embeddings"  # HF's name of the table (set_input_embeddings replaces it by name)

    def __init__(self, config, width: int, family: families.Family):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.norm = nn.LayerNorm(width, eps=family.get(config, "layer_norm_eps"), bias=config.norm_bias)
        self.drop = nn.Dropout(config.embedding_dropout)
        self.max_length = config.max_position_embeddings  # what it was trained for; longer input is not refused

    @property
    def word_embeddings(self) -> nn.Embedding:  # the name the rest of fastbert reads
        return self.tok_embeddings

    def tables(self) -> tuple:
        return self._modules["tok_embeddings"], None, None

    def position_ids(self, input_ids, index):
        return index

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        if inputs_embeds is None:
            inputs_embeds = self.tok_embeddings(input_ids)
        return self.drop(self.norm(inputs_embeds))                                # [T, H]


class DebertaEmbeddings(nn.Module):
    """DeBERTa-v2's embeddings (HF's DebertaV2Embeddings): word, + position only if position_biased_input, + token type
    only if type_vocab_size > 0 (HF's order of additions), embed_proj (no bias) when embedding_size != hidden_size,
    LayerNorm at hidden_size, times the key mask (padded positions are zero, as HF's are), dropout."""

    word_embeddings_name = "word_embeddings"

    def __init__(self, config, width: int, family: families.Family = families.DEBERTA_V2):
        super().__init__()
        H = config.hidden_size
        E = getattr(config, "embedding_size", None) or H
        self.word_embeddings = nn.Embedding(config.vocab_size, E, padding_idx=getattr(config, "pad_token_id", 0))
        self.position_embeddings = (nn.Embedding(config.max_position_embeddings, E)
                                    if getattr(config, "position_biased_input", True) else None)
        types = config.type_vocab_size or 0
        self.token_type_embeddings = nn.Embedding(types, E) if types > 0 else None
        self.embed_proj = nn.Linear(E, H, bias=False) if E != H else None
        self.LayerNorm = nn.LayerNorm(H, eps=family.get(config, "layer_norm_eps"))
        self.dropout = nn.Dropout(family.get(config, "hidden_dropout_prob"))
        self._max_positions = config.max_position_embeddings

    @property
    def max_length(self) -> int:
        """The position table's rows (without one, v3's relative positions: max_position_embeddings, not enforced)."""
        table = self.position_embeddings
        return self._max_positions if table is None else table.num_embeddings

    tables = BertEmbeddings.tables

    def position_ids(self, input_ids, index):
        return index

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds, mask=None):
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        if self.token_type_embeddings is not None:
            x = x + self.token_type_embeddings(token_type_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)                                                # [T, E] -> [T, H]
        x = self.LayerNorm(x)
        if mask is not None:  # padded rows: [T, 1], 0 at padded positions
            x = x * mask.to(x.dtype)
        return self.dropout(x)                                                    # [T, H]


# a family's position ids -> its embeddings
EMBEDDINGS = {"index": BertEmbeddings, "padding_idx": RobertaEmbeddings, "rotary": TokenEmbeddings}


class BertSelfAttention(nn.Module):
    """HF's query/key/value (DistilBERT: q_lin/k_lin/v_lin; MPNet: q/k/v), as HF's nn.Linear modules with HF's
    parameter names, whose weights and biases sit side by side in one fused weight [3H, H] and bias [3H]: the
    projection is one GEMM over them. Each part's parameter has a storage of its own that aliases its rows of the
    fused tensors (`_alias`), so state_dict(), safetensors and transformers' tied-weights checks see three independent
    tensors, while an in-place update (an optimizer step, load_state_dict, PEFT's merge) lands in the fused weight at
    once: one copy of the weights. Where HF's module holds more (DistilBERT's out_lin, MPNet's o), the layer adds it."""

    def __init__(self, hidden: int, names: tuple = ("query", "key", "value")):
        super().__init__()
        self.names = names
        for name in names:
            self.add_module(name, nn.Linear(hidden, hidden))
        self._fused = None  # (weight [3H, H], bias [3H], the parts' data pointers when packed)
        self.register_load_state_dict_post_hook(lambda module, keys: module.pack())  # assign=True puts new tensors
        self.pack()

    def parts(self) -> tuple:
        """(query.weight, key.weight, value.weight, query.bias, key.bias, value.bias) of the base layers (under a
        PEFT adapter, the layer it wraps)."""
        mods, names = self._modules, self.names
        q, k, v = mods[names[0]], mods[names[1]], mods[names[2]]
        if not type(q) is type(k) is type(v) is nn.Linear:  # (a plain read first: this runs every forward)
            q, k, v = (adapters.base_layer(m) for m in (q, k, v))
        q, k, v = q._parameters, k._parameters, v._parameters
        return q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"]

    def pack(self) -> None:
        """Put the parts' current values into one fused weight and bias, and point the parts at their rows. A fused
        weight these very parts already alias (a second fastbert model over the same HF modules) is kept."""
        parts = self.parts()
        holder = adapters.base_layer(self._modules[self.names[0]]).__dict__
        record = holder.get("_fastbert_fused")
        if record is not None and record[2] == _pointers(parts):
            self._fused = record
            return
        with torch.no_grad():
            weight, bias = torch.cat([p.detach() for p in parts[:3]]), torch.cat([p.detach() for p in parts[3:]])
        for fused, group in ((weight, parts[:3]), (bias, parts[3:])):
            for part, rows in zip(group, fused.chunk(3, dim=0)):
                part.data = _alias(rows)
        self._fused = holder["_fastbert_fused"] = (weight, bias, _pointers(parts))

    def fused(self, parts: tuple | None = None, traced: bool | None = None,
              grad: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_qkv [3H, H], b_qkv [3H]) for this forward. Where autograd needs the parts, or a trace records the
        forward, the parts concatenated (a copy: gradients reach HF's own parameters, and the trace reads them);
        otherwise the fused tensors themselves. `parts` / `traced` / `grad`: what the caller knows already (the
        layer's forward: `parts()`, and its plan's `traced` and `grad`)."""
        parts = self.parts() if parts is None else parts
        grad = torch.is_grad_enabled() if grad is None else grad
        if grad and any(p.requires_grad for p in parts) or (tracing() if traced is None else traced):
            return torch.cat(parts[:3]), torch.cat(parts[3:])
        fused = self._fused
        if fused is None or fused[2] != tuple(map(_DATA_PTR, parts)):  # `.data =`, a replaced module, ...
            self.pack()
            fused = self._fused
        return fused[0], fused[1]

    def _packed(self, parts) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fused(parts, traced=False, grad=False)

    @property
    def qkv_weight(self) -> torch.Tensor:
        """The fused weight [3H, H]: not a parameter, its rows are query/key/value.weight."""
        return self._packed(self.parts())[0]

    @property
    def qkv_bias(self) -> torch.Tensor:
        return self._packed(self.parts())[1]

    def untie(self) -> None:
        """Give query/key/value storage of their own again (what an HF model handed back holds)."""
        for part in self.parts():
            part.data = part.data.clone()
        self._fused = None

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # .to(), .half(), to_empty(), ...: the parts each got new storage
        self.pack()
        return self


_DATA_PTR = torch.Tensor.data_ptr


def _pointers(parts) -> tuple:
    return tuple(map(_DATA_PTR, parts))  # (no generator frame per part)


def _alias(rows: torch.Tensor) -> torch.Tensor:
    """`rows` (a slice of a fused tensor) under a storage object of its own that points at the same memory: what a
    checkpoint writer or tied-weights check sees as an independent tensor. DLPack provides that; where it cannot
    (the meta device, where there is no memory to share), a plain view."""
    try:
        return torch.from_dlpack(rows)
    except (RuntimeError, ValueError, TypeError, BufferError):
        return rows


class Block(nn.Module):
    """A container at one of HF's module paths inside a layer (attention, attention.output, ffn, ...): it holds
    modules, computes nothing (the layer's forward does, through the four ops)."""


class LayerWeights(NamedTuple):
    """The twelve tensors of one BERT layer, as the four ops take them, and its LayerNorms' eps (read off the modules
    at every forward, as nn.LayerNorm's forward reads it)."""
    qkv: torch.Tensor
    qkv_bias: torch.Tensor
    attn_out: torch.Tensor
    attn_out_bias: torch.Tensor
    ln1: torch.Tensor
    ln1_bias: torch.Tensor
    ln1_eps: float
    ffn_in: torch.Tensor
    ffn_in_bias: torch.Tensor
    ffn_out: torch.Tensor
    ffn_out_bias: torch.Tensor
    ln2: torch.Tensor
    ln2_bias: torch.Tensor
    ln2_eps: float


try:  # transformers finds the layers it may checkpoint by this class (gradient_checkpointing_enable, PEFT, Trainer)
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # transformers before 4.52: the same behaviour, under the same name
    import functools

    class GradientCheckpointingLayer(nn.Module):
        gradient_checkpointing = False

        def __call__(self, *args, **kwargs):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                return self._gradient_checkpointing_func(functools.partial(super().__call__, **kwargs), *args)
            return super().__call__(*args, **kwargs)


class BertLayer(GradientCheckpointingLayer):
    """One encoder layer. Post-norm (BERT and most families): x = LN1(x + attention(x)), x = LN2(x + FFN(x)).
    Pre-norm (ModernBERT): x = x + attention(LN1(x)), x = x + Wo(act(a) * g) for [a, g] = LN2(x) @ Wi^T, LN1 the
    identity in layer 0, a sliding window on its "sliding_attention" layers. Its modules sit at HF's paths for the
    family (families.Family.layer: role -> path), so HF's checkpoints, names and adapters fit it as they are."""

    def __init__(self, config, family: families.Family = families.BERT, index: int = 0):
        super().__init__()
        self.config = config
        self.family = family
        H, I = config.hidden_size, family.get(config, "intermediate_size")
        eps = family.get(config, "layer_norm_eps")
        paths = {role: tuple(path.split(".")) for role, path in family.layer.items()}
        if family.pre_norm:  # ModernBERT: biases as its config says, Wi holds both halves, layer 0 has no LN1
            attn_bias, mlp_bias, norm_bias = config.attention_bias, config.mlp_bias, config.norm_bias
            leaves = {"ln1": nn.Identity() if index == 0 else nn.LayerNorm(H, eps=eps, bias=norm_bias),
                      "qkv": nn.Linear(H, 3 * H, bias=attn_bias), "attn_out": nn.Linear(H, H, bias=attn_bias),
                      "ln2": nn.LayerNorm(H, eps=eps, bias=norm_bias), "ffn_in": nn.Linear(H, 2 * I, bias=mlp_bias),
                      "ffn_out": nn.Linear(I, H, bias=mlp_bias)}
            self.layer_type = rotary.layer_types(config)[index]
            self.window = rotary.window(config, self.layer_type)
            qkv_path = None
        else:
            leaves = {"attn_out": nn.Linear(H, H), "ln1": nn.LayerNorm(H, eps=eps), "ffn_in": nn.Linear(H, I),
                      "ffn_out": nn.Linear(I, H), "ln2": nn.LayerNorm(H, eps=eps)}
            qkv_path = paths["query"][:-1]
            qkv_names = tuple(paths[role][-1] for role in ("query", "key", "value"))
        for role in family.layer:  # in HF's order, which is the order of the family's roles
            *parents, leaf = paths[role]
            node = self
            for depth, name in enumerate(parents):
                if name not in node._modules:
                    node.add_module(name, BertSelfAttention(H, qkv_names)
                                    if tuple(parents[:depth + 1]) == qkv_path else Block())
                node = node._modules[name]
            if role in leaves:
                node.add_module(leaf, leaves[role])
        self._init_dropouts(config, family)
        # role -> (the container holding its module, the module's name there). The containers are fastbert's own and
        # stay; the module in one is read at every forward, since PEFT and from_hf put theirs there. Not submodules.
        self.__dict__["_slots"] = {role: (self.get_submodule(".".join(paths[role][:-1])), paths[role][-1])
                                   for role in family.layer}
        if not family.pre_norm:  # what `weights` reads: the fused QKV's holder, then each linear's and LayerNorm's
            # container dict and name
            self.__dict__["_leaves"] = (self._slots["query"][0], *(
                (self._slots[role][0]._modules, self._slots[role][1])
                for role in ("query", "key", "value", "attn_out", "ffn_in", "ffn_out", "ln1", "ln2")))
        # read once: a transformers config attribute costs ~1 us, and the weights' shapes fix these anyway (the norms'
        # eps and the dropouts' p are read off their modules at every forward, as transformers' forward reads them)
        self.num_heads = config.num_attention_heads
        self.activation = twins.ACTIVATIONS[family.get(config, "hidden_act")]
        self.scale = twins.default_scale(H // config.num_attention_heads)
        self.c2p = self.p2c = False
        if family.disentangled:
            self._init_disentangled(config, H)
        self.gradient_checkpointing = False  # set by gradient_checkpointing_enable (also a head's, transformers')

    def _init_dropouts(self, config, family: families.Family) -> None:
        """HF's dropout modules at HF's paths (LAYER_DROPOUTS), built as the config says; ModernBERT's dropout on the
        attention probabilities is a float on its attention module (HF's `attention_dropout`), its dropout after Wo an
        nn.Identity when that is 0, as HF builds them. `_dropouts`: (holder, name) of each of DROPOUT_KINDS, or None
        where the family has none (DistilBERT after its attention output; DeBERTa's positions without
        relative_attention). Not submodules."""
        built = dict(zip(DROPOUT_KINDS, (*layer_dropouts(family, config), family.get(config, "hidden_dropout_prob"))))
        paths = dict(LAYER_DROPOUTS[family.name])
        if family.disentangled and not getattr(config, "relative_attention", False):
            del paths["positions"]
        slots = {}
        for kind, path in paths.items():
            parent, _, name = path.rpartition(".")
            holder, p = self.get_submodule(parent), built[kind]
            if family.pre_norm and kind == "attention":
                holder.attention_dropout = p
            else:
                holder.add_module(name, nn.Identity() if family.pre_norm and kind == "attention_output" and p == 0
                                  else nn.Dropout(p))
            slots[kind] = (holder, name)
        self.__dict__["_dropouts"] = tuple(slots.get(kind) for kind in DROPOUT_KINDS)

    def _init_disentangled(self, config, H: int) -> None:
        """DeBERTa-v2: the scale 1/sqrt(hd * (1 + len(pos_att_type))) (HF counts the terms even without
        relative_attention), the terms this layer computes, and pos_key_proj / pos_query_proj (HF's module names, after
        value_proj) when the position projections are not query_proj / key_proj themselves."""
        pos_att_type = configs.deberta_pos_att_type(config)
        factor = 1 + ("c2p" in pos_att_type) + ("p2c" in pos_att_type)
        # HF's float32 sqrt, so that the scale is bit-identical (on the CPU: a model may be built on meta)
        head_dim = torch.tensor(H // config.num_attention_heads, dtype=torch.float, device="cpu")
        self.pos_scale = float(torch.sqrt(head_dim * factor))
        self.scale = 1.0 / self.pos_scale
        relative_attention = getattr(config, "relative_attention", False)
        self.c2p = relative_attention and "c2p" in pos_att_type
        self.p2c = relative_attention and "p2c" in pos_att_type
        self.share_att_key = getattr(config, "share_att_key", False)
        sa = self.self_attention
        if relative_attention and not self.share_att_key:
            if self.c2p:
                sa.add_module("pos_key_proj", nn.Linear(H, H))
            if self.p2c:
                sa.add_module("pos_query_proj", nn.Linear(H, H))

    def _disentangled(self, qkv, w_qkv, b_qkv, positions, p_pos: float):
        """DeBERTa's per-token terms (twins.Disentangled) from this forward's rel_embeddings [P, H] (`positions`: that
        tensor or None; a positional tensor, so that reentrant checkpointing hands it its gradient): pk / pq through
        the modules HF uses (key_proj / query_proj: the fused weight's rows while they are plain linears, else the
        module, adapter included; or pos_key_proj / pos_query_proj), then c2p = q @ pk^T and p2c = k @ pq^T per head
        as two batched GEMMs over the tokens, float32, scaled."""
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

    def module(self, role: str) -> nn.Module:
        """The module at `role`'s HF path now (an adapter PEFT put there, if any), read through its container's
        module dict: each nn.Module.__getattr__ step is Python work on the host (bench/RESULTS.md, "Measurements
        cited by the code")."""
        parent, name = self._slots[role]
        return parent._modules[name]

    @property
    def self_attention(self) -> BertSelfAttention | None:
        """The module that holds query/key/value and their fused weight (None where the checkpoint fuses them)."""
        slot = self._slots.get("query")
        return None if slot is None else slot[0]

    def dropouts(self) -> tuple[float, float, float, float]:
        """(attention probabilities, attention output, FFN, DeBERTa's positions) dropout in train mode (the forward
        takes none in eval mode): the p of the layer's dropout modules now, where transformers' forward reads it (so a
        change after the model was built is seen by the next forward). ModernBERT: its attention module's
        attention_dropout on the probabilities, attn.out_drop after Wo, mlp.drop on act(a) * g."""
        return tuple(0.0 if slot is None else _probability(*slot) for slot in self._dropouts)

    def forward(self, x: torch.Tensor, attn, run, output_attentions: bool = False, positions=None, workspace=None):
        """x [T, H] -> [T, H]. `attn`: a TokenLayout (packed) or an AttentionMask (padded rows); `run`: the four
        ops as resolved for this forward (dispatch.plan); `positions`: what the attention reads of positions, or
        None: MPNet's per-distance bias table, ModernBERT's rotary cos/sin for this layer's type; `workspace`: a
        twins.Workspace the twins write into (pre-norm layers, a CPU forward without autograd), or None. Under
        gradient checkpointing, GradientCheckpointingLayer recomputes this in the backward pass (the arguments come
        positionally for that)."""
        if self.family.pre_norm:
            return self._forward_pre_norm(x, attn, run, output_attentions, positions, workspace)
        bias = None if self.family.disentangled else positions
        w = self.weights(run)
        p_attn, p_attn_out, p_ffn_out, p_pos = self.dropouts() if self.training else _NO_DROPOUT
        if w is None:  # an adapter (PEFT) wraps one of the layer's linears, or another module sits at one
            return self._forward_adapted(x, attn, run, output_attentions, positions, p_attn, p_attn_out, p_ffn_out,
                                         p_pos)

        qkv = run.qkv_projection(x, w.qkv, w.qkv_bias, self.num_heads)                           # [T, 3, nh, hd]
        dis = self._disentangled(qkv, w.qkv, w.qkv_bias, positions, p_pos) if self.family.disentangled else None
        extras = NONE if bias is None and dis is None else Extras(bias, disentangled=dis)
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions, extras)     # [T, H]
        x = run.residual_layernorm(ctx, w.attn_out, w.attn_out_bias, x, w.ln1, w.ln1_bias, w.ln1_eps,
                                   p_attn_out)                                                  # [T, H]
        h = run.bias_gelu(x, w.ffn_in, w.ffn_in_bias, self.activation)                            # [T, I]
        x = run.residual_layernorm(h, w.ffn_out, w.ffn_out_bias, x, w.ln2, w.ln2_bias, w.ln2_eps,
                                   p_ffn_out)                                                   # [T, H]
        return x, probs

    def _forward_pre_norm(self, x, attn, run, output_attentions, rotary, workspace=None):
        """ModernBERT's layer on the same four ops: the attention output's residual add and the MLP's LayerNorm are
        one pre-norm residual_layernorm (the new stream and its norm), the MLP's input GEMM computes act(a) * g in
        its epilogue, and the MLP's output GEMM adds the stream (a linear the layer calls, so an adapter on it is
        honoured). A linear an adapter wraps is called as the module it is."""
        ln1, qkv_in, out, ln2, wi, wo = (self.module(role) for role in ("ln1", "qkv", "attn_out", "ln2", "ffn_in",
                                                                        "ffn_out"))
        p_attn, p_attn_out, p_mlp, _ = self.dropouts() if self.training else _NO_DROPOUT
        plain = adapters.is_plain_linear
        ws = {} if workspace is None else {"workspace": workspace}  # the twins' buffers; what the layer returns is
        # never one of them (the addmm below or x + wo(g) allocates the new stream)
        if type(ln1) is nn.LayerNorm:
            h = torch.layer_norm(x, (x.shape[-1],), ln1.weight, ln1.bias, ln1.eps)
        else:  # layer 0's nn.Identity, or another module in the norm's place
            h = ln1(x)
        if plain(qkv_in):
            qkv = run.qkv_projection(h, qkv_in.weight, qkv_in.bias, self.num_heads, **ws)        # [T, 3, nh, hd]
        else:
            qkv = qkv_in(h).view(h.shape[0], 3, self.num_heads, -1)
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions,
                                   Extras(window=self.window, rotary=rotary), **ws)             # [T, H]
        if plain(out) and type(ln2) is nn.LayerNorm:
            x, h = run.residual_layernorm(ctx, out.weight, out.bias, x, ln2.weight, ln2.bias, ln2.eps, p_attn_out,
                                          pre_norm=True, **ws)                                  # [T, H] each
        else:
            x = x + twins.dropout(out(ctx), p_attn_out)  # p_attn_out is 0 in eval mode
            h = ln2(x)
        if plain(wi):
            g = run.bias_gelu(h, wi.weight, wi.bias, self.activation, gated=True, **ws)       # [T, I]
        else:
            a, gate = wi(h).chunk(2, dim=-1)
            g = twins.activate(a, self.activation) * gate
        if p_mlp > 0:
            g = twins.dropout(g, p_mlp)
        if plain(wo) and wo.bias is None:
            return torch.addmm(x, g, wo.weight.t()), probs  # one GEMM that adds the stream: x + g @ Wo^T
        return x + wo(g), probs

    def _forward_adapted(self, x, attn, run, output_attentions, positions, p_attn, p_attn_out, p_ffn_out, p_pos):
        """The same layer with adapters on some linears. The QKV projection stays one GEMM over the base weights;
        each adapted part adds its low-rank x·A·B to its third of the output. Any other adapted linear is called as
        the module it is (its op runs as PyTorch: merge_and_unload() puts it back on the fused ops)."""
        sa = self.self_attention
        weight, bias_qkv = sa.fused()
        qkv = run.qkv_projection(x, weight, bias_qkv, self.num_heads)                            # [T, 3, nh, hd]
        for i, name in enumerate(sa.names):
            delta = adapters.lora_delta(sa._modules[name], x)                                   # [T, H] or None
            if delta is not None:
                qkv[:, i] += delta.view(qkv.shape[0], *qkv.shape[2:]).to(qkv.dtype)
        bias = None if self.family.disentangled else positions
        dis = self._disentangled(qkv, weight, bias_qkv, positions, p_pos) if self.family.disentangled else None
        extras = NONE if bias is None and dis is None else Extras(bias, disentangled=dis)
        ctx, probs = run.attention(qkv, attn, self.scale, p_attn, output_attentions, extras)     # [T, H]
        x = self._dense_residual_layernorm("attn_out", "ln1", ctx, x, run, p_attn_out)          # [T, H]
        dense = self.module("ffn_in")
        if adapters.is_plain_linear(dense):
            h = run.bias_gelu(x, dense.weight, dense.bias, self.activation)                      # [T, I]
        else:
            h = twins.activate(dense(x), self.activation)
        return self._dense_residual_layernorm("ffn_out", "ln2", h, x, run, p_ffn_out), probs    # [T, H]

    def _dense_residual_layernorm(self, dense_role, ln_role, y, residual, run, p):
        """LayerNorm(dropout(dense(y)) + residual), on the fused op when `dense` is a plain linear."""
        dense, ln = self.module(dense_role), self.module(ln_role)
        if adapters.is_plain_linear(dense) and type(ln) is nn.LayerNorm:
            return run.residual_layernorm(y, dense.weight, dense.bias, residual, ln.weight, ln.bias, ln.eps, p)
        h = dense(y)
        if p > 0:
            h = twins.dropout(h, p)
        return ln(h + residual)

    def weights(self, run) -> LayerWeights | None:
        """The layer's current parameters for a forward of plan `run` (dispatch.Ops), read through the module dicts
        (see `module`). None when a linear or LayerNorm is not the plain torch module (an adapter PEFT put there, a norm
        of another kind): BertLayer._forward_adapted calls those."""
        sa, (dq, q), (dk, k), (dv, v), (do, o), (di, i), (df, f), (d1, ln1), (d2, ln2) = self._leaves
        q, k, v, o, i, f, ln1, ln2 = dq[q], dk[k], dv[v], do[o], di[i], df[f], d1[ln1], d2[ln2]
        if not (type(q) is type(k) is type(v) is type(o) is type(i) is type(f) is nn.Linear
                and type(ln1) is type(ln2) is nn.LayerNorm):
            return None
        q, k, v, o, i, f = q._parameters, k._parameters, v._parameters, o._parameters, i._parameters, f._parameters
        eps1, eps2, ln1, ln2 = ln1.eps, ln2.eps, ln1._parameters, ln2._parameters
        qkv, qkv_bias = sa.fused((q["weight"], k["weight"], v["weight"], q["bias"], k["bias"], v["bias"]), run.traced,
                                 run.grad)
        return LayerWeights(qkv, qkv_bias, o["weight"], o["bias"], ln1["weight"], ln1["bias"], eps1,
                            i["weight"], i["bias"], f["weight"], f["bias"], ln2["weight"], ln2["bias"], eps2)


_NO_DROPOUT = (0.0, 0.0, 0.0, 0.0)

# A layer's dropouts, in the order BertLayer.dropouts gives them: on the attention probabilities, after the attention
# output's dense, in the FFN (after its output dense; ModernBERT: on act(a) * g), on DeBERTa's rel_embeddings.
DROPOUT_KINDS = ("attention", "attention_output", "ffn", "positions")
# Where each family's layer holds them (HF's module paths); ModernBERT's "attention" is a float attribute
_BERT_DROPOUTS = {"attention": "attention.self.dropout", "attention_output": "attention.output.dropout",
                  "ffn": "output.dropout"}
LAYER_DROPOUTS = {
    "bert": _BERT_DROPOUTS, "roberta": _BERT_DROPOUTS, "electra": _BERT_DROPOUTS,
    "distilbert": {"attention": "attention.dropout", "ffn": "ffn.dropout"},
    "mpnet": {"attention": "attention.attn.dropout", "attention_output": "attention.dropout", "ffn": "output.dropout"},
    "modernbert": {"attention": "attn.attention_dropout", "attention_output": "attn.out_drop", "ffn": "mlp.drop"},
    "deberta-v2": {**_BERT_DROPOUTS, "positions": "attention.self.pos_dropout"},
}


def _probability(holder: nn.Module, name: str) -> float:
    """The dropout probability transformers' forward applies at holder.<name> now: the p of the module there while
    it is in train mode (0 for nn.Identity); where the name is a float (ModernBERT's attention_dropout), that float
    while the holder is in train mode."""
    module = holder._modules.get(name)
    if module is not None:
        return getattr(module, "p", 0.0) if module.training else 0.0
    return getattr(holder, name, 0.0) if holder.training else 0.0


def _column_table(columns: dict, device) -> torch.Tensor:
    """DeBERTa's column table (relative.deberta_column_table, built once per model on the CPU) on `device`."""
    key = str(device)
    if key not in columns:
        if tracing():  # a constant of the traced graph
            return columns["cpu"].to(device)
        columns[key] = columns["cpu"].to(device)
    return columns[key]


def layer_dropouts(family: families.Family, config) -> tuple[float, float, float]:
    """(attention probabilities, attention output, FFN) dropout of a family's layer as its config says: what the
    layer's dropout modules are built with."""
    p_attn, p_hidden = family.get(config, "attention_probs_dropout_prob"), family.get(config, "hidden_dropout_prob")
    if family.pre_norm:  # ModernBERT's attention_dropout is also its out_drop after Wo
        return p_attn, p_attn, p_hidden
    return p_attn, p_hidden if family.attention_output_dropout else 0.0, p_hidden


# BertLayer's own forward, under the wrapper transformers' GradientCheckpointingLayer puts around it
_LAYER_FORWARD = getattr(BertLayer.forward, "__wrapped__", BertLayer.forward)


def _module_call(layer, *args):
    return layer(*args)  # the layer's own __call__ (before transformers 4.52, checkpointing lives there)


def _layer_call(layers, run):
    """How `encode` calls its layers this forward. Where nothing can tell the difference, BertLayer's forward itself:
    nn.Module.__call__ and the checkpointing wrapper cost ~17k instructions of host work a layer (callgrind,
    bench/RESULTS.md, the host-bound cell). Through the module otherwise: a hook on a
    layer or a global one, a compiled, replaced or checkpointing layer, a trace (it records module scopes)."""
    if run.traced:
        return _module_call
    for layer in layers:
        if not _plain(layer, BertLayer) or layer.gradient_checkpointing:
            return _module_call
    return _LAYER_FORWARD


class BertEncoder(nn.Module):
    """The layers (HF's `encoder`; DistilBERT's `transformer`) and, for MPNet, the relative position bias embedding
    [buckets, nh] its attention reads through one per-distance table per forward."""

    def __init__(self, config, family: families.Family = families.BERT):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config, family, i) for i in range(config.num_hidden_layers)])
        if family.relative_bias:
            self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets,
                                                        config.num_attention_heads)
        if family.disentangled:  # DeBERTa-v2: HF's rel_embeddings [2 * span, H] and their LayerNorm, in its order
            if getattr(config, "relative_attention", False):
                self.rel_embeddings = nn.Embedding(2 * relative.deberta_span(config), config.hidden_size)
            if "layer_norm" in configs.deberta_norm_rel_ebd(config):
                self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, first_token_states):
        dense = self._modules["dense"]
        if _plain(dense, nn.Linear):
            p = dense._parameters
            return torch.tanh(F.linear(first_token_states, p["weight"], p["bias"]))  # [n, H] from each [CLS] token
        return torch.tanh(dense(first_token_states))


def _same(h):
    return h


def _shapes(batch: Batch):
    """(shaped, unshaped, first) for a batch: packed [T, H] -> the caller's shape (zeros at padded positions), its
    inverse, and the tokens the pooler reads."""
    layout = batch.layout
    if batch.output == "packed":  # packed in, packed out
        return _same, _same, lambda h: first_tokens(h, layout)
    if batch.output == "hf_packed":  # transformers' packed form: one row of T tokens; its pooler reads token 0
        return (lambda h: h[None]), (lambda h: h[0]), (lambda h: h[:1])
    if layout is not None:
        return (lambda h: pad(h, layout)), (lambda h: unpad(h, layout)), (lambda h: first_tokens(h, layout))
    B, S = batch.shape
    unshaped = lambda h: h.reshape(B * S, h.shape[-1])  # noqa: E731
    if batch.real_tokens is not None:  # padded rows of a padding-free model: the outputs packing would give
        keep = batch.real_tokens
        first_real = keep.to(torch.int32).argmax(dim=1)  # a row with no real token: 0, which is zeroed below
        shaped = lambda h: h.view(B, S, h.shape[-1]) * keep[:, :, None]  # noqa: E731
        return shaped, unshaped, lambda h: shaped(h)[torch.arange(B, device=h.device), first_real]
    # padded rows: HF's pooler reads position 0 of every row
    return (lambda h: h.view(B, S, h.shape[-1])), unshaped, (lambda h: h.view(B, S, h.shape[-1])[:, 0])


class HiddenStates:
    """Which hidden states a forward returns, and in the caller's shape. As in transformers, hidden_states[i] is the
    tensor layer i consumes: the packed layer input is gathered back from it, so gradients reach it (attribution
    methods read them). Layers not selected cost nothing; without output_hidden_states there is no HiddenStates."""

    def __init__(self, selected, shaped, unshaped):
        self.selected, self.shaped, self.unshaped = selected, shaped, unshaped

    @staticmethod
    def of(output_hidden_states, num_layers: int, batch: Batch) -> "HiddenStates | None":
        """transformers' `output_hidden_states`: a flag, or (transformers 5) the index or indices of the hidden states
        to keep (negative ones count from the end; out of range select nothing); the others come back as None."""
        if not output_hidden_states:
            return None
        selected = None
        if not isinstance(output_hidden_states, bool):
            indices = [output_hidden_states] if isinstance(output_hidden_states, int) else list(output_hidden_states)
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in indices):
                raise TypeError(f"output_hidden_states must be a bool, an int or a list of ints, got "
                                f"{output_hidden_states!r}")
            n = num_layers + 1
            selected = {i % n for i in indices if -n <= i < n}
        shaped, unshaped, _ = _shapes(batch)
        return HiddenStates(selected, shaped, unshaped)

    def record(self, states: list, x: torch.Tensor) -> torch.Tensor:
        """Append hidden state len(states) (or None) and return what the next layer consumes."""
        if self.selected is not None and len(states) not in self.selected:
            states.append(None)
            return x
        h = self.shaped(x)
        states.append(h)
        return self.unshaped(h)


class BertModel(TransformersModelMixin, nn.Module):
    """The encoder of every family fastbert runs. `config`: a transformers config (kept as the very object: the
    model's `config`), a dict, or a config.json path; its model_type picks the family (fastbert/families.py: HF's
    module paths, the embeddings, the attention bias). add_pooling_layer: None = the family's own (a pooler for BERT,
    RoBERTa and MPNet, none for ELECTRA and DistilBERT)."""

    main_input_name = "input_ids"  # what transformers' pipelines and Trainer read off a model

    def __init__(self, config, add_pooling_layer: bool | None = None, kernels="auto", padding_free: bool = True):
        super().__init__()
        config = configs.load(config)
        self.config = config
        self.family = family = families.of(config)
        if add_pooling_layer is None:
            add_pooling_layer = family.pooler
        elif add_pooling_layer and not family.pooler:
            raise ValueError(f"add_pooling_layer=True: {family.title} has no pooler (transformers' "
                             f"{families.encoder_class(config.model_type)} has none)")
        # Padded input runs on its real tokens only; False keeps padded execution (HF's values at padded positions).
        self.padding_free = padding_free
        self._plans = {}  # dispatch.Situation -> the resolved ops (dispatch.plan)
        self._plans_failures = 0  # len(fallback._FAILED) when the plans were made
        self._warned_autograd = False  # said once per model (BertModel._warn_autograd_in_eval)
        H = config.hidden_size
        width = config.embedding_size if family.projection else H
        self.head_dim = H // config.num_attention_heads
        self.embeddings = (DebertaEmbeddings if family.disentangled else EMBEDDINGS[family.positions])(config, width,
                                                                                                         family)
        # ELECTRA: embeddings narrower than the layers are widened by a projection (HF's module name and key)
        self.embeddings_project = nn.Linear(width, H) if width != H else None
        if family.pre_norm:  # ModernBERT: the layers' list itself under the model (HF's `layers`, which is also the
            # name of the property below: add_module would refuse it), then the final norm
            self._modules[family.layers] = nn.ModuleList([BertLayer(config, family, i)
                                                          for i in range(config.num_hidden_layers)])
            self.final_norm = nn.LayerNorm(H, eps=family.get(config, "layer_norm_eps"), bias=config.norm_bias)
        else:
            self.add_module(family.layers, BertEncoder(config, family))  # HF's: encoder (DistilBERT: transformer)
            self.final_norm = None
        self.__dict__["_inv_freq"] = {}  # (layer type, device) -> rotary inv_freq (ModernBERT), made on first use
        # DeBERTa: the column each distance j - i reads, one table for every length (relative.deberta_column_table)
        self._disentangled = family.disentangled and any(layer.c2p or layer.p2c for layer in self.layers)
        self.__dict__["_columns"] = {"cpu": relative.deberta_column_table(config)} if self._disentangled else {}
        for layer in self.layers:  # one table (per device) for every layer
            layer.__dict__["_columns"] = self._columns
        # the local layers' half-window (ModernBERT), which "auto" times attention with; None without local layers
        self._local_window = next((layer.window for layer in self.layers
                                   if family.pre_norm and layer.window is not None), None)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.activation = twins.ACTIVATIONS[family.get(config, "hidden_act")]
        self._kernels = {op: "auto" for op in OPS}
        self.set_kernels(kernels)
        dispatch.triton_import_error()  # import the kernels now if they import at all: never inside a traced forward
        self.apply(self._init_weights)

    def _init_weights(self, module):
        """HF's initialisation, for models built from a config (loading overwrites it; on meta it costs nothing)."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                nn.init.zeros_(module.weight[module.padding_idx])
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            if module.bias is not None:  # ModernBERT's norm_bias=False
                nn.init.zeros_(module.bias)
        if module is self.embeddings and getattr(self.config, "sinusoidal_pos_embds", False):  # DistilBERT's option
            from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings
            weight = module.position_embeddings.weight
            if weight.device.type != "meta":
                with torch.no_grad():
                    create_sinusoidal_embeddings(weight.shape[0], weight.shape[1], weight)

    @property
    def layers(self) -> nn.ModuleList:
        """The encoder layers (HF's encoder.layer; DistilBERT's transformer.layer; ModernBERT's layers)."""
        container = self._modules[self.family.layers]
        return container if isinstance(container, nn.ModuleList) else container.layer

    # ---- the per-op switch -------------------------------------------------------------------------------------
    @property
    def kernels(self) -> dict:
        """op name -> requested backend ("auto", "torch" or "triton")."""
        return dict(self._kernels)

    def resolved_kernels(self, tokens: int = 512, max_seqlen: int = 128) -> dict:
        """op -> "triton" or "torch": what an inference forward of `tokens` real tokens (longest sequence
        `max_seqlen`) runs here. On a GPU, "auto" ops are measured for that bucket first if they were not yet."""
        run = self.resolve_ops(needs_grad=False, tokens=tokens, max_seqlen=max_seqlen)
        failed = {op for op in run.triton if fallback.failed(op, self.dtype, tokens)}  # "auto" left them on their twin
        return {op: "triton" if op in run.triton - failed else "torch" for op in OPS}

    def set_kernels(self, backend=None, **per_op) -> "BertModel":
        """set_kernels("triton") sets every op; set_kernels(attention="torch", ...) sets single ops; or a dict."""
        if isinstance(backend, dict):
            per_op = {**backend, **per_op}
            backend = None
        wanted = dict.fromkeys(OPS, backend) if backend is not None else {}
        wanted.update(per_op)
        if not wanted:
            got = "an empty dict" if isinstance(backend, dict) else repr(backend)
            raise ValueError(f"set_kernels needs a backend for every op ({', '.join(dispatch.BACKENDS)}) or op=backend "
                             f"pairs (ops: {', '.join(OPS)}); got {got}")
        for op, b in wanted.items():
            dispatch.check_backend(op, b)
            if b == "triton" and dispatch.triton_import_error():
                raise RuntimeError(f"kernels: op {op!r} asked for 'triton' but {dispatch.triton_import_error()}")
        self._kernels.update(wanted)
        return self

    # ---- forward -----------------------------------------------------------------------------------------------
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
                output_hidden_states=None, output_attentions=None, return_dict=None, use_cache=None,
                cu_seqlens=None, max_seqlen=None, **kwargs):
        """HF's BertModel.forward. Packed input: `input_ids` [T] with `cu_seqlens` [n + 1] (and optionally
        `max_seqlen`) returns packed outputs ([T, H], pooler [n, H]); HF's own `cu_seq_lens_q` / `max_length_q` with
        [1, T] ids are accepted as transformers takes them. Unset output flags take the config's values, as HF's do;
        keywords a head or Trainer passes that an encoder has no use for (num_items_in_batch, ...) are ignored."""
        cfg = self.config
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        output_attentions = bool(getattr(cfg, "output_attentions", False) if output_attentions is None
                                 else output_attentions)
        return_dict = getattr(cfg, "return_dict", True) if return_dict is None else return_dict
        batch = prepare(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                        output_attentions, cu_seqlens, max_seqlen, **kwargs)
        needs_grad = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.parameters())
            or (batch.inputs_embeds is not None and batch.inputs_embeds.requires_grad))
        if needs_grad and not self.training and not self._warned_autograd:
            self._warn_autograd_in_eval()
        run = self.resolve_ops(needs_grad, batch.why_padded(output_attentions), *batch.size)
        if not self.family.selects_hidden_states and output_hidden_states:
            output_hidden_states = True  # MPNet's forward reads a selection as a flag: every layer, as HF gives it
        keep = HiddenStates.of(output_hidden_states, len(self.layers), batch)
        x, hidden_states, attentions = self.encode(batch.input_ids, batch.token_type_ids, batch.position_ids,
                                                   batch.attn, run, batch.inputs_embeds, keep, output_attentions)
        out = self.finish(batch, x, hidden_states, attentions, keep is not None, output_attentions)
        return out if return_dict else self.output_tuple(out)

    def output_tuple(self, out) -> tuple:
        """HF's return_dict=False tuple of the family: the output's non-None fields in order; MPNet's keeps a
        pooler_output of None in its slot (its heads take outputs[2:] as hidden_states and attentions)."""
        if not self.family.tuple_keeps_pooler:
            return out.to_tuple()
        rest = tuple(v for v in (out.hidden_states, out.attentions) if v is not None)
        return (out.last_hidden_state, out.pooler_output, *rest)

    def _warn_autograd_in_eval(self) -> None:
        """An eval-mode forward with autograd on (model(**inputs) without torch.no_grad(), a common habit) runs every
        op on its PyTorch twin: on a GPU under "auto" that is a silent speed cliff, so it is said once per model."""
        device = self.embeddings.word_embeddings.weight.device
        if device.type not in dispatch.MEASURED_DEVICE_TYPES or "auto" not in self._kernels.values() \
                or dispatch.triton_unavailable(device):
            return
        self._warned_autograd = True
        warnings.warn("fastbert: this eval-mode forward runs with autograd enabled, so every op runs its PyTorch twin "
                      "instead of its Triton kernel (the kernels serve inference). Call the model under "
                      "torch.inference_mode() (or torch.no_grad()) for the fast path; said once for this model",
                      stacklevel=3)

    def cuda_graphs(self, token_buckets=(128, 256, 512, 1024, 2048, 4096, 8192), max_seqs: int = 256,
                    max_seqlen: int | None = None):
        """A runner that replays CUDA graphs of `encode` captured for packed token-count buckets (fastbert/graphs.py);
        call it like the model. Resolves every bucket's backends now; captures each bucket on its first use (or all of
        them at runner.capture())."""
        from .graphs import GraphRunner
        return GraphRunner(self, token_buckets, max_seqs, max_seqlen)

    def encode(self, input_ids, token_type_ids, position_ids, attn, run, inputs_embeds=None,
               keep_hidden_states=None, output_attentions=False):
        """The device-only part: packed tokens [T] -> final hidden states [T, H]. No host read, no branch on tensor
        values (a CUDA graph captures this). `keep_hidden_states`: a HiddenStates saying which layer inputs to return
        and in what shape (True: all of them, packed), or None."""
        if self.family.disentangled:  # HF's DeBERTa embeddings are zero at padded positions of padded rows
            mask = attn.key_valid.reshape(-1, 1) if isinstance(attn, AttentionMask) and attn.key_valid is not None \
                else None
            x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds, mask)  # [T, H]
        else:
            x = self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)   # [T, H] (ELECTRA: [T, E])
        if self.embeddings_project is not None:
            x = self.embeddings_project(x)                                               # [T, E] -> [T, H]
        if keep_hidden_states is True:
            keep_hidden_states = HiddenStates(None, _same, _same)
        hidden_states, attentions = [] if keep_hidden_states else None, [] if output_attentions else None
        layers = self.layers
        positions = self.attention_positions(position_ids, len(layers))                 # one per layer, or None
        workspace = self._workspace(x, run)                                             # ModernBERT on CPU, or None
        call = _layer_call(layers, run)                                                 # layer(...), or its forward
        for layer, at in zip(layers, positions):  # (a checkpointing layer recomputes itself in backward)
            if keep_hidden_states:
                x = keep_hidden_states.record(hidden_states, x)
            x, probs = call(layer, x, attn, run, output_attentions, at, workspace)
            if output_attentions:
                attentions.append(probs)
        if self.final_norm is not None:  # pre-norm: the last hidden state is normed (and is HF's last hidden_states)
            x = self.final_norm(x)
        if keep_hidden_states:
            x = keep_hidden_states.record(hidden_states, x)
        return x, hidden_states, attentions

    def _workspace(self, x, run: dispatch.Ops) -> twins.Workspace | None:
        """The buffers a pre-norm forward's twins reuse from layer to layer (twins.Workspace), where nothing records
        the calls: on CPU, autograd off, not traced, every op on its twin. Else None: the ops allocate as usual."""
        if not self.family.pre_norm or x.device.type != "cpu" or torch.is_grad_enabled() or run.traced \
                or run.triton or tracing():
            return None
        return twins.Workspace()

    def attention_positions(self, position_ids, num_layers: int) -> list:
        """What each layer's attention reads of positions, built once per forward: MPNet's per-distance bias table
        (one for every layer), ModernBERT's rotary cos/sin of the packed tokens (one per layer type), else None."""
        if self.family.relative_bias:
            return [self.relative_bias()] * num_layers
        if self.family.disentangled:
            return [self.rel_positions()] * num_layers
        if not self.family.pre_norm:
            return [None] * num_layers
        tables = {}
        for layer in self.layers:
            if layer.layer_type not in tables:
                tables[layer.layer_type] = twins.rotary_tables(position_ids.reshape(-1),
                                                               self._rotary_inv_freq(layer.layer_type,
                                                                                     position_ids.device))
        return [tables[layer.layer_type] for layer in self.layers]

    def _rotary_inv_freq(self, layer_type: str, device) -> torch.Tensor:
        """A layer type's inv_freq, computed from the config once per device (not a buffer: nothing to load, nothing
        for to_empty to leave uninitialised)."""
        if tracing():
            return rotary.inv_freq(self.config, layer_type, self.head_dim, device)
        key = (layer_type, device)
        if key not in self._inv_freq:
            self._inv_freq[key] = rotary.inv_freq(self.config, layer_type, self.head_dim, device)
        return self._inv_freq[key]

    def rel_positions(self):
        """DeBERTa's rel_embeddings for this forward: HF's get_rel_embedding (the table through the
        encoder's LayerNorm when norm_rel_ebd says so), once for every layer; None without relative_attention."""
        if not self._disentangled:
            return None
        encoder = self._modules[self.family.layers]
        rel = encoder.rel_embeddings.weight
        norm = encoder._modules.get("LayerNorm")
        if norm is not None:
            rel = norm(rel)
        return rel

    def relative_bias(self) -> torch.Tensor | None:
        """MPNet's attention bias for this forward as one per-distance table (fastbert/relative.py): distances past
        +-RELATIVE_REACH all fall in the last bucket, so the table is exact at any length; None for other families."""
        if not self.family.relative_bias:
            return None
        weight = self._modules[self.family.layers].relative_attention_bias.weight
        return relative.relative_bias_table(weight, RELATIVE_REACH)

    def finish(self, batch: Batch, x, hidden_states, attentions, output_hidden_states, output_attentions):
        """Packed [T, H] -> the caller's shape (zeros at padded positions), the pooler, HF's output class.
        `hidden_states` come from encode already in the caller's shape; the last one, when kept, is the
        last_hidden_state itself (as in transformers)."""
        shaped, _, first = _shapes(batch)
        last = hidden_states[-1] if output_hidden_states and hidden_states and hidden_states[-1] is not None \
            else shaped(x)
        out = dict(last_hidden_state=last,
                   hidden_states=tuple(hidden_states) if output_hidden_states else None,
                   attentions=tuple(attentions) if output_attentions else None)
        kind = self.family.output  # HF's output class of the family: its fields and its tuple order
        if kind == "BaseModelOutput":  # DistilBERT: no pooler output at all
            return BaseModelOutput(**out)
        cross = _EMPTY_CROSS_ATTENTIONS if output_attentions else None  # as the installed transformers reports it
        if kind == "BaseModelOutputWithPastAndCrossAttentions":  # ELECTRA: no pooler either
            return BaseModelOutputWithPastAndCrossAttentions(**out, cross_attentions=cross)
        pooler = self.pooler
        out["pooler_output"] = None if pooler is None else \
            (pooler.forward if _plain(pooler, BertPooler) else pooler)(first(x))
        if kind == "BaseModelOutputWithPooling":  # MPNet
            return BaseModelOutputWithPooling(**out)
        return BaseModelOutputWithPoolingAndCrossAttentions(**out, cross_attentions=cross)

    def _largest_dropouts(self) -> tuple[float, float]:
        """(attention probabilities, residual_layernorm's) dropout: the largest of any layer's now (train mode), which
        the plan's kernels are chosen by."""
        p = [layer.dropouts() for layer in self.layers] or [_NO_DROPOUT]
        return max(d[0] for d in p), max(max(d[1], d[2]) for d in p)

    def resolve_ops(self, needs_grad: bool = False, padded: str | None = None, tokens: int = 0,
                    max_seqlen: int = 0, ragged: bool = True) -> dispatch.Ops:
        """The four ops for this situation (device, dtype, autograd, dropout, why attention runs padded rows if it
        does, and on a GPU the token and sequence-length buckets "auto" measured for, and whether the sequences'
        lengths differ), resolved once and cached: a forward pays one dictionary lookup for its backend choices. A
        kernel failure under "auto" (fallback.kernel_failed) drops the cache, so the plans say what runs."""
        weight = self._modules["embeddings"].tables()[0].weight  # the word table: the model's device and dtype
        cfg = self.config
        kernels = tuple(map(self._kernels.__getitem__, OPS))
        shapes = None
        if weight.device.type in dispatch.MEASURED_DEVICE_TYPES and "auto" in kernels and not needs_grad \
                and not self.training and tokens:
            # ModernBERT: attention is timed as its local layers run it (two of every three), rotary and windowed;
            # its global layers take the same choice
            bucket = measure.token_bucket
            shapes = measure.Shapes(bucket(tokens), cfg.hidden_size, self.family.get(cfg, "intermediate_size"),
                                    cfg.num_attention_heads, self.head_dim, bucket(max_seqlen), self.activation,
                                    ragged, RELATIVE_REACH if self.family.relative_bias else 0,
                                    window=self._local_window, rotary=self.family.pre_norm,
                                    gated=self.family.pre_norm, pre_norm=self.family.pre_norm,
                                    disentangled=2 * relative.deberta_span(cfg) if self._disentangled else 0)
        p_attn, p_hidden = self._largest_dropouts() if self.training else (0.0, 0.0)
        situation = dispatch.Situation(kernels, weight.device, weight.dtype, self.head_dim, needs_grad, p_attn,
                                       p_hidden, padded, shapes, self._disentangled)
        if dispatch.tracing():  # a compiled graph bakes the choice in; no cache to mutate inside it
            return dispatch.plan(situation)
        if self._plans_failures != len(fallback._FAILED):
            self._plans.clear()
            self._plans_failures = len(fallback._FAILED)
        run = self._plans.get(situation)
        if run is None:
            run = self._plans[situation] = dispatch.plan(situation)
        return run
