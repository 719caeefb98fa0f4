"""`python -m fastbert serve` under an OpenAI-style load (bench/serve_load.py): 32 closed-loop clients sending
POST /v1/embeddings of 1..16 real texts, against fastbert.encode of the same texts offline (the serving overhead).
Every vector is checked against the offline ones before a run counts.

With --benchmark-disable (CI) a tiny load runs once (seconds): 4 clients, 12 requests drawn from 32 paragraphs,
the server started and stopped around it. Timed: 32 clients, 300 requests from 512 paragraphs, 3 rounds, each with
an offline encode of the same texts. The comparison with Infinity, one server up at a time, is
`python bench/serve_load.py --infinity PATH` (Infinity in a virtualenv of its own; bench/RESULTS.md).
"""
from __future__ import annotations

import os
import statistics

import pytest

from bench import harness
from bench.serve_load import fastbert_server, offline, plan, run_load, worst_cosine

pytest.importorskip("fastapi", reason="the serve extra (pip install -e '.[serve]')")
pytest.importorskip("httpx", reason="httpx is a test extra")

CORPUS, REQUESTS, CLIENTS, ROUNDS = 512, 300, 32, 3
CI_CORPUS, CI_REQUESTS, CI_CLIENTS = 32, 12, 4


# the number formats the server runs (--quantize): the served vectors are held to the format's load-time bar
# against fp32's (fastbert/quality.py); fp32's to fastbert.encode's
FORMAT_COSINE = {"fp32": 0.99999, "bf16": 0.9999, "int8": 0.99}


@pytest.mark.parametrize("quantize", list(FORMAT_COSINE))
def test_serve_openai_load_cpu(quantize, benchmark, tmp_path):
    if benchmark.disabled and quantize != "fp32":
        pytest.skip(f"--quantize {quantize}: timed only (tests/formats serves it: /info's report, the int8 vectors)")
    try:
        model_path = str(harness.minilm_path())
        texts = harness.corpus(CI_CORPUS if benchmark.disabled else CORPUS)
    except harness.Unavailable as e:
        pytest.skip(str(e))
    requests = plan(texts, CI_REQUESTS if benchmark.disabled else REQUESTS)
    clients = CI_CLIENTS if benchmark.disabled else CLIENTS
    flat = [texts[j] for r in requests for j in r]
    reference, _ = offline(model_path, texts)
    loads, rates, cosines = [], [], []

    def one_round():
        server = fastbert_server(str(tmp_path / f"server-{len(loads)}.log"),
                                 extra=("--device", "cpu", "--quantize", quantize))
        try:
            load = run_load(server.url, texts, requests, clients=clients)
        finally:
            code = server.stop()
        assert code == 0, open(server.log_path).read()[-3000:]
        cosine = worst_cosine(load.pop("vectors"), requests, reference)
        cosines.append(cosine)
        assert cosine >= FORMAT_COSINE[quantize], \
            f"a served {quantize} vector differs from fastbert.encode's fp32: cosine {cosine:.7f}"
        loads.append(load)
        if not benchmark.disabled:
            rates.append(offline(model_path, flat)[1])

    benchmark.group = f"serve: OpenAI-style load, minilm {quantize} cpu"
    benchmark.pedantic(one_round, rounds=1 if benchmark.disabled else ROUNDS, warmup_rounds=0)
    cosine_seen = min(cosines)
    median = lambda key: statistics.median(run[key] for run in loads)  # noqa: E731
    benchmark.extra_info.update(
        kind="serve", quantize=quantize, worst_cosine_vs_fp32=cosine_seen, texts=len(flat), requests=len(requests),
        clients=clients, rounds=len(loads),
        texts_per_s=median("texts_per_s"), p50_s=median("p50_s"), p99_s=median("p99_s"),
        round_texts_per_s=[run["texts_per_s"] for run in loads],
        offline_fp32_texts_per_s=statistics.median(rates) if rates else None,
        serving_over_offline_fp32=median("texts_per_s") / statistics.median(rates) if rates else None,
        cpu=harness.cpu_model(), cpu_count=os.cpu_count(), load_avg_1min=os.getloadavg()[0])
