"""What the server serves, decided by the folder, as in TEI:

    a sentence-transformers folder (modules.json), or a plain encoder folder  -> "embedding"   /embed, /v1/embeddings
    a *ForSequenceClassification folder with one label (a cross-encoder)      -> "reranker"    /rerank, /predict
    a *ForSequenceClassification folder with several labels                   -> "classifier"  /predict
    a sentence-transformers SparseEncoder folder (MLMTransformer, SpladePooling) -> "sparse"    /embed_sparse

Each kind tokenizes on the tokenizer threads (`prepare`: texts -> payloads, the 413 for a text past the model's limit)
and runs on the model worker (`run`: payloads -> one result per text, called by the scheduler):
- Embedder: fastbert.SentenceEncoder (pooling exactly as sentence-transformers); each batch is one packed,
  padding-free forward (SentenceEncoder.embed_tokenized). Results: pooled vectors, before Normalize.
- Scorer: the transformers head with fastbert.optimize'd encoder inside, which computes the real tokens only; the
  head reads them as [texts, longest, hidden] rows (zeros past each text), so a batch is cut into chunks whose rows
  times longest text stay within the token budget (length-sorted, as encode's plan_batches cuts a padded forward).
  Results: logits.
"""
from __future__ import annotations

import copy
import json
import os
import re
import threading
from dataclasses import dataclass
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from .. import formats
from ..encode import SentenceEncoder, forward_budget, padded, plan_batches
from ..loading import looks_like_a_path, resolve_folder
from .errors import Invalid, TooLarge


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass(frozen=True)
class Kind:
    """What a folder serves, read from its files before any weight is loaded."""
    name: str                  # "embedding", "reranker" or "classifier"
    folder: str                # the folder given (a sentence-transformers folder: its root)
    checkpoint: str            # the folder holding config.json and the weights
    labels: tuple = ()         # the classifier's labels, by index (id2label)
    splade: tuple = ()         # a SparseEncoder's SpladePooling (pooling_strategy, activation_function)


def read_kind(model) -> Kind:
    """The kind of model a folder (or a cached Hub id) holds; FileNotFoundError / ValueError naming what is missing."""
    path = os.fspath(model)
    folder = path if os.path.isdir(path) else resolve_folder(path, weights=False)
    checkpoint = folder
    cross_encoder = False
    if os.path.isfile(os.path.join(folder, "modules.json")):
        st_config = os.path.join(folder, "config_sentence_transformers.json")
        model_type = _read_json(st_config).get("model_type") if os.path.isfile(st_config) else None
        if model_type == "SparseEncoder":
            return _sparse_kind(folder, _read_json(os.path.join(folder, "modules.json")))
        cross_encoder = model_type == "CrossEncoder"
        if not cross_encoder:
            return Kind("embedding", folder, folder)
        modules = _read_json(os.path.join(folder, "modules.json"))
        checkpoint = os.path.join(folder, (modules[0].get("path") if modules else "") or "")
    config_path = os.path.join(checkpoint, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in {checkpoint!r}")
    config = _read_json(config_path)
    heads = [a for a in config.get("architectures") or () if a.endswith("ForSequenceClassification")]
    if not heads and not cross_encoder:
        return Kind("embedding", folder, checkpoint)
    if not heads:
        raise ValueError(f"{folder!r} is a CrossEncoder, but its config.json names no *ForSequenceClassification "
                         f"architecture (architectures: {config.get('architectures')!r})")
    id2label = config.get("id2label") or {}
    count = config.get("num_labels") or len(id2label) or 2
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count))
    return Kind("reranker" if count == 1 else "classifier", folder, checkpoint, labels)


def _sparse_kind(folder: str, modules: list) -> Kind:
    """A SparseEncoder folder: an MLMTransformer, then SpladePooling (sentence-transformers' SPLADE); anything else
    in it is refused, naming the module."""
    types = [m.get("type", "").rsplit(".", 1)[-1] for m in modules]
    if types != ["MLMTransformer", "SpladePooling"]:
        raise ValueError(f"{folder!r}: a SparseEncoder served here is MLMTransformer then SpladePooling; its modules "
                         f"are {', '.join(types) or 'none'}")
    config = _read_json(os.path.join(folder, modules[1].get("path", ""), "config.json"))
    splade = (config.get("pooling_strategy", "max"), config.get("activation_function", "relu"))
    if splade[0] not in ("max", "sum") or splade[1] not in ("relu", "log1p_relu"):
        raise ValueError(f"{folder!r}: SpladePooling {splade} is not one of (max|sum, relu|log1p_relu)")
    if config.get("embedding_dimension") is not None:
        raise ValueError(f"{folder!r}: SpladePooling's embedding_dimension (a cut vocabulary) is not served")
    return Kind("sparse", folder, os.path.join(folder, modules[0].get("path", "") or ""), splade=splade)


# A model card's title that is a model's name: one word of letters, digits and -_. (an "org/name" id too), as
# sentence-transformers' published cards begin ("# all-MiniLM-L6-v2"); a sentence ("# SentenceTransformer based on
# ...") names nothing
_CARD_TITLE = re.compile(r"#[ \t]+([A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)[ \t]*")


def served_name(given, folder: str) -> str:
    """The name a folder is served under (/v1/models, /info, the `model` of an answer), when no
    --served-model-name says: a Hub cache's snapshot (.../models--ORG--NAME/snapshots/HASH) is its repo id ORG/NAME;
    a sentence-transformers folder whose model card names the model (front matter `library_name:
    sentence-transformers`, and a first title that is a bare name) is that name, whatever its folder is called (the
    bundled model's folder is named "model"; its card says all-MiniLM-L6-v2); any other folder is its folder's name.
    given: what the caller named (a folder, or a Hub id, which is its own name)."""
    if isinstance(given, str) and not os.path.isdir(given) and not looks_like_a_path(given):
        return given
    path = os.path.normpath(os.path.abspath(folder))
    parts = path.split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith("models--"):
            return parts[i - 1][len("models--"):].replace("--", "/")
    named = _card_name(os.path.join(path, "README.md"))
    if named is not None:
        return named
    return os.path.basename(path)


def _card_name(readme: str) -> Optional[str]:
    """The model's name from a sentence-transformers model card (README.md), or None."""
    try:
        with open(readme, encoding="utf-8") as f:
            text = f.read(65536)
    except (OSError, UnicodeDecodeError):
        return None
    lines = text.splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == "---")
    except StopIteration:
        return None
    front = lines[1:end]
    if not any(re.fullmatch(r"library_name:\s*['\"]?sentence-transformers['\"]?\s*", line) for line in front):
        return None
    for line in lines[end + 1:]:
        if line.startswith("#"):  # the first title decides
            found = _CARD_TITLE.fullmatch(line.rstrip())
            return found.group(1) if found else None
    return None


class _Tokenizers(threading.local):
    """One copy of the tokenizer per thread: a fast tokenizer keeps its truncation settings on the object and
    tokenizing sets them, so two threads must never share one."""

    def __init__(self, tokenizer):
        self.tokenizer = copy.deepcopy(tokenizer)
        # the server counts every input's tokens untruncated (a 413 says how many) and cuts with an explicit
        # max_length: transformers' warning about sequences past model_max_length would only repeat that
        self.tokenizer.model_max_length = int(1e30)


def _tokenize(tokenizer, first: list, second: Optional[list], limit: int, truncate: bool, direction: str,
              field: str, positions: Sequence[int], total: int) -> list[dict]:
    """Each text (or pair) tokenized with its special tokens; past `limit` tokens: cut at `direction` when
    `truncate`, else a 413 naming the input (`field`[its position among the request's `total` inputs]), its token
    count and the limit (TEI's rule)."""
    want_types = "token_type_ids" in tokenizer.model_input_names
    kwargs = dict(add_special_tokens=True, return_attention_mask=False, return_token_type_ids=want_types)
    encoded = tokenizer(first, second, truncation=False, **kwargs) if second is not None else \
        tokenizer(first, truncation=False, **kwargs)
    rows = [{"ids": ids, "types": encoded["token_type_ids"][i] if want_types else None}
            for i, ids in enumerate(encoded["input_ids"])]
    long = [i for i, row in enumerate(rows) if len(row["ids"]) > limit]
    if long and not truncate:
        i = long[0]
        where = f"{field}[{positions[i]}]" if total > 1 else field
        raise TooLarge(f"{where} has {len(rows[i]['ids'])} tokens, more than the model's limit of {limit} "
                              f"(truncate: true cuts it at the limit)", param=field, label="tokenization")
    if long:
        side = tokenizer.truncation_side
        tokenizer.truncation_side = direction.lower()
        try:
            cut = tokenizer([first[i] for i in long], [second[i] for i in long], truncation=True, max_length=limit,
                            **kwargs) if second is not None else \
                tokenizer([first[i] for i in long], truncation=True, max_length=limit, **kwargs)
        finally:
            tokenizer.truncation_side = side
        for j, i in enumerate(long):
            rows[i] = {"ids": cut["input_ids"][j], "types": cut["token_type_ids"][j] if want_types else None}
    return rows


class EmbedPayload(NamedTuple):
    """One input of an embedding model, tokenized: what the model worker runs."""
    ids: list                    # token ids, special tokens included
    prompt: Optional[str]        # the prompt the text starts with (None: none)
    task: Optional[str]          # the task adapter (None: the model as loaded)
    tokens: bool = False         # its result: every token's vector [tokens, hidden] rather than the pooled one


class ScorePayload(NamedTuple):
    """One text or pair for a reranker or classifier, tokenized."""
    ids: list
    types: Optional[list]        # token type ids, where the tokenizer makes them


class Embedder:
    """A SentenceEncoder served: pooled vectors of packed, padding-free batches."""

    kind = "embedding"

    def __init__(self, encoder: SentenceEncoder):
        self.encoder = encoder
        self.limit = encoder.pipeline.max_seq_length
        self.dimension = encoder.dimension
        self.normalize = encoder.pipeline.normalize
        self.vocab_size = encoder.model.config.vocab_size
        # the task adapters the encoder applies per text (Jina-Embeddings-v3's); none for other models
        self.tasks = tuple(getattr(encoder, "tasks", None) or ())
        self.dtype = str(encoder.model.embeddings.word_embeddings.weight.dtype).replace("torch.", "")
        self.quantize, self.format_quality = encoder.model.quantize, encoder.format_quality
        self.device = str(encoder.device)
        self._tokenizers = _Tokenizers(encoder.tokenizer)

    @classmethod
    def load(cls, folder: str, device=None, dtype=None, kernels="auto", cuda_graphs=True, quantize=None,
             quality_texts=None) -> "Embedder":
        return cls(SentenceEncoder.from_pretrained(folder, device=device, dtype=dtype, kernels=kernels,
                                                   cuda_graphs=cuda_graphs, quantize=quantize,
                                                   quality_texts=quality_texts))

    @property
    def tokenizer(self):
        """This thread's tokenizer."""
        return self._tokenizers.tokenizer

    def prompt(self, prompt_name: Optional[str], task: Optional[str]) -> str:
        """The prompt put before each text: the named one, else the task's (the folder's prompt of that name, else
        the model's task_instructions, as sentence-transformers and Jina's own encode give it), else the folder's
        default prompt; a 422 for a name the folder does not have."""
        if prompt_name is None and task is not None:
            self.check_task(task)
            return self.encoder.task_prompt(task)
        try:
            return self.encoder.resolve_prompt(None, prompt_name)
        except ValueError as e:
            raise Invalid(f"prompt_name: {e}", param="prompt_name", label="tokenization") from None

    def check_task(self, task: Optional[str]) -> None:
        if task is None:
            return
        if not self.tasks:
            raise Invalid(f"task: {task!r} names a task adapter, and this model has none", param="task")
        if task not in self.tasks:
            raise Invalid(f"task: {task!r} is not one of this model's tasks ({', '.join(self.tasks)})",
                             param="task")

    def prepare(self, inputs: Sequence, prompt: str, task: Optional[str], truncate: bool, direction: str,
                field: str, tokens: bool = False) -> list:
        """Texts and token-id lists -> an EmbedPayload per input, what `run` takes; a text gets the prompt in
        front. Token ids are the model's input as given (special tokens included), never cut. tokens: each input's
        result is its token vectors (TEI's /embed_all)."""
        payloads = [None] * len(inputs)
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                continue
            where = f"{field}[{i}]" if len(inputs) > 1 else field
            bad = next((t for t in x if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise Invalid(f"{where}: token id {bad} is outside the vocabulary (0 to "
                                      f"{self.vocab_size - 1})", param=field)
            if len(x) > self.limit:
                raise TooLarge(f"{where} has {len(x)} tokens, more than the model's limit of {self.limit} "
                                      f"(token ids are never cut)", param=field, label="tokenization")
            payloads[i] = EmbedPayload(list(x), None, task, tokens)
        if texts:
            rows = _tokenize(self.tokenizer, [prompt + inputs[i] for i in texts], None, self.limit, truncate,
                             direction, field, texts, len(inputs))
            for i, row in zip(texts, rows):
                payloads[i] = EmbedPayload(row["ids"], prompt or None, task, tokens)
        return payloads

    def run(self, payloads: Sequence[EmbedPayload]) -> list:
        """EmbedPayloads -> per input, its pooled vector (a float32 numpy row), or its token vectors [tokens,
        hidden] where it asks for them: one packed forward, or on a CPU forwards of encode's CPU budget
        (forward_budget: beyond it a CPU forward is slower per token), length-sorted."""
        lengths = [len(p.ids) for p in payloads]
        total = sum(lengths)
        budget = forward_budget(self.encoder.device, total)
        if total <= budget:
            return self._forward(payloads)
        out: list = [None] * len(payloads)
        for chunk in plan_batches(lengths, budget, count_padding=False):
            for i, result in zip(chunk, self._forward([payloads[i] for i in chunk])):
                out[i] = result
        return out

    def _forward(self, payloads: Sequence[EmbedPayload]) -> list:
        tokens = any(p.tokens for p in payloads)
        out = self.encoder.embed_tokenized([p.ids for p in payloads], prompts=[p.prompt for p in payloads],
                                           tasks=[p.task for p in payloads], **({"token_vectors": True} if tokens
                                                                                 else {}))
        if not tokens:
            return list(out.cpu().numpy())
        pooled, hidden = out[0].cpu().numpy(), out[1].cpu().numpy()
        results, start = [], 0
        for i, p in enumerate(payloads):
            results.append(hidden[start:start + len(p.ids)] if p.tokens else pooled[i])
            start += len(p.ids)
        return results


class Scorer:
    """A sequence-classification head (reranker or classifier) with fastbert inside: logits per text or pair."""

    def __init__(self, kind: Kind, head, tokenizer, max_batch_tokens: int):
        from ..modeling import BertModel

        self.kind, self.labels = kind.name, kind.labels
        self.head, self.max_batch_tokens = head, max_batch_tokens
        encoder = next(m for m in head.modules() if isinstance(m, BertModel))
        self.limit = min(tokenizer.model_max_length, encoder.embeddings.max_length)
        self.dtype = str(encoder.embeddings.word_embeddings.weight.dtype).replace("torch.", "")
        self.quantize, self.format_quality = encoder.quantize, encoder.__dict__.get("format_quality")
        self.device = str(encoder.embeddings.word_embeddings.weight.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._tokenizers = _Tokenizers(tokenizer)

    @classmethod
    def load(cls, kind: Kind, max_batch_tokens: int, device=None, dtype=None, kernels="auto",
             cuda_graphs=True, quantize=None, quality_texts=None) -> "Scorer":
        import transformers

        from ..patch import optimize

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if formats.format_of(quantize) is not None:
            dtype = formats.load_dtype(quantize, dtype)
        head = transformers.AutoModelForSequenceClassification.from_pretrained(
            kind.checkpoint, dtype=dtype if dtype is not None else "auto")
        tokenizer = transformers.AutoTokenizer.from_pretrained(kind.checkpoint)
        head = optimize(head.to(device).eval(), kernels=kernels, cuda_graphs=cuda_graphs, quantize=quantize,
                        quality_texts=quality_texts, tokenizer=tokenizer)
        return cls(kind, head, tokenizer, max_batch_tokens)

    @property
    def tokenizer(self):
        return self._tokenizers.tokenizer

    def prepare(self, inputs: Sequence, truncate: bool, direction: str, field: str) -> list:
        """Texts and (text, text_pair) pairs -> a ScorePayload per input."""
        payloads = [None] * len(inputs)
        singles = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        pairs = [i for i, x in enumerate(inputs) if not isinstance(x, str)]
        for group, second in ((singles, None), (pairs, True)):
            if not group:
                continue
            first = [inputs[i] if second is None else inputs[i][0] for i in group]
            rows = _tokenize(self.tokenizer, first, None if second is None else [inputs[i][1] for i in group],
                             self.limit, truncate, direction, field, group, len(inputs))
            for i, row in zip(group, rows):
                payloads[i] = ScorePayload(row["ids"], row["types"])
        return payloads

    def run(self, payloads: Sequence[ScorePayload]) -> list:
        """ScorePayloads -> logits (float32 numpy rows): the head over chunks whose padded rows stay within the
        token budget (on a CPU at most encode's CPU budget: forward_budget); its fastbert encoder computes the real
        tokens only."""
        lengths = [len(p.ids) for p in payloads]
        out: list = [None] * len(payloads)
        budget = forward_budget(self.device, self.max_batch_tokens)
        with torch.inference_mode():
            for chunk in plan_batches(lengths, budget, count_padding=True):
                input_ids, mask = padded([payloads[i].ids for i in chunk], self.pad_id)
                kwargs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
                if payloads[chunk[0]].types is not None:
                    kwargs["token_type_ids"] = padded([payloads[i].types for i in chunk], 0)[0].to(self.device)
                logits = self.head(**kwargs).logits.float().cpu().numpy()
                for row, i in enumerate(chunk):
                    out[i] = logits[row]
        return out


class Sparser(Scorer):
    """A SparseEncoder (SPLADE) served: transformers' masked-LM head with fastbert's encoder inside, its logits
    pooled as SpladePooling pools them (relu, log1p (twice for log1p_relu), masked to the real tokens, max or sum
    over them) -> per text, its non-zero (vocabulary index, value) pairs."""

    # logits are [rows, longest, vocabulary]: a chunk's padded tokens stay within this many (4096 x a 30,522-word
    # vocabulary: 500 MB of fp32)
    LOGIT_TOKENS = 4096

    def __init__(self, kind: Kind, head, tokenizer, max_batch_tokens: int):
        super().__init__(kind, head, tokenizer, max_batch_tokens)
        self.pooling, self.activation = kind.splade
        self.limit = min(self.limit, _max_seq_length(kind.checkpoint, self.limit))

    @classmethod
    def load(cls, kind: Kind, max_batch_tokens: int, device=None, dtype=None, kernels="auto",
             cuda_graphs=True, quantize=None, quality_texts=None) -> "Sparser":
        import transformers

        from ..patch import optimize

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if formats.format_of(quantize) is not None:
            dtype = formats.load_dtype(quantize, dtype)
        head = transformers.AutoModelForMaskedLM.from_pretrained(kind.checkpoint,
                                                                 dtype=dtype if dtype is not None else "auto")
        tokenizer = transformers.AutoTokenizer.from_pretrained(kind.checkpoint)
        head = optimize(head.to(device).eval(), kernels=kernels, cuda_graphs=cuda_graphs, quantize=quantize,
                        quality_texts=quality_texts, tokenizer=tokenizer)
        return cls(kind, head, tokenizer, max_batch_tokens)

    def run(self, payloads: Sequence[ScorePayload]) -> list:
        """ScorePayloads -> per text, (indices int64, values float32) of its non-zero vocabulary weights, indices
        ascending."""
        lengths = [len(p.ids) for p in payloads]
        out: list = [None] * len(payloads)
        budget = min(self.max_batch_tokens, self.LOGIT_TOKENS)
        with torch.inference_mode():
            for chunk in plan_batches(lengths, budget, count_padding=True):
                input_ids, mask = padded([payloads[i].ids for i in chunk], self.pad_id)
                mask = mask.to(self.device)
                kwargs = {"input_ids": input_ids.to(self.device), "attention_mask": mask}
                if payloads[chunk[0]].types is not None:
                    kwargs["token_type_ids"] = padded([payloads[i].types for i in chunk], 0)[0].to(self.device)
                logits = self.head(**kwargs).logits.float()
                weights = torch.log1p(torch.relu(logits * mask.unsqueeze(-1).float()))
                if self.activation == "log1p_relu":
                    weights = torch.log1p(weights)
                pooled = weights.amax(dim=1) if self.pooling == "max" else weights.sum(dim=1)
                pooled = pooled.cpu()
                for row, i in enumerate(chunk):
                    index = torch.nonzero(pooled[row]).flatten()
                    out[i] = (index.numpy(), pooled[row, index].numpy())
        return out


def _max_seq_length(checkpoint: str, default: int) -> int:
    """An MLMTransformer's max_seq_length (sentence_bert_config.json), else `default`."""
    path = os.path.join(checkpoint, "sentence_bert_config.json")
    return int(_read_json(path).get("max_seq_length") or default) if os.path.isfile(path) else default


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
