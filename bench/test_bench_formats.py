"""The number formats on CPU: fastbert.encode in fp32, bf16 and int8 (quantize=) against sentence-transformers'
backends (torch fp32 here; ONNX, ONNX dynamic int8, OpenVINO and OpenVINO static int8 from a virtualenv of their
own, bench/peers.py), the bundled all-MiniLM-L6-v2, one engine per cell, each with its quality columns.

Speed: texts/s of a corpus of real paragraphs (harness.corpus: the installed distributions' descriptions and
licences, 1,500 texts), the median of ROUNDS rounds after a warm-up, each engine with its defaults (fastbert:
padding-free batches of 16,384 tokens; sentence-transformers: batches of 32).
Quality, every engine against sentence-transformers' torch fp32 vectors of the same texts:
  - min cos over the corpus;
  - neighbours: recall@10 of fp32's ten nearest neighbours (cosine, among the whole corpus) for its first 200 texts;
  - MRR@10 on a labelled retrieval task of real text (harness.retrieval_task: each installed Debian package's and
    Python distribution's one-line summary searches all their long descriptions for its own), as a share of fp32's.
The bars (docs/formats.md): bf16 >= 0.9999 min cos and >= 0.995 neighbours; int8 >= 0.99 of fp32's MRR@10 and
>= 0.97 neighbours. They are recorded (extra_info "bars_met"), not asserted: a cell measures.
With --benchmark-disable (CI) each fastbert cell runs once on 48 texts and a 40-query task and must stay within
the format's load-time bar (fastbert/quality.py); the peers' cells skip there (FASTBERT_PEERS=1 runs them), and
anywhere their venv is absent (`python bench/peers.py install` builds it), saying why.
"""
from __future__ import annotations

import os
import statistics
import time

import numpy as np
import pytest
import torch

from bench import harness, peers

ENGINES = ("fastbert-fp32", "fastbert-bf16", "fastbert-int8", "st-torch", *peers.ENGINES)
TEXTS, CI_TEXTS = 1500, 48
QUERIES, CI_QUERIES = None, 40  # None: every pair of the task
NEIGHBOUR_ROWS = 200
ROUNDS = 2
BARS = {"bf16": dict(min_cos=0.9999, neighbours=0.995), "int8": dict(mrr_ratio=0.99, neighbours=0.97)}


def neighbour_recall(reference: np.ndarray, candidate: np.ndarray, rows: int, k: int = 10) -> float:
    """Share of the reference's k nearest neighbours (cosine, among all rows, itself excluded) of each of the
    first `rows` rows that the candidate's k nearest keep."""
    def nearest(v):
        v = torch.nn.functional.normalize(torch.from_numpy(v).double(), dim=1)
        s = v[:rows] @ v.T
        s[torch.arange(rows), torch.arange(rows)] = -float("inf")
        return s.topk(k, dim=1).indices
    a, b = nearest(reference), nearest(candidate)
    return float((a.unsqueeze(2) == b.unsqueeze(1)).any(2).double().mean())


def mrr(vectors_q: np.ndarray, vectors_d: np.ndarray, relevant: list[int]) -> float:
    from fastbert.quality import mrr_at_10
    return mrr_at_10(torch.from_numpy(vectors_q), torch.from_numpy(vectors_d), relevant)


@pytest.fixture(scope="module")
def workload(request):
    disabled = request.config.getoption("benchmark_disable", False)
    st = pytest.importorskip("sentence_transformers")
    try:
        path = str(harness.minilm_path())
        texts = harness.corpus(CI_TEXTS if disabled else TEXTS)
        queries, documents, relevant = harness.retrieval_task(CI_QUERIES if disabled else QUERIES)
    except harness.Unavailable as e:
        pytest.skip(str(e))
    fp32 = st.SentenceTransformer(path, device="cpu")
    encode = lambda rows: fp32.encode(rows, batch_size=32, convert_to_numpy=True)  # noqa: E731
    reference = {"corpus": encode(texts), "queries": encode(queries), "documents": encode(documents)}
    return dict(path=path, texts=texts, task=(queries, documents, relevant), reference=reference, disabled=disabled)


def fastbert_engine(fmt: str, path: str):
    import fastbert
    encoder = fastbert.SentenceEncoder.from_pretrained(path, device="cpu", kernels="torch",
                                                       quantize=None if fmt == "fp32" else fmt)
    return encoder, lambda rows: encoder.encode(rows, progress=False)


def in_process(encode, texts: list[str], rounds: int) -> tuple[np.ndarray, list[float]]:
    vectors = encode(texts)  # the warm-up (and the vectors the quality columns take)
    seconds = []
    for _ in range(rounds):
        started = time.perf_counter()
        encode(texts)
        seconds.append(time.perf_counter() - started)
    return vectors, seconds


@pytest.mark.parametrize("engine", ENGINES)
def test_formats_encode_cpu(engine, workload, benchmark, tmp_path_factory):
    path, texts, (queries, documents, relevant) = workload["path"], workload["texts"], workload["task"]
    rounds = 1 if workload["disabled"] else ROUNDS
    info: dict = dict(kind="formats", engine=engine, model="minilm", device="cpu", texts=len(texts),
                      queries=len(queries), documents=len(documents), cpu=harness.cpu_model(),
                      cpu_count=os.cpu_count(), torch=torch.__version__)
    report = None
    if engine.startswith("fastbert-"):
        fmt = engine.split("-", 1)[1]
        encoder, encode = fastbert_engine(fmt, path)
        report = encoder.format_quality
        run = lambda: in_process(encode, texts, rounds)  # noqa: E731
        task = (encode(queries), encode(documents))
    elif engine == "st-torch":
        import sentence_transformers
        st = sentence_transformers.SentenceTransformer(path, device="cpu")
        encode = lambda rows: st.encode(rows, batch_size=32, convert_to_numpy=True)  # noqa: E731
        run = lambda: in_process(encode, texts, rounds)  # noqa: E731
        task = (encode(queries), encode(documents))
    else:
        why = None
        if workload["disabled"] and not os.environ.get("FASTBERT_PEERS"):
            why = "the peers run in the timed benchmark (without --benchmark-disable), or with FASTBERT_PEERS=1"
        why = why or peers.unavailable()
        if why:
            pytest.skip(f"{engine}: {why}")
        work = tmp_path_factory.mktemp(engine)

        def run():
            out = peers.encode(engine, path, texts, rounds, work)
            info.update(peer_versions=out["versions"], peer_notes=out["notes"])
            return out["vectors"], out["seconds"]
        task = (peers.encode(engine, path, queries, 0, work)["vectors"],
                peers.encode(engine, path, documents, 0, work)["vectors"])

    timed = {}

    def one_round():
        timed["vectors"], timed["seconds"] = run()

    benchmark.group = "formats: encode a corpus, minilm cpu"
    benchmark.pedantic(one_round, rounds=1, warmup_rounds=0)
    vectors, seconds = timed["vectors"].astype(np.float32), timed["seconds"]
    ref = workload["reference"]
    cos = (harness.one_minus_cosine(vectors, ref["corpus"]))
    mrr_fp32 = mrr(ref["queries"], ref["documents"], relevant)
    figures = dict(min_cos=float(1 - cos.max()),
                   neighbours=neighbour_recall(ref["corpus"], vectors, min(NEIGHBOUR_ROWS, len(texts))),
                   mrr_at_10=mrr(*task, relevant), mrr_at_10_fp32=mrr_fp32)
    figures["mrr_ratio"] = figures["mrr_at_10"] / mrr_fp32
    fmt = "int8" if "int8" in engine else "bf16" if engine in ("fastbert-bf16", "st-openvino") else None
    median = statistics.median(seconds) if seconds else float("nan")
    info.update(figures, rounds=len(seconds), round_s=seconds, texts_per_s=len(texts) / median,
                load_avg_1min=os.getloadavg()[0],
                bars=BARS.get(fmt), bars_met=None if fmt is None else all(
                    figures[k] >= v for k, v in BARS[fmt].items()),
                load_report=None if report is None else report.figures())
    benchmark.extra_info.update(info)
    if engine.startswith("fastbert-") and workload["disabled"]:
        # CI: each format within its load-time bar (fastbert/quality.py) on the corpus too; fp32 is
        # sentence-transformers' own vectors
        from fastbert.quality import BARS as LOAD_BARS
        fmt = engine.split("-", 1)[1]
        assert figures["min_cos"] >= (1 - 1e-5 if fmt == "fp32" else LOAD_BARS[fmt]["min_cos"]), figures
        assert figures["min_cos"] < 1 - 1e-7 or fmt == "fp32", figures  # the format ran
