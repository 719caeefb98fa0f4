"""The first part of a forward, on the host: validate the call, fill HF's defaults, and lay the tokens out.

`prepare` is the only place in a forward allowed to read the device, and it does so once: index ranges, 0/1 masks,
the number of real tokens and the sequence lengths all come back in one host read. What it returns (`Batch`) holds
everything the device-only `encode` needs: token ids, types and positions already gathered to packed order, and
what attention needs to know (a TokenLayout for packed execution, or an AttentionMask for padded rows).

Padded rows (an AttentionMask) are kept where packing cannot give the caller what it asked for: output_attentions
(the probabilities are [B, nh, S, S]), a custom 3-D/4-D mask (it is not a key-padding mask), padding_free=False
(HF's values at padded positions), and tracing (torch.jit.trace, torch.compile, torch.export record one graph that
must serve every later batch, so nothing may depend on the mask's values).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import packing
from .adapters import NO_TASK, check_adapter_mask
from .layout import TokenLayout, unpad
from .mask import AttentionMask, not_zero_one, tracing

# Arguments HF's BertModel.forward accepts that only make sense for decoders / caches: accepted when unused.
DECODER_ONLY_ARGS = ("encoder_hidden_states", "encoder_attention_mask", "past_key_values", "cache", "head_mask")
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the dtypes a model may have
# HF's packed-sequence keywords (FlashAttention's varlen arguments, as transformers passes them).
HF_PACKED_ARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _transformers_kwargs() -> tuple:
    """The keywords of transformers' TransformersKwargs (what every transformers 5 model forward takes in **kwargs),
    as the installed transformers names them; none in transformers 4."""
    try:
        from transformers.utils.generic import TransformersKwargs
    except ImportError:
        return ()
    return tuple(getattr(TransformersKwargs, "__annotations__", {}))


# Keywords transformers' heads pass down to their encoder that an encoder has no use for: accepted and ignored, as
# transformers' own encoders do. Trainer's num_items_in_batch, the loss functions' keywords (a masked-LM head passes
# shift_labels and ignore_index down with the rest of its **kwargs), and transformers' TransformersKwargs. Keywords
# that would change the answer (is_causal=True, caches, cross-attention inputs) are refused where they are read.
IGNORED_ARGS = tuple(dict.fromkeys(
    ("num_items_in_batch", "output_router_logits", "seq_idx", "is_causal", "shift_labels", "ignore_index",
     *_transformers_kwargs())))


# What a range names, in its error
_RANGE_WORDS = {"input_ids": " (vocab_size)", "adapter_mask": " (task indices: 0 to the number of tasks - 1, or -1 "
                                                              "for no adapter)"}


class Tables(NamedTuple):
    """The model's embedding tables as one call reads them (once: each nn.Module attribute lookup is ~0.6 us of host
    work). types / positions: None where the family has none."""
    embeddings: torch.nn.Module
    word: torch.nn.Module
    types: torch.nn.Module | None
    positions: torch.nn.Module | None
    weight: torch.Tensor  # the word table's weight: the model's device and dtype

    @staticmethod
    def of(model) -> "Tables":
        embeddings = model.embeddings
        word, types, positions = embeddings.tables()
        return Tables(embeddings, word, types, positions, word.weight)


@dataclass(frozen=True)
class Batch:
    """A validated call, ready for the device. Token tensors are [T] in packed order ([B*S] for padded rows)."""
    input_ids: torch.Tensor | None
    token_type_ids: torch.Tensor | None  # None where the family has no token types
    position_ids: torch.Tensor
    inputs_embeds: torch.Tensor | None  # [T, H] when the caller gave embeddings
    attn: TokenLayout | AttentionMask  # what attention needs
    # "padded": [B, S, H] outputs of padded rows; "packed": [T, H] outputs of packed input (cu_seqlens=); "rows":
    # sequences packed inside rows (transformers' packed forms), [B, S, H] outputs and the pooler at each row's token 0
    output: str
    shape: tuple  # (B, S): the caller's rows (packed input: (n, max_seqlen))
    # [B, S] bool: padded rows of a padding-free model (output_attentions, tracing): finish zeroes the padded
    # positions and pools each row's first real token, so the outputs are those of packed execution
    real_tokens: torch.Tensor | None = None
    adapter_mask: torch.Tensor | None = None  # [n] each sequence's task (Jina's task adapters), range-checked

    @property
    def layout(self) -> TokenLayout | None:
        return self.attn if isinstance(self.attn, TokenLayout) else None

    @property
    def size(self) -> tuple[int, int, bool]:
        """(tokens computed, longest sequence, ragged: sequences of different lengths): what the backend choice of a
        GPU forward depends on."""
        if self.layout is not None:
            return self.layout.num_tokens, self.layout.max_seqlen, not self.layout.uniform
        return self.shape[0] * self.shape[1], self.shape[1], False

    def why_padded(self, output_attentions: bool) -> str | None:
        """Why attention runs on padded rows in a way only the twin serves (None when the kernel can)."""
        if output_attentions:
            return "output_attentions=True needs the probabilities (flash attention never forms them)"
        if not isinstance(self.attn, AttentionMask):  # packed: the kernel serves it
            return None
        if self.attn.custom:
            return "a custom 3-D/4-D attention mask was given (the kernel takes a [B, S] key mask)"
        return None


def prepare(model, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None, inputs_embeds=None,
            output_attentions=False, cu_seqlens=None, max_seqlen=None, adapter_mask=None, **kwargs) -> Batch:
    """Validate and lay out one call of BertModel.forward. Bad input is a ValueError / TypeError naming the argument
    and the value, here, never an IndexError, a device assert or NaN deep inside."""
    tables = Tables.of(model)
    hf_packed = {k: kwargs.pop(k) for k in HF_PACKED_ARGS if kwargs.get(k) is not None} if kwargs else {}
    if kwargs.get("is_causal"):
        raise NotImplementedError("is_causal=True is not supported: fastbert is an encoder (bidirectional attention)")
    for name, value in kwargs.items():
        if name not in DECODER_ONLY_ARGS and name not in HF_PACKED_ARGS and name not in IGNORED_ARGS:
            raise TypeError(f"BertModel.forward() got an unexpected keyword argument {name!r}")
        if value is not None and name in DECODER_ONLY_ARGS:
            raise NotImplementedError(f"{name} is not supported: fastbert is an encoder without cross-attention "
                                      f"or caches")
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds "
                         f"(got {'both' if input_ids is not None else 'neither'})")
    device = tables.weight.device
    first = ("input_ids", input_ids) if input_ids is not None else ("inputs_embeds", inputs_embeds)
    if first[1].device != device:
        raise ValueError(f"{first[0]} is on {first[1].device} but the model is on {device}; "
                         f"move it with .to({str(device)!r})")
    if input_ids is not None and (input_ids.is_floating_point() or input_ids.dtype == torch.bool):
        raise TypeError(f"input_ids must be an integer tensor, got dtype {input_ids.dtype}")
    _check_index_dtype("input_ids", input_ids)
    if inputs_embeds is not None:
        dtype = tables.weight.dtype
        given = inputs_embeds.dtype
        if given != dtype:
            # widening (fp16 / bf16 into fp32) is exact and is HF's own promotion, at its first add; a narrowing
            # cast would round the caller's values, so the caller decides which side to cast
            if not inputs_embeds.is_floating_point():
                raise TypeError(f"inputs_embeds must be a floating tensor ({dtype}, the model's dtype), got {given}")
            if torch.promote_types(given, dtype) != dtype:
                model_cast = f", or cast the model: model.to({given})" if given in MODEL_DTYPES else ""
                raise TypeError(f"inputs_embeds has dtype {given} but the model is {dtype}, which cannot hold every "
                                f"{given} value: pass inputs_embeds.to({dtype}){model_cast}")
            inputs_embeds = inputs_embeds.to(dtype)
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids),
                    ("position_ids", position_ids)):
        if t is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device} but the model is on {device}; move it with .to({str(device)!r})")
        if t is not None and name != "attention_mask" and (t.is_floating_point() or t.dtype == torch.bool):
            hint = "" if name != "token_type_ids" or tables.types is not None else (
                f" ({model.config.model_type} has no token types: pass its other arguments by keyword)")
            raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}{hint}")
        if name == "position_ids" or name == "token_type_ids" and tables.types is not None:
            _check_index_dtype(name, t)
    if tables.types is None:
        token_type_ids = None  # DistilBERT, MPNet: no token types; transformers' forward takes and ignores them too

    if hf_packed or cu_seqlens is not None:
        return _prepare_packed(model, tables, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                               output_attentions, cu_seqlens, max_seqlen, hf_packed, adapter_mask)
    return _prepare_padded(model, tables, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                           output_attentions, adapter_mask)


# --------------------------------------------------------------------------------------------------------------------
# Padded input: [B, S] ids (or [B, S, H] embeddings) with an optional attention_mask
# --------------------------------------------------------------------------------------------------------------------
def _prepare_padded(model, tables: Tables, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                    output_attentions, adapter_mask=None):
    cfg = model.config
    device = tables.weight.device
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        shape, first = tuple(input_ids.shape), ("input_ids", input_ids)
    else:
        width = tables.word.embedding_dim  # hidden_size (ELECTRA: embedding_size)
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != width:
            raise ValueError(f"inputs_embeds must be [batch, seq, {width}], got shape {tuple(inputs_embeds.shape)}")
        shape, first = tuple(inputs_embeds.shape[:2]), ("inputs_embeds", inputs_embeds)
    B, S = shape
    if S == 0:
        raise ValueError(f"{first[0]} has sequence length 0 (shape {tuple(first[1].shape)}); every row needs at "
                         f"least one position")
    if tables.positions is not None and position_ids is None and S > tables.embeddings.max_length:
        raise ValueError(f"sequence length {S} exceeds {_max_length_words(model)}")
    custom = attention_mask is not None and attention_mask.dim() in (3, 4)
    if custom and model.family.embeddings == "masked":
        raise NotImplementedError(f"a {attention_mask.dim()}-D attention_mask is not supported for "
                                  f"{model.family.title}: transformers' DebertaV2Model multiplies its embeddings by "
                                  f"the mask, which only a [batch, seq] key mask fits; pass a 2-D attention_mask")
    # One row for the whole batch, as views: HF's embeddings broadcast [1, S] token types and positions, and
    # transformers 4.x a [1, S] attention_mask too (transformers 5 fails on one with an IndexError)
    if B != 1:
        attention_mask, token_type_ids, position_ids = (
            t.expand(B, S) if t is not None and tuple(t.shape) == (1, S) else t
            for t in (attention_mask, token_type_ids, position_ids))
    _check_like(shape, lambda: f"the input is {list(shape)}",
                attention_mask=None if custom else attention_mask,  # a custom mask: checked by its own shape below
                token_type_ids=token_type_ids, position_ids=position_ids)
    if custom:
        if attention_mask.dim() == 3:
            ok = tuple(attention_mask.shape) == (B, S, S)
        else:
            ok = attention_mask.shape[0] == B and attention_mask.shape[1] in (1, cfg.num_attention_heads) \
                and tuple(attention_mask.shape[2:]) == (S, S)
        if not ok:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; a custom mask must be "
                             f"[{B}, {S}, {S}] or [{B}, 1 or {cfg.num_attention_heads}, {S}, {S}]")

    # Sequences packed inside rows by restarting position ids, where the installed transformers reads them so
    # (DataCollatorWithFlattening's input; fastbert/packing.py)
    packed_rows = attention_mask is None and position_ids is not None \
        and packing.packs_by_position_ids(cfg.model_type)

    # One host read for everything: index ranges (an out-of-range id would be a device assert on CUDA), 0/1 masks,
    # from a 2-D mask the real-token count and each row's length, and where packed rows' sequences start.
    reads = _Reads()
    reads.ranges(tables, input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
    _task_reads(reads, model, adapter_mask, B, inputs_embeds)
    zero_one = attention_mask is not None and attention_mask.dtype != torch.bool \
        and not (attention_mask.dim() == 4 and attention_mask.is_floating_point())
    if zero_one:
        reads.add("mask_not_zero_one", not_zero_one(attention_mask))
    key_mask = attention_mask is not None and attention_mask.dim() == 2
    if key_mask:
        # a 0/1 mask's row sums are its rows' lengths (the 0/1 check is in the same read); their sum, the real
        # tokens, is added up on the host
        reads.add("lengths", attention_mask.sum(dim=1))
        # a row whose real tokens are not one run: packing would change j - i, which a relative bias (MPNet), a
        # sliding window (ModernBERT) and disentangled attention (DeBERTa) read
        if model.family.reads_distances:
            keep = attention_mask != 0
            runs = (keep[:, 1:] & ~keep[:, :-1]).sum(dim=1) + keep[:, 0]
            reads.add("holes", (runs > 1).any())
    if packed_rows:
        reads.add("starts", packing.sequence_starts(position_ids).reshape(-1))
    values = reads.read()
    if values is not None and packed_rows and sum(values["starts"]) == B:
        packed_rows = False  # one sequence a row: nothing to split (transformers keeps its plain mask too)
    if values is not None and key_mask:
        values["real_tokens"] = sum(values["lengths"])
    if values is not None and zero_one and values["mask_not_zero_one"]:
        raise ValueError(f"attention_mask holds values other than 0 and 1 (dtype {attention_mask.dtype}, "
                         f"{attention_mask.dim()}-D); only a floating 4-D mask may be additive (see README, Masks)")

    token_type_ids, position_ids = _fill_defaults(tables, shape, input_ids, token_type_ids, position_ids,
                                                  lambda: torch.arange(S, device=device).expand(B, S))

    # (a relative position bias counts padding inside a row as distance, as HF does: such rows run padded)
    padded_rows = output_attentions or custom or not model.padding_free or tracing() or bool(
        values is not None and values.get("holes", False))
    if packed_rows and not padded_rows:  # every token real: packed order is row order, cut where positions restart
        starts = [i for i, start in enumerate(values["starts"]) if start]
        lengths = [b - a for a, b in zip(starts, starts[1:] + [B * S])]
        cu_seqlens = torch.tensor(starts + [B * S], dtype=torch.int32, device=device)
        if adapter_mask is not None:  # a row's task, for each sequence in it
            adapter_mask = adapter_mask.index_select(0, torch.tensor([a // S for a in starts], device=device))
        return Batch(_flat(input_ids, B * S), _flat(token_type_ids, B * S), position_ids.reshape(B * S),
                     None if inputs_embeds is None else inputs_embeds.reshape(B * S, -1),
                     TokenLayout.from_cu_seqlens(cu_seqlens, max(lengths), lengths), "rows", shape,
                     adapter_mask=adapter_mask)
    if not padded_rows and (not key_mask or values["real_tokens"] == B * S):
        layout = TokenLayout.dense(B, S, device)  # nothing padded: packed order is batch order
    elif not padded_rows:
        layout = TokenLayout.from_mask(attention_mask != 0, values["lengths"], values["real_tokens"])
    else:
        flags = None if values is None or not key_mask else (
            values["real_tokens"] == B * S, min(values["lengths"], default=1) > 0)
        if packed_rows:  # (while tracing, always: transformers' own traced mask applies the rule unconditionally)
            attention_mask = packing.same_sequence_mask(position_ids)
        mask = AttentionMask.build(attention_mask, B, S, tables.weight.dtype, flags)
        if model.family.attention_bias == "disentangled":  # HF DeBERTa's rule, mask_i * mask_j
            mask = dataclasses.replace(mask, pairwise=True)
        real_tokens = mask.key_valid if model.padding_free else None
        return Batch(None if input_ids is None else input_ids.reshape(B * S), _flat(token_type_ids, B * S),
                     position_ids.reshape(B * S), None if inputs_embeds is None else inputs_embeds.reshape(B * S, -1),
                     mask, "padded", shape, real_tokens, adapter_mask)
    return Batch(None if input_ids is None else unpad(input_ids, layout),
                 None if token_type_ids is None else unpad(token_type_ids, layout),
                 unpad(position_ids, layout), None if inputs_embeds is None else unpad(inputs_embeds, layout), layout,
                 "padded", shape, adapter_mask=adapter_mask)


# --------------------------------------------------------------------------------------------------------------------
# Packed input: sequences back to back, cu_seqlens says where each starts
# --------------------------------------------------------------------------------------------------------------------
def _prepare_packed(model, tables: Tables, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                    output_attentions, cu_seqlens, max_seqlen, hf_packed, adapter_mask=None):
    device = tables.weight.device
    if hf_packed:  # transformers' form: [1, T] ids, cu_seq_lens_q / max_length_q, position_ids restarting per sequence
        if cu_seqlens is not None:
            raise ValueError("give cu_seqlens or HF's cu_seq_lens_q, not both")
        cu_seqlens, max_seqlen = hf_packed.get("cu_seq_lens_q"), hf_packed.get("max_length_q")
        if cu_seqlens is None:
            raise ValueError(f"packed input needs cu_seq_lens_q (got only {', '.join(sorted(hf_packed))})")
        k = hf_packed.get("cu_seq_lens_k")
        if k is not None and (k.shape != cu_seqlens.shape or k is not cu_seqlens and not torch.equal(k, cu_seqlens)):
            raise NotImplementedError("cu_seq_lens_k differs from cu_seq_lens_q: fastbert is an encoder, every "
                                      "sequence attends to itself")
        first = input_ids if input_ids is not None else inputs_embeds
        if first.dim() < 2 or first.shape[0] != 1:
            raise ValueError(f"with cu_seq_lens_q, {'input_ids' if input_ids is not None else 'inputs_embeds'} must "
                             f"be [1, total_tokens, ...] (sequences packed in one row), got {tuple(first.shape)}")
        input_ids = None if input_ids is None else input_ids[0]
        inputs_embeds = None if inputs_embeds is None else inputs_embeds[0]
        token_type_ids = None if token_type_ids is None else token_type_ids.reshape(-1)
        position_ids = None if position_ids is None else position_ids.reshape(-1)
        output = "rows"
    else:
        output = "packed"
    if attention_mask is not None:
        raise ValueError("packed input takes no attention_mask: cu_seqlens says where each sequence starts and ends")
    if output_attentions:
        raise NotImplementedError("output_attentions needs padded rows ([B, nh, S, S] probabilities); call the model "
                                  "with padded input_ids and an attention_mask for it")
    if tracing():
        raise NotImplementedError("packed input (cu_seqlens) cannot be traced: its layout is read from the device; "
                                  "trace the padded call (input_ids [B, S] + attention_mask) instead")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() \
            or cu_seqlens.dtype == torch.bool or cu_seqlens.shape[0] < 2:
        raise TypeError(f"cu_seqlens must be a 1-D integer tensor of n + 1 offsets (n >= 1 sequences), got "
                        f"{getattr(cu_seqlens, 'dtype', type(cu_seqlens).__name__)} "
                        f"{tuple(getattr(cu_seqlens, 'shape', ()))}")
    if cu_seqlens.device != device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but the model is on {device}")
    if input_ids is not None and input_ids.dim() != 1:
        raise ValueError(f"with cu_seqlens, input_ids must be 1-D [total_tokens], got shape {tuple(input_ids.shape)}")
    width = tables.word.embedding_dim
    if inputs_embeds is not None and (inputs_embeds.dim() != 2 or inputs_embeds.shape[1] != width):
        raise ValueError(f"with cu_seqlens, inputs_embeds must be [total_tokens, {width}], got shape "
                         f"{tuple(inputs_embeds.shape)}")
    T = (input_ids if input_ids is not None else inputs_embeds).shape[0]
    _check_like((T,), lambda: f"the packed input has {T} tokens", token_type_ids=token_type_ids,
                position_ids=position_ids)

    reads = _Reads()
    reads.ranges(tables, input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids)
    _task_reads(reads, model, adapter_mask, cu_seqlens.shape[0] - 1, inputs_embeds)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    reads.add("cu_first", cu_seqlens[0])
    reads.add("cu_last", cu_seqlens[-1])
    reads.add("lengths", lengths)
    values = reads.read()
    if values["cu_first"] != 0 or values["cu_last"] != T or min(values["lengths"]) < 0:
        raise ValueError(f"cu_seqlens must rise from 0 to the number of tokens ({T}) without going down; got "
                         f"first {values['cu_first']}, last {values['cu_last']}, smallest step "
                         f"{min(values['lengths'])}")
    longest = max(values["lengths"])
    if max_seqlen is None:
        max_seqlen = longest
    elif isinstance(max_seqlen, torch.Tensor):
        max_seqlen = int(max_seqlen)
    if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < longest:
        raise ValueError(f"max_seqlen={max_seqlen!r} must be an int >= the longest sequence ({longest} tokens)")
    if position_ids is None and tables.positions is not None \
            and longest > tables.embeddings.max_length:  # rotary positions have no table to run out of
        raise ValueError(f"a sequence of {longest} tokens exceeds {_max_length_words(model)}")

    def index_in_sequence():  # token index minus its sequence's start
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long(), output_size=T)
        return torch.arange(T, device=device) - starts

    token_type_ids, position_ids = _fill_defaults(tables, (T,), input_ids, token_type_ids, position_ids,
                                                  index_in_sequence)
    layout = TokenLayout.from_cu_seqlens(cu_seqlens, max_seqlen, values["lengths"])
    return Batch(input_ids, token_type_ids, position_ids, inputs_embeds, layout, output,
                 (1, T) if output == "rows" else (layout.num_seqs, max_seqlen), adapter_mask=adapter_mask)


# --------------------------------------------------------------------------------------------------------------------
# What both layouts share
# --------------------------------------------------------------------------------------------------------------------
def _flat(t, n: int):
    return None if t is None else t.reshape(n)


def _check_index_dtype(name: str, t) -> None:
    """Indices into an embedding table are int64 or int32, as torch's lookup takes them: HF fails on narrower ones
    deep inside the embeddings, fastbert says so here."""
    if t is not None and t.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} has dtype {t.dtype}; embedding indices must be torch.int64 (or torch.int32), as "
                        f"transformers' models take them: pass {name}.long()")


def _check_like(shape: tuple, described, **tensors) -> None:
    """Each given tensor has the input's token shape (`described()` says what the input is, for the message: built
    only for one, since every forward runs this check)."""
    for name, t in tensors.items():
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but {described()}")


def _fill_defaults(tables: Tables, shape: tuple, input_ids, token_type_ids, position_ids, index_in_sequence):
    """HF's defaults: token type 0, and positions from each token's index in its sequence (`index_in_sequence()`,
    asked only when needed); the embeddings turn indices into positions (RoBERTa counts from padding_idx)."""
    if token_type_ids is None and tables.types is not None:
        token_type_ids = torch.zeros(shape, dtype=torch.long, device=tables.weight.device)
    if position_ids is None:
        position_ids = tables.embeddings.position_ids(input_ids, index_in_sequence())
    return token_type_ids, position_ids


def _task_reads(reads, model, adapter_mask, num_seqs: int, inputs_embeds) -> None:
    """Jina's adapter_mask (one task index per sequence) checked, its range read with the rest."""
    if adapter_mask is not None:
        check_adapter_mask(model, adapter_mask, num_seqs, inputs_embeds)
        reads.bounded("adapter_mask", adapter_mask, NO_TASK, len(model.task_names))


def _max_length_words(model) -> str:
    cfg, limit = model.config, model.embeddings.max_length
    if limit == cfg.max_position_embeddings:
        return f"max_position_embeddings={limit}"
    return (f"the longest sequence this model's positions cover, {limit} (max_position_embeddings="
            f"{cfg.max_position_embeddings} - pad_token_id {cfg.pad_token_id} - 1)")


class _Reads:
    """Device values a forward needs on the host, read back together in one sync (none while tracing: then the range
    checks become asynchronous asserts)."""

    def __init__(self):
        self.tensors, self.checks = {}, []  # name -> tensor; (name, low, limit) of each range check
        self.tracing = tracing()

    def add(self, name: str, tensor: torch.Tensor):
        self.tensors[name] = tensor

    def ranges(self, tables: Tables, **tensors):
        """Index ranges by the tables' sizes (a resized vocabulary included)."""
        limits = {"input_ids": tables.word.num_embeddings,
                  "token_type_ids": None if tables.types is None else tables.types.num_embeddings,
                  "position_ids": None if tables.positions is None else tables.positions.num_embeddings}
        for name, t in tensors.items():
            if t is not None and limits[name] is not None:
                self.bounded(name, t, 0, limits[name])

    def bounded(self, name: str, t: torch.Tensor, low: int, limit: int):
        """Values of t in [low, limit)."""
        if t.numel():
            # (aminmax's full reduction has no ONNX translation: a trace takes two reductions)
            least, most = (t.min(), t.max()) if self.tracing else torch.aminmax(t)
            self.add(name + " min", least)
            self.add(name + " max", most)
            self.checks.append((name, low, limit))

    def read(self) -> dict | None:
        if self.tracing:
            for name, least, limit in self.checks:
                low, high = self.tensors[name + " min"], self.tensors[name + " max"]
                torch._assert_async((low >= least) & (high < limit), f"{name} out of range")
            return None
        flat = torch.cat([t.reshape(-1).long() for t in self.tensors.values()]).tolist() if self.tensors else []
        values, at = {}, 0
        for name, t in self.tensors.items():
            size = t.numel()
            values[name] = flat[at:at + size] if t.dim() else flat[at]
            at += size
        for name, least, limit in self.checks:
            low, high = values[name + " min"], values[name + " max"]
            if low < least or high >= limit:
                raise ValueError(f"{name} contains {low if low < least else high}, outside [{least}, {limit})"
                                 f"{_RANGE_WORDS.get(name, '')}")
        return values
