"""The embeddings of each family, at HF's module names: what turns token ids into the first layer's input.

    sum     (BERT, RoBERTa, ELECTRA, DistilBERT, MPNet)  word (+ type) + position tables, LayerNorm, dropout
    tokens  (ModernBERT)                                 the word table, LayerNorm, dropout; positions rotate q and k
    masked  (DeBERTa-v2)                                 the tables the config keeps, a projection, LayerNorm, times
                                                         the key mask, dropout
    table   (EuroBERT, Qwen3, Gemma 3)                   the word table alone, at the model's top (embed_tokens);
                                                         Gemma's times sqrt(hidden_size) (ScaledEmbedding)

Positions come from each token's index in its sequence, or (padding_idx, RoBERTa's family) counted from
padding_idx + 1 over the real tokens.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .. import families
from .host import drop, embed, norm


class BertEmbeddings(nn.Module):
    """word (+ token type) + position embeddings, LayerNorm, dropout, at `width` (hidden_size; ELECTRA:
    embedding_size). Position ids are each token's index in its sequence. DistilBERT and MPNet have no token types."""

    word_embeddings_name = "word_embeddings"

    def __init__(self, config, width: int, family: families.Family = families.BERT):
        super().__init__()
        pad = family.padding_idx if family.padding_idx is not None else config.pad_token_id
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=pad)
        # rotary families (Jina-Embeddings-v3, NomicBERT, GTE): no position table, positions rotate q and k; GTE's
        # type_vocab_size 0: no token type table
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width) \
            if family.positions != "rotary" else None
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width) \
            if family.token_types and config.type_vocab_size else None
        self._max_positions = config.max_position_embeddings
        self.LayerNorm = nn.LayerNorm(width, eps=family.get(config, "layer_norm_eps"))
        self.dropout = nn.Dropout(family.get(config, "hidden_dropout_prob"))

    @property
    def max_length(self) -> int:
        """The longest sequence the position table covers (read off the table: resize_position_embeddings swaps it);
        rotary positions: max_position_embeddings, what the model was trained for (longer input is not refused)."""
        table = self.position_embeddings
        return self._max_positions if table is None else table.num_embeddings

    def tables(self) -> tuple:
        """(word, token type, position) tables as they are now; None where the family has none."""
        tables = self._modules
        return tables["word_embeddings"], tables.get("token_type_embeddings"), tables.get("position_embeddings")

    def position_ids(self, input_ids, index):
        """The default position ids: `index` holds each token's index in its sequence (the shape of input_ids, [B, S]
        or packed [T]; input_ids is None when the caller gave inputs_embeds)."""
        return index

    def forward(self, input_ids, token_type_ids, position_ids, inputs_embeds, tasks=None):
        """`tasks` [T, tasks * rank]: each token's task selection (adapters.task_select), where the tables carry
        Jina's task adapters: each token's row of E + s A_t B_t, the low-rank part added before the LayerNorm."""
        tables = self._modules  # (read once: each nn.Module attribute lookup is Python work on the host)
        if inputs_embeds is None:
            inputs_embeds = embed(tables["word_embeddings"], input_ids)
        # HF's order of additions, so that fp32 sums round identically
        x = inputs_embeds
        types = tables.get("token_type_embeddings")  # (None: the family has no token types)
        if types is not None:
            x = x + embed(types, token_type_ids)
        positions = tables.get("position_embeddings")  # (None: rotary positions, applied in attention)
        if positions is not None:
            x = x + embed(positions, position_ids)
        if tasks is not None:
            lora = tables["task_adapters"]
            x = lora["word_embeddings"].add_delta(x, input_ids, tasks)                                # [T, width]
            if types is not None:
                x = lora["token_type_embeddings"].add_delta(x, token_type_ids, tasks)
        return drop(tables["dropout"], norm(tables["LayerNorm"], x))           # [T, width]


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


class ScaledEmbedding(nn.Embedding):
    """Gemma's token table: the rows times sqrt(hidden_size), that factor rounded to float32 and then to the table's
    dtype before the product, as transformers' Gemma3TextScaledWordEmbedding computes it (which keeps the factor in a
    buffer; here it is a float, so a model built on the meta device has nothing left to initialise)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx=None, embed_scale: float = 1.0):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar_embed_scale = embed_scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scalar_embed_scale, dtype=torch.float32, device=self.weight.device)
        return super().forward(input_ids) * scale.to(self.weight.dtype)

    @staticmethod
    def is_hf(module: nn.Module) -> bool:
        """transformers' scaled table of the same definition (Gemma3TextScaledWordEmbedding)."""
        return isinstance(module, nn.Embedding) and type(module).__name__.endswith("ScaledWordEmbedding")


class TableEmbeddings:
    """EuroBERT: the token table alone (no norm, no token types, no dropout; positions rotate q and k), which HF's
    model holds at its top as `embed_tokens`. Not a module: the model registers the table itself (`attach`), so that
    its state_dict key is HF's, and this reads it there at every call (from_hf and set_input_embeddings put theirs
    there)."""

    position_embeddings = token_type_embeddings = None
    word_embeddings_name = "embed_tokens"

    def __init__(self, config, width: int, family: families.Family):
        if family.embed_scale:  # Gemma: rows times sqrt(hidden_size)
            table = ScaledEmbedding(config.vocab_size, width, config.pad_token_id,
                                    embed_scale=config.hidden_size ** 0.5)
        else:
            table = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self._home = {"embed_tokens": table}
        self.max_length = config.max_position_embeddings  # what it was trained for; longer input is not refused

    def attach(self, model: nn.Module) -> None:
        """Register the table on `model` at HF's name and read it from there from now on."""
        model.add_module("embed_tokens", self._home["embed_tokens"])
        self._home = model._modules

    @property
    def word_embeddings(self) -> nn.Embedding:  # the name the rest of fastbert reads
        return self._home["embed_tokens"]

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._home["embed_tokens"]

    @embed_tokens.setter
    def embed_tokens(self, table: nn.Embedding) -> None:  # set_input_embeddings
        self._home["embed_tokens"] = table

    def tables(self) -> tuple:
        return self._home["embed_tokens"], None, None

    def position_ids(self, input_ids, index):
        return index

    def __call__(self, input_ids, token_type_ids, position_ids, inputs_embeds):
        return self._home["embed_tokens"](input_ids) if inputs_embeds is None else inputs_embeds     # [T, H]


def embeddings_class(family: families.Family) -> type:
    """The embeddings a family's `embeddings` and `positions` axes name."""
    if family.embeddings == "sum":
        return RobertaEmbeddings if family.positions == "padding_idx" else BertEmbeddings
    return {"tokens": TokenEmbeddings, "masked": DebertaEmbeddings, "table": TableEmbeddings}[family.embeddings]
