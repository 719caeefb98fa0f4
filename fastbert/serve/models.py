"""What the server serves, decided by the folder, as in TEI:

    a sentence-transformers folder (modules.json), or a plain encoder folder  -> "embedding"   /embed, /v1/embeddings
    a *ForSequenceClassification folder with one label (a cross-encoder)      -> "reranker"    /rerank, /predict
    a *ForSequenceClassification folder with several labels                   -> "classifier"  /predict

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
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..encode import SentenceEncoder, padded, plan_batches
from ..loading import resolve_folder
from .errors import ServeError


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


def read_kind(model) -> Kind:
    """The kind of model a folder (or a cached Hub id) holds; FileNotFoundError / ValueError naming what is missing."""
    path = os.fspath(model)
    folder = path if os.path.isdir(path) else resolve_folder(path, weights=False)
    checkpoint = folder
    cross_encoder = False
    if os.path.isfile(os.path.join(folder, "modules.json")):
        st_config = os.path.join(folder, "config_sentence_transformers.json")
        cross_encoder = os.path.isfile(st_config) and _read_json(st_config).get("model_type") == "CrossEncoder"
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
        raise ServeError(413, f"{where} has {len(rows[i]['ids'])} tokens, more than the model's limit of {limit} "
                              f"(truncate: true cuts it at the limit)", param=field)
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
        self.device = str(encoder.device)
        self._tokenizers = _Tokenizers(encoder.tokenizer)

    @classmethod
    def load(cls, folder: str, device=None, dtype=None, kernels="auto", cuda_graphs=True) -> "Embedder":
        return cls(SentenceEncoder.from_pretrained(folder, device=device, dtype=dtype, kernels=kernels,
                                                   cuda_graphs=cuda_graphs))

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
            raise ServeError(422, f"prompt_name: {e}", param="prompt_name") from None

    def check_task(self, task: Optional[str]) -> None:
        if task is None:
            return
        if not self.tasks:
            raise ServeError(422, f"task: {task!r} names a task adapter, and this model has none", param="task")
        if task not in self.tasks:
            raise ServeError(422, f"task: {task!r} is not one of this model's tasks ({', '.join(self.tasks)})",
                             param="task")

    def prepare(self, inputs: Sequence, prompt: str, task: Optional[str], truncate: bool, direction: str,
                field: str) -> list:
        """Texts and token-id lists -> (ids, prompt, task) per input, the payload `run` takes; a text gets the
        prompt in front. Token ids are the model's input as given (special tokens included), never cut."""
        payloads = [None] * len(inputs)
        texts = [i for i, x in enumerate(inputs) if isinstance(x, str)]
        for i, x in enumerate(inputs):
            if isinstance(x, str):
                continue
            where = f"{field}[{i}]" if len(inputs) > 1 else field
            bad = next((t for t in x if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ServeError(422, f"{where}: token id {bad} is outside the vocabulary (0 to "
                                      f"{self.vocab_size - 1})", param=field)
            if len(x) > self.limit:
                raise ServeError(413, f"{where} has {len(x)} tokens, more than the model's limit of {self.limit} "
                                      f"(token ids are never cut)", param=field)
            payloads[i] = (list(x), None, task)
        if texts:
            rows = _tokenize(self.tokenizer, [prompt + inputs[i] for i in texts], None, self.limit, truncate,
                             direction, field, texts, len(inputs))
            for i, row in zip(texts, rows):
                payloads[i] = (row["ids"], prompt or None, task)
        return payloads

    def run(self, payloads: Sequence) -> list:
        """[(ids, prompt, task)] -> pooled vectors (float32 numpy rows), one packed forward."""
        vectors = self.encoder.embed_tokenized([p[0] for p in payloads], prompts=[p[1] for p in payloads],
                                               tasks=[p[2] for p in payloads])
        return list(vectors.cpu().numpy())


class Scorer:
    """A sequence-classification head (reranker or classifier) with fastbert inside: logits per text or pair."""

    def __init__(self, kind: Kind, head, tokenizer, max_batch_tokens: int):
        from ..modeling import BertModel

        self.kind, self.labels = kind.name, kind.labels
        self.head, self.max_batch_tokens = head, max_batch_tokens
        encoder = next(m for m in head.modules() if isinstance(m, BertModel))
        self.limit = min(tokenizer.model_max_length, encoder.embeddings.max_length)
        self.dtype = str(encoder.embeddings.word_embeddings.weight.dtype).replace("torch.", "")
        self.device = str(encoder.embeddings.word_embeddings.weight.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self._tokenizers = _Tokenizers(tokenizer)

    @classmethod
    def load(cls, kind: Kind, max_batch_tokens: int, device=None, dtype=None, kernels="auto",
             cuda_graphs=True) -> "Scorer":
        import transformers

        from ..patch import optimize

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        head = transformers.AutoModelForSequenceClassification.from_pretrained(
            kind.checkpoint, dtype=dtype if dtype is not None else "auto")
        head = optimize(head.to(device).eval(), kernels=kernels, cuda_graphs=cuda_graphs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(kind.checkpoint)
        return cls(kind, head, tokenizer, max_batch_tokens)

    @property
    def tokenizer(self):
        return self._tokenizers.tokenizer

    def prepare(self, inputs: Sequence, truncate: bool, direction: str, field: str) -> list:
        """Texts and (text, text_pair) pairs -> (ids, token types) per input."""
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
                payloads[i] = (row["ids"], row["types"])
        return payloads

    def run(self, payloads: Sequence) -> list:
        """[(ids, types)] -> logits (float32 numpy rows): the head over chunks whose padded rows stay within the
        token budget; its fastbert encoder computes the real tokens only."""
        lengths = [len(p[0]) for p in payloads]
        out: list = [None] * len(payloads)
        with torch.inference_mode():
            for chunk in plan_batches(lengths, self.max_batch_tokens, count_padding=True):
                input_ids, mask = padded([payloads[i][0] for i in chunk], self.pad_id)
                kwargs = {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}
                if payloads[chunk[0]][1] is not None:
                    kwargs["token_type_ids"] = padded([payloads[i][1] for i in chunk], 0)[0].to(self.device)
                logits = self.head(**kwargs).logits.float().cpu().numpy()
                for row, i in enumerate(chunk):
                    out[i] = logits[row]
        return out


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x.astype(np.float64)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x.astype(np.float64) - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)
