"""Encoding a corpus on Ray: rows/s of fastbert.encode_dataset with 1 and 2 actors, and what each actor costs before
its first row (start-up and model load), next to single-process fastbert.encode on the same texts, in one run.

The cluster is local (ray.init(num_cpus=2), no dashboard), started once for the module; the time it took is in
every case's extra_info. The corpus is the encode benchmark's (bench/harness.py: corpus): paragraphs of the
descriptions and licence files of the installed distributions, real text no one here wrote, one a line in a .txt
file. Every variant's output is checked against single-process fastbert.encode (same ids in the same order,
cosine >= 0.99999 row by row) before anything is timed.

One round = one whole job into a fresh output folder: actors start, load the model, encode, write their shards;
the headline is rows / wall time of that call. extra_info splits it: per actor, ready_s (from submitting the work
to the model loaded) and load_s (the model load inside it), and its rows/s while encoding (rows / busy seconds).
Sizing a cluster: a job takes about max(ready_s) + rows / (actors x busy rows/s).

With --benchmark-disable (CI) a small slice of the corpus runs once per variant, checked the same way.
"""
from __future__ import annotations

import os
import shutil
import statistics
import time

import pytest

from bench import harness, procs

ray = pytest.importorskip("ray", reason="Ray Data is an optional extra (pip install -e '.[ray]')")
pytestmark = pytest.mark.xdist_group("ray")  # a local Ray cluster, one worker at a time

TEXTS, CI_TEXTS = 512, 24
ROWS_PER_SHARD = 32
ROUNDS = 3
# (name, actors, CPUs = torch threads per actor); None: single-process fastbert.encode with torch's own threads
VARIANTS = [("single-process", None, None), ("1 worker x 1 CPU", 1, 1), ("2 workers x 1 CPU", 2, 1),
            ("1 worker x 2 CPUs", 1, 2)]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster for the module (bench.procs.local_ray_cluster), yielding the seconds it took to start."""
    import ray.data  # noqa: F401
    started = time.perf_counter()
    with procs.local_ray_cluster():
        yield time.perf_counter() - started


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory, benchmark_disabled):
    try:
        texts = harness.corpus(CI_TEXTS if benchmark_disabled else TEXTS)
    except harness.Unavailable as e:
        pytest.skip(str(e))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path, texts


@pytest.fixture(scope="module")
def benchmark_disabled(request):
    return bool(request.config.getoption("benchmark_disable", default=False))


@pytest.fixture(scope="module")
def reference(texts_file):
    import fastbert

    try:
        path = str(harness.minilm_path())
    except harness.Unavailable as e:
        pytest.skip(str(e))
    return path, fastbert.encode(path, texts_file[1], device="cpu", kernels="torch", progress=False)


@pytest.mark.parametrize("name, actors, cpus", VARIANTS, ids=[v[0].replace(" ", "") for v in VARIANTS])
def test_encode_dataset_cpu(name, actors, cpus, cluster, texts_file, reference, benchmark, tmp_path):
    import fastbert

    path, texts = texts_file
    model, expected = reference
    rows = len(texts)
    out = tmp_path / "out"
    results, walls, loads = [], [], []

    def job():
        if out.exists():
            shutil.rmtree(out)
        loads.append(os.getloadavg()[0])
        started = time.perf_counter()
        if actors is None:
            emb = fastbert.encode(model, texts, device="cpu", kernels="torch", progress=False)  # loads the model too
            walls.append(time.perf_counter() - started)
            return emb
        result = fastbert.encode_dataset(model, path, out, rows_per_shard=ROWS_PER_SHARD, workers=actors,
                                         cpus_per_worker=cpus, kernels="torch", progress=False)
        walls.append(time.perf_counter() - started)
        results.append(result)
        return fastbert.load_embeddings(out)[1]

    def check(emb):  # the same rows in the same order, each vector the single-process one
        if actors is not None:
            ids, _ = fastbert.load_embeddings(out)
            assert ids == [f"corpus.txt:{i}" for i in range(1, rows + 1)]
            assert results[-1].written == results[-1].shards == -(-rows // ROWS_PER_SHARD)
        error = float(harness.one_minus_cosine(emb, expected).max())
        assert emb.shape == expected.shape and error <= 1 - harness.COSINE, f"1 - cosine = {error:.3g}; not timed"
        return error

    benchmark.group = "encode a corpus on Ray: minilm fp32 cpu"
    if benchmark.disabled:  # one untimed run, checked
        error = check(benchmark.pedantic(job, rounds=1))
        kept = 1
    else:  # checked before timing
        error = check(job())
        benchmark.pedantic(job, rounds=ROUNDS, warmup_rounds=0)
        kept = ROUNDS
    timed = walls[-kept:]
    median = statistics.median(timed)
    info = dict(kind="ray-encode", variant=name, actors=actors, cpus_per_actor=cpus, rows=rows,
                rows_per_shard=ROWS_PER_SHARD, rounds=len(timed), round_s=timed, median_s=median,
                rows_per_s=rows / median, max_one_minus_cosine=error, ray_init_s=cluster, load_avg_1min=loads,
                cpu=harness.cpu_model(), cpu_count=os.cpu_count(), ray=ray.__version__)
    if actors is not None:
        runs = results[-kept:]
        per_actor = [w for r in runs for w in r.workers]
        info.update(
            actors_seen=[len(r.workers) for r in runs],
            ready_s=[round(w["ready_s"], 2) for w in per_actor],
            load_s=[round(w["load_s"], 2) for w in per_actor],
            busy_rows_per_s=[round(w["rows"] / w["busy_s"], 1) for w in per_actor],
            run_s=[round(r.run_seconds, 2) for r in runs],
            median_ready_s=statistics.median(w["ready_s"] for w in per_actor),
            median_load_s=statistics.median(w["load_s"] for w in per_actor),
            median_busy_rows_per_s_per_actor=statistics.median(w["rows"] / w["busy_s"] for w in per_actor),
            # the pool's rate once its actors are up: the sum of its actors' rates while encoding, per run
            steady_rows_per_s=statistics.median(sum(w["rows"] / w["busy_s"] for w in r.workers) for r in runs))
    benchmark.extra_info.update(info)
