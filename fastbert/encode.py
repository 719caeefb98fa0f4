"""Sentence embeddings as sentence-transformers computes them, in batches formed by a token budget.

    fastbert.encode("path/to/model", texts)              -> np.ndarray [len(texts), dim], float32, in input order
    encoder = fastbert.SentenceEncoder.from_pretrained("path/to/model", dtype="bfloat16", device="cuda")
    encoder.encode(texts, prompt_name="query")

What a sentence-transformers folder says, and what fastbert does with it:
    modules.json                        Transformer -> Pooling -> Dense (any number) -> optional Normalize. Those
                                        modules are reproduced exactly; any other (LayerNorm, Router, ...) is
                                        refused, never skipped: skipping it would return a different vector
                                        without a word.
    N_Dense/config.json, weights        in_features, out_features, bias, activation_function (Identity or Tanh),
                                        its linear's weight (and bias): applied to the pooled vector in float32
    sentence_bert_config.json           max_seq_length (texts are truncated to it, special tokens included),
                                        do_lower_case (a Lowercase normaliser in front of the tokenizer's own)
    1_Pooling/config.json               pooling mode(s): cls, max, mean, mean_sqrt_len_tokens, weightedmean, lasttoken
                                        (several modes are concatenated in the order given); include_prompt
    config_sentence_transformers.json   prompts and default_prompt_name
Every setting can be overridden by an argument of the same name. A plain Hugging Face folder (no modules.json) gets
what sentence-transformers gives such a folder: mean pooling, no Normalize, max_seq_length = the smaller of the
tokenizer's model_max_length and max_position_embeddings; fastbert says so in a one-line warning.

The work: texts are tokenized a window at a time, sorted by length (longest first), and cut into batches of at most
`max_tokens_per_batch` tokens; each batch runs through the model, is pooled in fp32, and lands in its texts' rows.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import adapters, formats, quality
from .graphs import graphed, stats_of
from .loading import resolve_folder
from .modeling import BertModel

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' older Pooling configs: one flag per mode; several set flags concatenate in this order.
_LEGACY_POOLING_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                         "pooling_mode_mean_tokens": "mean",
                         "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# The prompts every SentenceTransformer knows, empty unless the folder fills them.
_DEFAULT_PROMPTS = {"query": "", "document": ""}
# sentence_bert_config.json keys that change the vectors in ways fastbert does not reproduce when not at their
# defaults (multi-modal inputs, a different output of the model, chat templates, per-call processor options).
_TRANSFORMER_DEFAULTS = {"transformer_task": "feature-extraction",
                         "modality_config": {"text": {"method": "forward", "method_output_name": "last_hidden_state"}},
                         "module_output_name": "token_embeddings", "processing_kwargs": {}}

# The Transformer module's settings file, under the names sentence-transformers has written it over the years.
_TRANSFORMER_CONFIG_FILES = ("sentence_bert_config.json", "sentence_roberta_config.json",
                             "sentence_distilbert_config.json", "sentence_camembert_config.json",
                             "sentence_albert_config.json", "sentence_xlm-roberta_config.json",
                             "sentence_xlnet_config.json")

DEFAULT_MAX_TOKENS_PER_BATCH = 16384  # a GPU's forward
# A CPU's: a [4,096, 1,536] fp32 activation (25 MB) stays under glibc's 32 MB mmap threshold, so its buffers are
# reused from layer to layer, and near the caches; a [16,384, 1,536] one is mapped fresh and page-faults in, in
# every layer. Measured on a 2-core Xeon with AMX, the bundled MiniLM, 1,500 real texts (bench/RESULTS.md): fp32
# 166 / bf16 339 / int8 261 texts/s at 4,096 tokens a forward, 144 / 311 / 213 at 16,384; 2,048 within 2% of 4,096.
CPU_MAX_TOKENS_PER_BATCH = 4096


def default_max_tokens_per_batch(device) -> int:
    """The token budget of one forward when the caller gives none: CPU_MAX_TOKENS_PER_BATCH on a CPU, else
    DEFAULT_MAX_TOKENS_PER_BATCH."""
    return CPU_MAX_TOKENS_PER_BATCH if torch.device(device).type == "cpu" else DEFAULT_MAX_TOKENS_PER_BATCH


def forward_budget(device, budget: int) -> int:
    """The tokens one forward of a `budget`-token batch takes: all of them, but on a CPU at most
    CPU_MAX_TOKENS_PER_BATCH (the server's batches: a GPU runs its batch as one forward)."""
    return min(budget, CPU_MAX_TOKENS_PER_BATCH) if torch.device(device).type == "cpu" else budget


WINDOW = 32768  # texts tokenized and sorted together: bounds host memory on a large corpus, sorts well enough


# --------------------------------------------------------------------------------------------------------------------
# What the folder says
# --------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Pipeline:
    """How token vectors become one vector per text. `source` says where the settings came from."""

    pooling: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    normalize: bool = False
    max_seq_length: int | None = None       # None: the tokenizer's model_max_length capped at max_position_embeddings
    do_lower_case: bool = False
    prompts: dict = field(default_factory=lambda: dict(_DEFAULT_PROMPTS))
    default_prompt_name: str | None = None
    source: str = "defaults"                # "sentence-transformers" or "defaults"
    dense: tuple = ()                       # Dense modules after pooling, in order (DenseLayer)

    def describe(self) -> str:
        dense = "".join(f", Dense {d.weight.shape[1]}->{d.weight.shape[0]}" for d in self.dense)
        return (f"pooling {'+'.join(self.pooling)}{dense}, {'Normalize' if self.normalize else 'no Normalize'}, "
                f"max_seq_length {self.max_seq_length}")

    def after_pooling(self, vectors: torch.Tensor) -> torch.Tensor:
        """The Dense modules on pooled vectors [n, D] (float32): each act(v @ W^T + b), as sentence-transformers'
        Dense computes it; the vectors themselves without any."""
        for layer in self.dense:
            vectors = layer(vectors)
        return vectors


@dataclass(frozen=True)
class DenseLayer:
    """sentence-transformers' Dense module: activation(x @ weight^T + bias). `activation`: "identity" or "tanh"."""

    weight: torch.Tensor                    # [out_features, in_features]
    bias: torch.Tensor | None
    activation: str = "identity"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.device, x.dtype)
        h = F.linear(x, weight, None if self.bias is None else self.bias.to(x.device, x.dtype))
        return torch.tanh(h) if self.activation == "tanh" else h

    def to(self, device) -> "DenseLayer":
        return DenseLayer(self.weight.to(device), None if self.bias is None else self.bias.to(device),
                          self.activation)


# sentence-transformers' Dense activation_function -> what DenseLayer runs
_DENSE_ACTIVATIONS = {"torch.nn.modules.linear.Identity": "identity", "torch.nn.modules.activation.Tanh": "tanh"}


def locate(name_or_path):
    """A sentence-transformers folder (modules.json; it may keep the checkpoint in a sub-folder, modules.json's
    Transformer path), a plain Hugging Face folder, or a Hub id in the local cache -> read_folder's (model folder,
    sentence-transformers pipeline or None, tokenizer kwargs, dtype). Reads no weights."""
    path = os.fspath(name_or_path)
    is_st_folder = os.path.isdir(path) and os.path.isfile(os.path.join(path, "modules.json"))
    return read_folder(path if is_st_folder else resolve_folder(path, weights=False))


def resolve_prompt(pipeline: Pipeline, prompt: str | None, prompt_name: str | None) -> str:
    """sentence-transformers' rule: `prompt` as given, else the named prompt, else the default prompt name's."""
    if prompt is not None and prompt_name is not None:
        raise ValueError("give either prompt or prompt_name, not both")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        return prompt
    name = prompt_name if prompt_name is not None else pipeline.default_prompt_name
    if name is None:
        return ""
    if name not in pipeline.prompts:
        raise ValueError(f"prompt_name {name!r} is not one of this model's prompts "
                         f"({', '.join(map(repr, pipeline.prompts))})")
    return pipeline.prompts[name]


def check_counts(**values) -> None:
    """Each value None or a positive integer, else a ValueError naming it."""
    for name, value in values.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _read_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}); {what}") from None


# Transformer modules of a model's own code that tokenize and run the model as sentence-transformers' Transformer does:
# jina-embeddings-v3's (its `task` argument is encode's task=)
_CUSTOM_TRANSFORMERS = ("custom_st.Transformer",)


def _module_kind(entry, index: int, path: str) -> str:
    """'Transformer', 'Pooling', 'Normalize' or the type's own name, from a modules.json entry."""
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise ValueError(f"{path}: entry {index} has no \"type\" string (got {entry!r})")
    if entry["type"] in _CUSTOM_TRANSFORMERS:
        return "Transformer"
    return entry["type"].rsplit(".", 1)[-1] if entry["type"].startswith("sentence_transformers.") else entry["type"]


def parse_pooling(config: dict, path: str) -> tuple[tuple[str, ...], bool, int | None]:
    """(modes, include_prompt, embedding dimension) from a Pooling config, old (one flag per mode) or new style."""
    if "pooling_mode" in config:
        modes = config["pooling_mode"]
        modes = (modes,) if isinstance(modes, str) else tuple(modes)
    else:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_FLAGS.items() if config.get(key)) or ("mean",)
    return (check_pooling(modes, where=path), bool(config.get("include_prompt", True)),
            config.get("embedding_dimension", config.get("word_embedding_dimension")))


def check_pooling(modes, where: str = "pooling") -> tuple[str, ...]:
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    bad = [m for m in modes if m not in POOLING_MODES]
    if not modes or bad:
        raise ValueError(f"{where}: pooling mode {', '.join(map(repr, bad)) or '(none)'} is not one of "
                         f"{', '.join(POOLING_MODES)}")
    return modes


def read_folder(folder: str):
    """(the folder holding the BERT checkpoint and tokenizer, Pipeline, tokenizer kwargs, default dtype) from a
    sentence-transformers folder; for a folder without modules.json, (folder, None, {}, None). One reader per
    module that modules.json lists, each refusing what fastbert does not reproduce."""
    modules = _read_modules(folder)
    if modules is None:
        return folder, None, {}, None
    module_folders = [os.path.join(folder, m.get("path") or "") for m in modules]
    st_config, tokenizer_kwargs, dtype = _read_transformer(module_folders[0])
    modes, include_prompt, dimension = _read_pooling(module_folders[1])
    kinds = [_module_kind(m, i, "modules.json") for i, m in enumerate(modules)]
    dense = tuple(_read_dense(f) for f, kind in zip(module_folders, kinds) if kind == "Dense")
    normalize = kinds[-1] == "Normalize"
    if normalize:
        _check_normalize(module_folders[-1])
    prompts, default_prompt_name = _read_prompts(folder)
    pipeline = Pipeline(pooling=modes, include_prompt=include_prompt, normalize=normalize,
                        max_seq_length=st_config.get("max_seq_length"),
                        do_lower_case=bool(st_config.get("do_lower_case", False)),
                        prompts=prompts, default_prompt_name=default_prompt_name, source="sentence-transformers",
                        dense=dense)
    return module_folders[0], (pipeline, dimension), tokenizer_kwargs, dtype


def _read_modules(folder: str) -> list | None:
    """modules.json: Transformer -> Pooling -> Dense (any number) -> optional Normalize, else NotImplementedError
    naming the modules (None when the folder has no modules.json)."""
    modules_path = os.path.join(folder, "modules.json")
    if not os.path.isfile(modules_path):
        return None
    modules = _read_json(modules_path, "modules.json lists the modules of a sentence-transformers model")
    if not isinstance(modules, list) or not modules:
        raise ValueError(f"{modules_path}: expected a non-empty list of modules, got {type(modules).__name__}")
    kinds = [_module_kind(m, i, modules_path) for i, m in enumerate(modules)]
    middle = kinds[2:-1] if kinds[-1] == "Normalize" else kinds[2:]
    if kinds[:2] != ["Transformer", "Pooling"] or any(k != "Dense" for k in middle):
        other = [f"{i}: {m['type']}" for i, (m, k) in enumerate(zip(modules, kinds))
                 if k not in ("Transformer", "Pooling", "Dense", "Normalize")]
        raise NotImplementedError(
            f"{modules_path}: fastbert reproduces Transformer -> Pooling -> Dense ... -> optional Normalize, this "
            f"model has "
            f"{' -> '.join(kinds)}" + (f" ({'; '.join(other)} not implemented)" if other else "")
            + "; its embeddings would differ from sentence-transformers', so it is refused")
    return modules


def _read_transformer(model_folder: str) -> tuple[dict, dict, object]:
    """The Transformer module's sentence_bert_config.json (or its older names): (its settings, tokenizer kwargs,
    the model's default dtype or None)."""
    st_config, st_config_path = {}, None
    for name in _TRANSFORMER_CONFIG_FILES:  # the first one present, as sentence-transformers reads them
        path = os.path.join(model_folder, name)
        if os.path.isfile(path):
            st_config, st_config_path = _read_json(path, "the Transformer module's settings"), path
            break
    for key, default in _TRANSFORMER_DEFAULTS.items():
        if key in st_config and st_config[key] not in (default, None):
            raise NotImplementedError(f"{st_config_path}: {key} = {st_config[key]!r} is not implemented (fastbert "
                                      f"reproduces {default!r})")
    tokenizer_kwargs = {k: v for k, v in {**st_config.get("tokenizer_args", {}),
                                          **st_config.get("processor_kwargs", {})}.items()
                        if k != "trust_remote_code"}  # as sentence-transformers: a config may not enable remote code
    model_kwargs = {**st_config.get("model_args", {}), **st_config.get("model_kwargs", {})}
    return st_config, tokenizer_kwargs, model_kwargs.get("dtype", model_kwargs.get("torch_dtype"))


def _read_pooling(module_folder: str):
    """The Pooling module's config.json: (modes, include_prompt, dimension)."""
    pooling_path = os.path.join(module_folder, "config.json")
    if not os.path.isfile(pooling_path):
        raise FileNotFoundError(f"no Pooling config: {pooling_path} is missing (modules.json names it)")
    return parse_pooling(_read_json(pooling_path, "the Pooling module's settings"), pooling_path)


def _read_dense(module_folder: str) -> DenseLayer:
    """A Dense module's config.json and its linear's weights (model.safetensors, or pytorch_model.bin)."""
    path = os.path.join(module_folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no Dense config: {path} is missing (modules.json names it)")
    config = _read_json(path, "the Dense module's settings")
    activation = config.get("activation_function", "torch.nn.modules.activation.Tanh")  # Dense's default
    if activation not in _DENSE_ACTIVATIONS:
        raise NotImplementedError(f"{path}: Dense with activation_function = {activation!r} is not implemented "
                                  f"(fastbert reproduces {', '.join(_DENSE_ACTIVATIONS)})")
    weights = os.path.join(module_folder, "model.safetensors")
    if os.path.isfile(weights):
        from safetensors.torch import load_file
        state = load_file(weights)
    elif os.path.isfile(os.path.join(module_folder, "pytorch_model.bin")):
        state = torch.load(os.path.join(module_folder, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{module_folder}: the Dense module's weights (model.safetensors or "
                                f"pytorch_model.bin) are missing")
    weight, bias = state.get("linear.weight"), state.get("linear.bias")
    shape = (config.get("out_features"), config.get("in_features"))
    if weight is None or tuple(weight.shape) != shape:
        raise ValueError(f"{module_folder}: the Dense weight 'linear.weight' must have shape {shape} (out_features, "
                         f"in_features), got {None if weight is None else tuple(weight.shape)}")
    if bool(config.get("bias", True)) != (bias is not None):
        raise ValueError(f"{module_folder}: bias = {config.get('bias', True)} in config.json, but the weights "
                         f"{'lack' if bias is None else 'hold'} 'linear.bias'")
    return DenseLayer(weight.float(), None if bias is None else bias.float(), _DENSE_ACTIVATIONS[activation])


def _check_normalize(module_folder: str) -> None:
    """The Normalize module: its config is optional; only the default feature names are reproduced."""
    path = os.path.join(module_folder, "config.json")
    config = _read_json(path, "the Normalize module's settings") if os.path.isfile(path) else {}
    for key in ("module_input_name", "module_output_name"):
        if config.get(key, "sentence_embedding") != "sentence_embedding":
            raise NotImplementedError(f"{path}: Normalize with {key} = {config[key]!r} is not implemented "
                                      f"(fastbert normalises the sentence embedding)")


def _read_prompts(folder: str) -> tuple[dict, str | None]:
    """config_sentence_transformers.json, in the model's root folder: (prompts, default prompt name)."""
    prompts, default_prompt_name = dict(_DEFAULT_PROMPTS), None
    path = os.path.join(folder, "config_sentence_transformers.json")
    if os.path.isfile(path):
        config = _read_json(path, "the model's prompts and type")
        if config.get("model_type", "SentenceTransformer") != "SentenceTransformer":
            raise NotImplementedError(f"{path}: model_type {config['model_type']!r} is not implemented (fastbert "
                                      f"computes SentenceTransformer embeddings)")
        prompts.update({k: v for k, v in (config.get("prompts") or {}).items() if v is not None})
        default_prompt_name = config.get("default_prompt_name")
    return prompts, default_prompt_name


# --------------------------------------------------------------------------------------------------------------------
# Pooling: sentence-transformers' formulas on a padded batch, in fp32
# --------------------------------------------------------------------------------------------------------------------
def pool(hidden: torch.Tensor, mask: torch.Tensor, modes: Sequence[str]) -> torch.Tensor:
    """[B, S, H] token vectors, [B, S] 0/1 mask of the tokens to pool (padding and excluded prompt tokens are 0),
    right-padded -> [B, len(modes) * H] float32, the modes concatenated in order. Rows whose mask is all 0 (only when
    a prompt is excluded and covers the whole truncated text) get what sentence-transformers gives them."""
    h = hidden.float()
    keep = mask.bool()
    m = keep.unsqueeze(-1).float()                                                   # [B, S, 1]
    B, S, _ = h.shape
    rows = torch.arange(B, device=h.device)
    out = []
    for mode in modes:
        if mode == "cls":  # the first pooled token (the [CLS] token unless a prompt is excluded)
            out.append(h[rows, keep.int().argmax(dim=1)])
        elif mode == "max":
            out.append(h.masked_fill(~keep.unsqueeze(-1), float("-inf")).max(dim=1).values)
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            count = m.sum(dim=1).clamp(min=1e-9)                                     # [B, 1]
            out.append((h * m).sum(dim=1) / (count if mode == "mean" else count.sqrt()))
        elif mode == "weightedmean":  # token i (from 1) weighs i: later tokens count more (SGPT)
            w = m * torch.arange(1, S + 1, device=h.device, dtype=h.dtype).view(1, S, 1)
            out.append((h * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9))
        elif mode == "lasttoken":  # the last pooled token ([SEP] for BERT)
            found, from_end = keep.int().flip(1).max(dim=1)
            last = torch.where(found == 0, S - 1, S - 1 - from_end)
            out.append((h * m)[rows, last])
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return torch.cat(out, dim=-1)


def pool_packed(hidden: torch.Tensor, lengths: torch.Tensor, skips: torch.Tensor,
                modes: Sequence[str]) -> torch.Tensor:
    """pool() on packed token vectors: [T, H] (sequences back to back, `lengths` [n] long each), the first skips[i]
    tokens of sequence i left out (an excluded prompt) -> [n, len(modes) * H] float32, what pool() gives the same
    texts right-padded, without a padded tensor. Each sum runs over its own sequence's tokens in order
    (torch.segment_reduce), so a text's vector does not depend on the texts packed beside it."""
    h = hidden.float()
    n, device = lengths.shape[0], h.device
    starts = torch.cumsum(lengths, 0) - lengths                                       # [n]
    seq = torch.repeat_interleave(torch.arange(n, device=device), lengths)           # [T] each token's text
    pos = torch.arange(h.shape[0], device=device) - starts[seq]                      # [T] its position in its text
    keep = pos >= skips[seq]                                                         # [T]
    m = keep.unsqueeze(-1).float()                                                   # [T, 1]
    count = torch.clamp(lengths - skips, min=0).float().unsqueeze(-1)               # [n, 1] pooled tokens

    def per_text(values, how="sum"):
        return torch.segment_reduce(values, how, lengths=lengths, axis=0, unsafe=True)

    some = skips < lengths                                                           # texts with a pooled token
    out = []
    for mode in modes:
        if mode == "cls":  # the first pooled token; pool()'s argmax of an all-0 row is position 0
            out.append(h[starts + torch.where(some, skips, 0)])
        elif mode == "max":
            out.append(per_text(h.masked_fill(~keep.unsqueeze(-1), float("-inf")), "max"))
        elif mode in ("mean", "mean_sqrt_len_tokens"):
            total = count.clamp(min=1e-9)
            out.append(per_text(h * m) / (total if mode == "mean" else total.sqrt()))
        elif mode == "weightedmean":  # token i of its text (from 1) weighs i, as in pool()
            w = m * (pos + 1).to(h.dtype).unsqueeze(-1)
            out.append(per_text(h * w) / per_text(w).clamp(min=1e-9))
        elif mode == "lasttoken":  # the last pooled token (the text's last); none pooled: zeros, as pool() gives
            out.append(h[starts + lengths - 1] * some.unsqueeze(-1))
        else:
            raise ValueError(f"pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}")
    return torch.cat(out, dim=-1)


# --------------------------------------------------------------------------------------------------------------------
# Tokens to batches
# --------------------------------------------------------------------------------------------------------------------
def plan_batches(lengths: Sequence[int], max_tokens: int, max_texts: int | None = None,
                 count_padding: bool = True) -> list[list[int]]:
    """Indices into `lengths`, sorted longest first (ties in input order), cut into batches of at most `max_tokens`
    tokens and `max_texts` texts. count_padding: a batch costs (texts x its longest text), the tokens a padded forward
    computes; otherwise the sum of its lengths, the tokens a packed forward computes. A text longer than the budget
    is a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, current, cost = [], [], 0
    for i in order:
        n = lengths[i]
        new_cost = (len(current) + 1) * lengths[current[0]] if count_padding and current else cost + n
        if current and (new_cost > max_tokens or (max_texts is not None and len(current) >= max_texts)):
            batches.append(current)
            current, new_cost = [], n
        current.append(i)
        cost = new_cost
    if current:
        batches.append(current)
    return batches


def padded(ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input_ids and attention_mask [n, longest], int64, on the CPU."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    keep = np.arange(lengths.max()) < lengths[:, None]
    input_ids = np.full(keep.shape, pad_id, dtype=np.int64)
    input_ids[keep] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    return torch.from_numpy(input_ids), torch.from_numpy(keep.astype(np.int64))


def embed(model, pipeline: Pipeline, input_ids: torch.Tensor, attention_mask: torch.Tensor,
          skip: int = 0, adapter_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The one place the model runs: a right-padded batch [B, S] in, one vector per text out, pooled and normalised
    as `pipeline` says (encode's loop and the ONNX graph both run this; `model` is the model or a Graphed call of
    it). Padded positions are masked out by pooling, whatever they hold; a padding-free model (the default) gathers
    the real tokens inside and computes nothing else, so the padded call costs only the gather and the scatter back.
    skip: the prompt's tokens at the start of every text, left out of the pooling (include_prompt=False).
    adapter_mask: each text's task adapter (Jina-Embeddings-v3: SentenceEncoder.adapter_mask), or None."""
    tasks = {} if adapter_mask is None else {"adapter_mask": adapter_mask}
    hidden = model(input_ids=input_ids, attention_mask=attention_mask, **tasks).last_hidden_state
    if skip:
        attention_mask = attention_mask.clone()
        attention_mask[:, :skip] = 0
    vectors = pipeline.after_pooling(pool(hidden, attention_mask, pipeline.pooling))
    return F.normalize(vectors, p=2, dim=-1) if pipeline.normalize else vectors


# --------------------------------------------------------------------------------------------------------------------
# The encoder
# --------------------------------------------------------------------------------------------------------------------
_LOAD_OPTIONS = ("pooling", "normalize", "max_seq_length", "do_lower_case", "include_prompt", "dtype", "device",
                 "kernels", "cuda_graphs", "tokenizer", "quantize", "quality_texts")


def check_truncate_dim(value) -> int | None:
    """sentence-transformers' truncate_dim (Matryoshka models: the first `value` dimensions of each vector, cut after
    the pipeline, Normalize included): None, or an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"truncate_dim must be None or an integer >= 1, got {value!r}")
    return value


class SentenceEncoder:
    """A fastbert model, its tokenizer and the pipeline that turns token vectors into one vector per text.
    Build it once with `from_pretrained` (or from a model and a tokenizer) and call `encode` as often as needed.
    cuda_graphs: on CUDA the model replays CUDA graphs over token buckets (fastbert/graphs.py, Graphed; the model
    itself is not changed); False runs it eagerly. `graph_stats` says what ran. task: the task adapter every call
    runs with unless it names its own (Jina-Embeddings-v3; None: the model as loaded)."""

    def __init__(self, model: BertModel, tokenizer, *, pooling=None, normalize=None, max_seq_length=None,
                 do_lower_case=None, include_prompt=None, pipeline: Pipeline | None = None, name: str = "the model",
                 cuda_graphs: bool = True, truncate_dim: int | None = None, task: str | None = None):
        if not isinstance(model, BertModel):
            raise TypeError(f"model must be a fastbert.BertModel, got {type(model).__name__} (load a folder with "
                            f"SentenceEncoder.from_pretrained, or convert a transformers model with "
                            f"fastbert.BertModel.from_hf)")
        if tokenizer is None:
            raise TypeError("a fastbert.BertModel needs its tokenizer: pass "
                            "tokenizer=AutoTokenizer.from_pretrained(...)")
        self.model, self.tokenizer = model.eval(), tokenizer  # eval: no dropout (SentenceTransformer.encode does too)
        self.truncate_dim = check_truncate_dim(truncate_dim)  # every call's, unless the call gives its own
        self.task = task
        if task is not None:
            adapters.task_index(model, task)  # a ValueError now, naming the model's tasks
        base = pipeline or Pipeline()
        defaulted = [option for option, given in (("pooling", pooling), ("normalize", normalize),
                                                  ("max_seq_length", max_seq_length)) if given is None]
        overrides = {k: v for k, v in dict(pooling=None if pooling is None else check_pooling(pooling),
                                           normalize=normalize, max_seq_length=max_seq_length,
                                           do_lower_case=do_lower_case, include_prompt=include_prompt).items()
                     if v is not None}
        self.pipeline = replace(base, **overrides)
        self.pipeline = replace(self.pipeline, max_seq_length=self._check_max_seq_length())
        if self.pipeline.dense:  # the Dense weights where the pooled vectors are: the model's device
            self.pipeline = replace(self.pipeline, dense=tuple(d.to(self.device) for d in self.pipeline.dense))
        default = self.pipeline.default_prompt_name
        if default is not None and default not in self.pipeline.prompts:
            raise ValueError(f"default_prompt_name {default!r} is not one of the prompts "
                             f"({', '.join(self.pipeline.prompts)})")
        if self.pipeline.do_lower_case:  # on a copy: the caller's tokenizer stays as it was
            self.tokenizer = copy.deepcopy(tokenizer)
            _lowercase_first(self.tokenizer)
        if base.source == "defaults" and defaulted:
            warnings.warn(f"fastbert: {name} has no sentence-transformers configuration (modules.json); using "
                          f"sentence-transformers' defaults for a plain model: {self.pipeline.describe()} "
                          f"(the options {', '.join(defaulted)} choose otherwise)", stacklevel=3)
        self._prompt_lengths: dict[str, int] = {}
        self._forward = graphed(self.model, cuda_graphs, max_seqlen=self.pipeline.max_seq_length)

    @property
    def graph_stats(self):
        """The GraphStats of this encoder's CUDA graphs (captures, pool bytes, replays, eager calls and why); None
        with cuda_graphs=False."""
        return stats_of(self._forward)

    @classmethod
    def from_pretrained(cls, name_or_path, *, pooling=None, normalize=None, max_seq_length=None, do_lower_case=None,
                        include_prompt=None, dtype=None, device=None, kernels="auto",
                        cuda_graphs: bool = True, truncate_dim: int | None = None,
                        task: str | None = None, quantize=None, quality_texts=None) -> "SentenceEncoder":
        """A sentence-transformers folder (modules.json) or a plain Hugging Face BERT folder, or a Hub id in the
        local cache. dtype: None = what the folder says (sentence_bert_config's model_kwargs, else the checkpoint's
        own, like transformers' dtype="auto"); device: None = cuda when available, else cpu. cuda_graphs: False runs
        the model eagerly on CUDA too. quantize: "bf16" or "int8" runs the GEMMs in that format (fastbert/formats.py;
        the model loads in float32), and measures what it costs against fp32 at load on `quality_texts` (a file, one
        text per line, or a list; None: the built-in sample): `format_quality`."""
        import transformers

        model_folder, st, tokenizer_kwargs, folder_dtype = locate(name_or_path)
        fmt = formats.format_of(quantize)
        if fmt is not None:
            dtype = formats.load_dtype(quantize, dtype)
        model = BertModel.from_pretrained(model_folder, add_pooling_layer=False, kernels=kernels,
                                          dtype=dtype if dtype is not None else (folder_dtype or "auto"),
                                          device=device or ("cuda" if torch.cuda.is_available() else "cpu"))
        pipeline = None
        if st is not None:
            pipeline, dimension = st
            if dimension is not None and dimension != model.config.hidden_size:
                raise ValueError(f"the Pooling config says embedding dimension {dimension}, the model's hidden_size "
                                 f"is {model.config.hidden_size}")
        tokenizer = transformers.AutoTokenizer.from_pretrained(model_folder, **tokenizer_kwargs)
        if "model_max_length" in tokenizer_kwargs and pipeline is not None:  # wins over max_seq_length, as in s-t
            pipeline = replace(pipeline, max_seq_length=tokenizer_kwargs["model_max_length"])
        encoder = cls(model, tokenizer, pooling=pooling, normalize=normalize, max_seq_length=max_seq_length,
                      do_lower_case=do_lower_case, include_prompt=include_prompt, pipeline=pipeline,
                      name=os.fspath(name_or_path), cuda_graphs=cuda_graphs, truncate_dim=truncate_dim, task=task)
        if fmt is not None:
            encoder.set_format(fmt, quality_texts)
        return encoder

    def set_format(self, quantize, quality_texts=None):
        """Run the model's GEMMs in `quantize` ("fp32", "bf16", "int8": BertModel.set_format) and, for a format
        other than fp32, measure its cost against fp32 on `quality_texts` (None: the built-in sample):
        `format_quality`."""
        self.model.set_format(quantize)
        if self.model.quantize != "fp32":
            texts, source = quality.quality_texts(quality_texts)
            quality.measure(self.model, lambda t: torch.from_numpy(self.encode(t, progress=False)), "embedding",
                            texts, source)
        return self

    @property
    def format_quality(self):
        """What the GEMMs' number format costs against fp32 (quality.Quality), or None in fp32."""
        return self.model.__dict__.get("format_quality")

    def _check_max_seq_length(self) -> int:
        limit = self.model.embeddings.max_length  # the position table's usable length (RoBERTa's starts after pad)
        value = self.pipeline.max_seq_length
        if value is None:  # sentence-transformers: the tokenizer's limit, capped at the position table
            return min(self.tokenizer.model_max_length, limit)
        smallest = self.tokenizer.num_special_tokens_to_add() + 1
        if isinstance(value, bool) or not isinstance(value, int) or value < smallest:
            raise ValueError(f"max_seq_length must be an integer >= {smallest} (the special tokens and one more), "
                             f"got {value!r}")
        if value > limit:
            raise ValueError(f"max_seq_length {value} exceeds the {limit} positions the model can take")
        return value

    @property
    def dimension(self) -> int:
        if self.pipeline.dense:  # the last Dense module's out_features
            return self.pipeline.dense[-1].weight.shape[0]
        return len(self.pipeline.pooling) * self.model.config.hidden_size

    @property
    def device(self) -> torch.device:
        return self.model.embeddings.word_embeddings.weight.device

    def resolve_prompt(self, prompt: str | None, prompt_name: str | None) -> str:
        return resolve_prompt(self.pipeline, prompt, prompt_name)

    def task_prompt(self, task: str) -> str:
        """The text a task's inputs start with: the folder's sentence-transformers prompt of that name (what
        `prompt_name=task` gives there), else the config's task_instructions (Jina's own encode), else none."""
        adapters.task_index(self.model, task)
        if task in self.pipeline.prompts:
            return self.pipeline.prompts[task]
        return (getattr(self.model.config, "task_instructions", None) or {}).get(task, "")

    @property
    def tasks(self) -> tuple:
        """The names of the model's task adapters (Jina-Embeddings-v3's), in adapter_mask's order; () for others."""
        return tuple(self.model.task_names)

    def adapter_mask(self, tasks: Sequence[str | None]) -> torch.Tensor | None:
        """One task name per text (None: no adapter) -> the model's adapter_mask [len(tasks)] on its device (None when
        no text names one): for callers that tokenize themselves and batch texts of different tasks together (each
        text then starts with its task_prompt). Unknown names are a ValueError listing the model's tasks."""
        return adapters.adapter_mask(self.model, tasks)

    def _prompt_length(self, prompt: str) -> int:
        """Tokens of the prompt at the start of every text, [CLS] included and a trailing special token not
        (sentence-transformers' count; the pooling mask drops them when include_prompt is False)."""
        if prompt not in self._prompt_lengths:
            ids = self.tokenizer([prompt], truncation=True, max_length=self.pipeline.max_seq_length)["input_ids"][0]
            self._prompt_lengths[prompt] = len(ids) - (ids[-1] in self.tokenizer.all_special_ids)
        return self._prompt_lengths[prompt]

    def encode(self, texts: Sequence[str], *, prompt: str | None = None, prompt_name: str | None = None,
               max_tokens_per_batch: int | None = None, batch_size: int | None = None,
               progress: bool | None = None, truncate_dim: int | None = None, task: str | None = None) -> np.ndarray:
        """[len(texts), dimension] float32, row i for texts[i]. progress: None = a bar on stderr when it is a
        terminal and the work takes more than a second; True / False = always / never. truncate_dim: keep the first
        this many dimensions (None: the encoder's truncate_dim), cut after the pipeline as sentence-transformers
        cuts them (a normalised model's cut vectors are not renormalised). task: the task adapter every text runs
        with (None: the encoder's task), and its prompt (`task_prompt`) unless prompt or prompt_name is given."""
        keep = self.truncate_dim if truncate_dim is None else check_truncate_dim(truncate_dim)
        texts = _check_texts(texts)
        check_counts(max_tokens_per_batch=max_tokens_per_batch, batch_size=batch_size)
        if max_tokens_per_batch is None:
            max_tokens_per_batch = default_max_tokens_per_batch(self.device)
        task = self.task if task is None else task
        index = None if task is None else adapters.task_index(self.model, task)
        if task is not None and prompt is None and prompt_name is None:
            prompt = self.task_prompt(task)
        prompt = self.resolve_prompt(prompt, prompt_name)
        skip = self._prompt_length(prompt) if prompt and not self.pipeline.include_prompt else 0
        result = np.empty((len(texts), self.dimension), dtype=np.float32)
        bar = _progress_bar(len(texts), progress)
        started, tokens = time.perf_counter(), 0
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        with torch.inference_mode():
            for start in range(0, len(texts), WINDOW):
                window = texts[start:start + WINDOW]
                ids = self.tokenizer([prompt + t for t in window] if prompt else window, truncation=True,
                                     max_length=self.pipeline.max_seq_length, return_attention_mask=False,
                                     return_token_type_ids=False)["input_ids"]
                out = torch.empty((len(window), self.dimension), dtype=torch.float32, device=self.device)
                # A padding-free model computes real tokens only, so the budget counts real tokens
                for batch in plan_batches([len(x) for x in ids], max_tokens_per_batch, batch_size,
                                          count_padding=not self.model.padding_free):
                    input_ids, attention_mask = padded([ids[i] for i in batch], pad_id)
                    input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
                    tasks = None if index is None else torch.full((len(batch),), index, device=self.device)
                    vectors = embed(self._forward, self.pipeline, input_ids, attention_mask, skip, tasks)
                    out[torch.tensor(batch, device=self.device)] = vectors
                    if bar is not None:
                        tokens += sum(len(ids[i]) for i in batch)
                        bar.set_postfix_str(f"{tokens / (time.perf_counter() - started):,.0f} tokens/s",
                                            refresh=False)
                        bar.update(len(batch))
                result[start:start + len(window)] = out.cpu().numpy()
        if bar is not None:
            bar.close()
        return result if keep is None or keep >= self.dimension else np.ascontiguousarray(result[:, :keep])


    def embed_tokenized(self, ids: Sequence[Sequence[int]], *, prompts: Sequence[str] | None = None,
                        tasks: Sequence[str | None] | None = None, token_vectors: bool = False):
        """Texts tokenized already (ids[i]: text i's token ids, special tokens included, at most max_seq_length of
        them) as one padding-free packed batch: the model runs on their real tokens only (input_ids [T] with
        cu_seqlens [n + 1]), whoever sent them, and each is pooled as `encode` pools it -> [len(ids), dimension]
        float32 on the model's device, before Normalize and truncate_dim (`pipeline.normalize` says whether
        sentence-transformers normalises). prompts[i]: the prompt text i starts with, when it has one (its tokens are
        left out of the pooling when include_prompt is False). tasks[i]: the task adapter text i runs with (None:
        the model as loaded; a model without adapters refuses any name, `tasks` says which there are), so one batch
        mixes tasks freely. token_vectors: also every token's vector, the packed last hidden state [T, hidden] float32
        (sentence-transformers' token_embeddings, text after text) -> (pooled, tokens)."""
        adapter_mask = self.adapter_mask(tasks) if tasks is not None else None
        lengths = [len(x) for x in ids]
        if not lengths or min(lengths) < 1:
            raise ValueError("embed_tokenized needs at least one text, each of at least one token")
        skips = [self._prompt_length(p) if p and not self.pipeline.include_prompt else 0 for p in prompts] \
            if prompts is not None else [0] * len(ids)
        device = self.device
        flat = torch.tensor(list(itertools.chain.from_iterable(ids)), dtype=torch.long, device=device)
        lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
        cu_seqlens = torch.zeros(len(ids) + 1, dtype=torch.int32, device=device)
        cu_seqlens[1:] = torch.cumsum(lengths_t, 0)
        with torch.inference_mode():
            tasks = {} if adapter_mask is None else {"adapter_mask": adapter_mask}
            hidden = self._forward(input_ids=flat, cu_seqlens=cu_seqlens, max_seqlen=max(lengths),
                                   **tasks).last_hidden_state
            pooled = self.pipeline.after_pooling(pool_packed(hidden, lengths_t, torch.tensor(
                skips, dtype=torch.long, device=device), self.pipeline.pooling))
            return (pooled, hidden.float()) if token_vectors else pooled


def _check_texts(texts) -> list[str]:
    if isinstance(texts, (str, bytes)):
        raise TypeError("texts must be a list of strings, got a single string (for one text, pass [text])")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] is a {type(t).__name__}, not a string")
    return texts


def _progress_bar(total: int, progress: bool | None):
    if progress is False or total == 0 or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm
    return tqdm(total=total, unit="text", desc="encode", file=sys.stderr, delay=0 if progress else 1.0)


def _lowercase_first(tokenizer) -> None:
    """sentence-transformers' do_lower_case: a Lowercase normaliser in front of the tokenizer's own (unless one is
    there already); on a slow tokenizer, its do_lower_case flag."""
    if getattr(tokenizer, "is_fast", False):
        from tokenizers.normalizers import Lowercase
        from tokenizers.normalizers import Sequence as NormalizerSequence
        normalizer = tokenizer.backend_tokenizer.normalizer
        present = isinstance(normalizer, Lowercase) or (
            isinstance(normalizer, NormalizerSequence) and any(isinstance(n, Lowercase) for n in normalizer))
        if not present:
            rest = list(normalizer) if isinstance(normalizer, NormalizerSequence) else \
                [normalizer] if normalizer is not None else []
            tokenizer.backend_tokenizer.normalizer = NormalizerSequence([Lowercase(), *rest])
    else:
        try:
            tokenizer.do_lower_case = True
        except AttributeError:
            tokenizer.basic_tokenizer.do_lower_case = True


def encode(model_or_path, texts: Sequence[str], *, prompt: str | None = None, prompt_name: str | None = None,
           max_tokens_per_batch: int | None = None, batch_size: int | None = None,
           progress: bool | None = None, truncate_dim: int | None = None, task: str | None = None,
           **options) -> np.ndarray:
    """Sentence embeddings of `texts` as sentence-transformers computes them: [len(texts), dim] float32, in order.

    model_or_path: a folder or cached Hub id (sentence-transformers or plain Hugging Face BERT), a SentenceEncoder,
        or a fastbert.BertModel together with tokenizer=.
    options, when loading (see SentenceEncoder.from_pretrained): pooling (a mode or a list of modes), normalize,
        max_seq_length, do_lower_case, include_prompt (each overrides the folder's setting), dtype, device, kernels,
        cuda_graphs (False: no CUDA graphs; with a BertModel too); tokenizer (with a BertModel); quantize ("bf16" /
        "int8": the GEMMs' number format, its cost against fp32 measured on load) and quality_texts (the texts it
        is measured on).
    prompt / prompt_name: a text put before every text, or the name of one of the model's prompts (the folder's
        default_prompt_name applies when neither is given; prompt="" turns it off).
    max_tokens_per_batch: the token budget of one forward (padding counted while the forward is padded; None:
        4,096 on a CPU, 16,384 on a GPU, default_max_tokens_per_batch);
        batch_size: at most this many texts per forward (default: the token budget alone decides).
    truncate_dim: keep the first this many dimensions of each vector (Matryoshka models), cut after the pipeline as
        sentence-transformers cuts them; None: no cut.
    task: Jina-Embeddings-v3's task adapter for every text, with the task's prompt (SentenceEncoder.encode).
    """
    unknown = sorted(set(options) - set(_LOAD_OPTIONS))
    if unknown:
        raise TypeError(f"encode() got unexpected keyword argument(s) {', '.join(unknown)}; the options are "
                        f"prompt, prompt_name, max_tokens_per_batch, batch_size, progress, truncate_dim, task, "
                        f"{', '.join(_LOAD_OPTIONS)}")
    if isinstance(model_or_path, SentenceEncoder):
        if options:
            raise TypeError(f"{', '.join(sorted(options))}: set when the encoder is built "
                            f"(SentenceEncoder.from_pretrained(..., {sorted(options)[0]}=...)), not per call")
        encoder = model_or_path
    elif isinstance(model_or_path, BertModel):
        load_only = sorted(set(options) & {"dtype", "device", "kernels"})  # cuda_graphs does not change the model
        if load_only:
            raise TypeError(f"{', '.join(load_only)}: a model already built is used as it is (move or cast it "
                            f"yourself)")
        encoder = SentenceEncoder(model_or_path, **options)
    elif isinstance(model_or_path, (str, os.PathLike)):
        if "tokenizer" in options:
            raise TypeError("tokenizer: a folder brings its own tokenizer")
        encoder = SentenceEncoder.from_pretrained(model_or_path, **options)
    else:
        raise TypeError(f"model_or_path must be a folder, a Hub id, a SentenceEncoder or a fastbert.BertModel, "
                        f"got {type(model_or_path).__name__}")
    return encoder.encode(texts, prompt=prompt, prompt_name=prompt_name, max_tokens_per_batch=max_tokens_per_batch,
                          batch_size=batch_size, progress=progress, truncate_dim=truncate_dim, task=task)
