"""What a number format costs, measured against the same model's fp32 GEMMs on real text.

When a model loads in a format other than fp32 (quantize="bf16" / "int8"), it encodes a sample of texts twice, once
with the format's GEMMs and once with the fp32 weights it keeps, and reports the difference (`Quality`): logged once,
kept as `model.format_quality`, shown by the server's /info and by `python -m fastbert quality`. The texts are the
user's own (`quality_texts=`, `--quality-texts FILE`, one per line) or a built-in sample of 320 varied texts.

    embedders   min cos of the pooled vectors; neighbours: the share of fp32's ten nearest neighbours (cosine, among
                the sample) that the format keeps, over every text of the sample
    classifiers labels: the share of texts whose argmax label is fp32's
    rerankers   top1: the share of queries whose best passage is fp32's; order: the share of passage pairs ranked as
                fp32 ranks them
`mrr_at_10` scores a labelled retrieval task: the figure `python -m fastbert quality --pairs FILE` adds.

Each format has a bar per figure (`BARS`; docs/formats.md gives the reasons). A figure under its format's bar is not
only logged: it is a warning (`FormatQualityWarning`), so a format that costs more than it should is never silent.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Callable, Sequence

import torch

log = logging.getLogger("fastbert")

# The least each figure should be for a format that works (docs/formats.md, "Bars"): bf16 rounds each GEMM operand
# to 8 significant bits, int8 to 7 (and 8 for activations); the bars sit below what the bundled MiniLM measures on the
# built-in sample and well above what a format with one wrong scale gives.
BARS = {
    "bf16": dict(min_cos=0.9999, neighbours=0.99, labels=0.99, top1=0.95, order=0.99),
    "int8": dict(min_cos=0.99, neighbours=0.95, labels=0.97, top1=0.90, order=0.97),
}


class FormatQualityWarning(UserWarning):
    """A number format measured under its bar against fp32 on the quality texts."""

SAMPLE = os.path.join(os.path.dirname(__file__), "data", "quality_texts.txt")


def sample_texts() -> list[str]:
    """The built-in sample: 320 texts written for this measurement (queries, reviews, code, logs, clauses, several
    languages, paraphrase pairs)."""
    return read_texts(SAMPLE)


def read_texts(path) -> list[str]:
    """One text per non-empty line of a UTF-8 file."""
    with open(path, encoding="utf-8") as f:
        texts = [line.strip() for line in f if line.strip()]
    if len(texts) < 11:
        raise ValueError(f"{path}: {len(texts)} texts; measuring neighbours takes at least 11 (one per line)")
    return texts


@dataclasses.dataclass(frozen=True)
class Quality:
    """A format's cost against fp32 on `texts` texts (None where it does not apply to the model's kind)."""
    format: str
    kind: str  # "embedding", "classification" or "ranking"
    texts: int
    source: str  # "built-in sample" or the user's
    min_cos: float | None = None
    neighbours: float | None = None
    labels: float | None = None
    top1: float | None = None
    order: float | None = None
    seconds: float = 0.0

    def below_bar(self) -> dict:
        """{figure: (measured, bar)} for each figure under the format's bar (BARS)."""
        bars = BARS.get(self.format, {})
        return {name: (getattr(self, name), bar) for name, bar in bars.items()
                if getattr(self, name) is not None and getattr(self, name) < bar}

    def figures(self) -> dict:
        figures = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        figures["below_bar"] = sorted(self.below_bar())
        return figures

    def __str__(self) -> str:
        shown = [f"{name} {getattr(self, name):.5f}" for name in ("min_cos", "neighbours", "labels", "top1", "order")
                 if getattr(self, name) is not None]
        return f"{self.format} against fp32 on {self.texts} texts ({self.source}): {', '.join(shown)}"


def neighbours(reference: torch.Tensor, candidate: torch.Tensor, k: int = 10) -> float:
    """Mean share of each row's k nearest other rows (cosine) under `reference` that `candidate` keeps."""
    k = min(k, reference.shape[0] - 1)

    def nearest(v):
        v = torch.nn.functional.normalize(v.double(), dim=1)
        s = v @ v.T
        s.fill_diagonal_(-float("inf"))
        return s.topk(k, dim=1).indices

    a, b = nearest(reference), nearest(candidate)
    kept = (a.unsqueeze(2) == b.unsqueeze(1)).any(2).double().sum(1)
    return float(kept.mean() / k)


def min_cos(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(reference.double(), candidate.double(), dim=1).min())


def order_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    """Share of pairs (i, j) within each row ordered alike (scores [queries, passages])."""
    r = torch.sign(reference.unsqueeze(2) - reference.unsqueeze(1))
    c = torch.sign(candidate.unsqueeze(2) - candidate.unsqueeze(1))
    pairs = r != 0
    return float(((r == c) & pairs).sum() / pairs.sum().clamp_min(1))


def mrr_at_10(queries: torch.Tensor, documents: torch.Tensor, relevant: Sequence[int]) -> float:
    """Mean reciprocal rank (cut at 10) of each query's relevant document among all documents, by cosine."""
    q = torch.nn.functional.normalize(queries.double(), dim=1)
    d = torch.nn.functional.normalize(documents.double(), dim=1)
    top = (q @ d.T).topk(min(10, d.shape[0]), dim=1).indices
    hit = top == torch.as_tensor(list(relevant)).view(-1, 1)
    ranks = torch.where(hit.any(1), hit.double().argmax(1) + 1.0, torch.full((len(q),), float("inf")))
    return float((1.0 / ranks).mean())


@contextlib.contextmanager
def gemms_in(model, fmt):
    """Within the block, every fastbert encoder inside `model` runs its GEMMs in `fmt` (a formats.Format; None:
    on its own weights)."""
    from .modeling import BertModel
    encoders = [m for m in model.modules() if isinstance(m, BertModel)] if hasattr(model, "modules") else []
    saved = [m.__dict__.get("number_format") for m in encoders]
    try:
        for m in encoders:
            m.__dict__["number_format"] = fmt
        yield
    finally:
        for m, fmt in zip(encoders, saved):
            m.__dict__["number_format"] = fmt


def fp32_gemms(model):
    """Within the block, every fastbert encoder inside `model` runs its GEMMs on its own weights (no format)."""
    return gemms_in(model, None)


def calibrate(model, run: Callable[[list], torch.Tensor]) -> None:
    """The int8 format's outlier channels (formats.Int8), found once from the built-in sample run in fp32
    (`run`, as measure takes it): fixed texts, so the model's numbers never depend on the texts a user measures
    with. Formats without calibration are left as they are."""
    from . import formats
    from .modeling import BertModel
    for m in model.modules():
        fmt = m.__dict__.get("number_format") if isinstance(m, BertModel) else None
        if isinstance(fmt, formats.Int8) and not fmt.calibrated:
            recorder = formats.ChannelRecorder()
            with torch.inference_mode(), gemms_in(m, recorder):
                run(sample_texts())
            fmt.set_outliers(recorder.outliers())


def measure(model, run: Callable[[list], torch.Tensor], kind: str, texts: Sequence[str] | None = None,
            source: str | None = None) -> Quality:
    """`run(texts)` -> vectors [n, d] (embedding), logits [n, labels] (classification) or scores [queries,
    passages] (ranking; `run` builds its own pairs from the texts), computed by `model` in its format and again
    with fp32 GEMMs."""
    from .modeling import BertModel
    fmt = next((m.quantize for m in model.modules() if isinstance(m, BertModel)), "fp32")
    if texts is None:
        texts, source = sample_texts(), "built-in sample"
    texts = list(texts)
    started = time.perf_counter()
    calibrate(model, run)
    with torch.inference_mode():
        got = run(texts).float().cpu()
        with fp32_gemms(model):
            ref = run(texts).float().cpu()
    fields = {}
    if kind == "embedding":
        fields = dict(min_cos=min_cos(ref, got), neighbours=neighbours(ref, got))
    elif kind == "classification":
        fields = dict(labels=float((ref.argmax(1) == got.argmax(1)).double().mean()))
    elif kind == "ranking":
        fields = dict(top1=float((ref.argmax(1) == got.argmax(1)).double().mean()),
                      order=order_agreement(ref, got))
    else:
        raise ValueError(f"kind={kind!r} is not embedding, classification or ranking")
    quality = Quality(fmt, kind, len(texts), source or "the given texts", seconds=time.perf_counter() - started,
                      **fields)
    for m in model.modules():
        if isinstance(m, BertModel):
            m.__dict__["format_quality"] = quality
    log.warning("fastbert: %s (%.1f s)", quality, quality.seconds)
    below = quality.below_bar()
    if below:
        import warnings
        warnings.warn("fastbert: the " + quality.format + " format measures under its bar against fp32: "
                      + ", ".join(f"{k} {v:.5f} < {bar}" for k, (v, bar) in below.items())
                      + f" ({quality.texts} texts, {quality.source}); its results differ from fp32's more than "
                      "the format should make them", FormatQualityWarning, stacklevel=3)
    return quality


def quality_texts(option) -> tuple[list[str] | None, str | None]:
    """A surface's quality_texts option: None (the built-in sample), a path to a file, or a list of texts."""
    if option is None:
        return None, None
    if isinstance(option, (str, os.PathLike)):
        return read_texts(option), os.fspath(option)
    texts = [str(t) for t in option]
    if len(texts) < 11:
        raise ValueError(f"quality_texts: {len(texts)} texts; measuring neighbours takes at least 11")
    return texts, f"{len(texts)} given texts"


def reranker_pairs(texts: Sequence[str], passages: int = 8) -> tuple[list, list]:
    """Queries and passage pairs from a sample, for a reranker: each of the sample's questions (ending in "?", else
    every 8th text) with the `passages` texts after it. -> (pairs [(query, passage)], rows: number of queries)."""
    texts = list(texts)
    queries = [i for i, t in enumerate(texts) if t.endswith("?")] or list(range(0, len(texts), 8))
    pairs = [(texts[i], texts[(i + 1 + j) % len(texts)]) for i in queries for j in range(passages)]
    return pairs, len(queries)


def measure_transformers(model, tokenizer=None, texts_option=None) -> Quality | None:
    """The format cost of a transformers model with fastbert inside (fastbert.optimize): a sequence-classification
    head with one label is a reranker (each sample question against 8 passages), with more a classifier; anything
    else is an encoder whose mean-pooled last hidden states are compared. tokenizer None: the model's folder's."""
    import transformers
    if tokenizer is None:
        folder = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder) if os.path.isdir(folder) else None
        except (OSError, ValueError):
            tokenizer = None
    if tokenizer is None:
        import warnings
        warnings.warn("fastbert: the format's cost was not measured: no tokenizer was given and the model's folder "
                      "has none (optimize(..., tokenizer=))", stacklevel=3)
        return None
    device = next(model.parameters()).device
    head = type(model).__name__.endswith("ForSequenceClassification")
    kind = "embedding" if not head else ("ranking" if model.config.num_labels == 1 else "classification")

    def forward(first, second=None):
        batch = tokenizer(first, second, padding=True, truncation=True, max_length=256, return_tensors="pt")
        batch = {k: v.to(device) for k, v in batch.items()}
        out = model(**batch)
        if head:
            return out.logits
        h = out.last_hidden_state
        m = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        return (h * m).sum(1) / m.sum(1)

    def run(texts):
        if kind == "ranking":
            pairs, queries = reranker_pairs(texts)
            scores = torch.cat([forward([q for q, _ in pairs[i:i + 64]], [p for _, p in pairs[i:i + 64]])
                                for i in range(0, len(pairs), 64)])
            return scores.view(queries, -1)
        return torch.cat([forward(texts[i:i + 64]) for i in range(0, len(texts), 64)])

    texts, source = quality_texts(texts_option)
    return measure(model, run, kind, texts, source)
