"""A serving benchmark: an OpenAI-style embedding load against a live server, and the interleaved comparison of
`python -m fastbert serve` with Infinity (infinity-emb, its torch engine) on the same machine.

    python bench/serve_load.py --infinity PATH/TO/infinity_emb [--rounds 3] [--requests 300] [--out DIR]

The load: `clients` closed-loop clients (32), each sending its next request as soon as the last is answered, until
`requests` (300) have been sent; a request is POST /v1/embeddings (OpenAI's body, encoding_format float) of 1..16
texts drawn at random (seed 0) from real paragraphs of varied length (bench/harness.py's corpus: the
installed distributions' descriptions and licences). Figures per run: texts/s (all texts / wall time from the first
request to the last answer), and each request's latency (sent to answer read) at p50 and p99.

The comparison: one server up at a time, each started fresh in its own process and stopped before the other
starts; rounds alternate fastbert, Infinity, fastbert, ... (so a burst of other work on a shared machine lands on
both); fastbert.encode of the same texts offline, in this process, once per round. Every vector a server returns is
checked against the offline ones (cosine) before its run counts. fastbert runs with --auto-truncate, so a paragraph
past the model's 256 tokens is cut there, as Infinity and sentence-transformers cut it.
Results: DIR/serve.json (every run), a table on stdout.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `python bench/serve_load.py` puts bench/ first; the package needs the repo root

import numpy as np  # noqa: E402

MODEL_NAME = "all-MiniLM-L6-v2"


def plan(corpus: list, requests: int, seed: int = 0, most: int = 16) -> list:
    """`requests` lists of 1..most indices into the corpus (uniform sizes, texts drawn without repeats in a
    request)."""
    rng = random.Random(seed)
    return [rng.sample(range(len(corpus)), rng.randint(1, most)) for _ in range(requests)]


def run_load(url: str, corpus: list, requests: list, clients: int = 32, model: str = MODEL_NAME,
             headers: dict | None = None, timeout: float = 600.0) -> dict:
    """The closed-loop load against url + /v1/embeddings -> {"texts", "wall_s", "texts_per_s", "latency_s" (one per
    request), "p50_s", "p99_s", "vectors" (per request, float32 [texts, dim])}. Raises on any answer that is not a
    200 with one vector per text."""
    import httpx

    next_request, lock = iter(range(len(requests))), threading.Lock()
    latency, vectors, errors = [None] * len(requests), [None] * len(requests), []

    def client():
        with httpx.Client(timeout=timeout, headers=headers) as http:
            while True:
                with lock:
                    i = next(next_request, None)
                if i is None or errors:
                    return
                body = {"input": [corpus[j] for j in requests[i]], "model": model, "encoding_format": "float"}
                sent = time.perf_counter()
                try:
                    response = http.post(url + "/v1/embeddings", json=body)
                    data = response.json()["data"] if response.status_code == 200 else None
                except Exception as e:  # noqa: BLE001 - reported after the run
                    errors.append(f"request {i}: {type(e).__name__}: {e}")
                    return
                latency[i] = time.perf_counter() - sent
                if data is None or len(data) != len(requests[i]):
                    errors.append(f"request {i}: {response.status_code} {response.text[:300]}")
                    return
                vectors[i] = np.array([d["embedding"] for d in sorted(data, key=lambda d: d["index"])],
                                      dtype=np.float32)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]}")
    texts = sum(len(r) for r in requests)
    return {"texts": texts, "requests": len(requests), "clients": clients, "wall_s": wall,
            "texts_per_s": texts / wall, "latency_s": latency, "p50_s": float(np.percentile(latency, 50)),
            "p99_s": float(np.percentile(latency, 99)), "vectors": vectors}


def worst_cosine(got: list, requests: list, offline: np.ndarray) -> float:
    """The lowest cosine between a returned vector and the offline vector of its text."""
    worst = 1.0
    for indices, vectors in zip(requests, got):
        want = offline[indices]
        cos = (vectors * want).sum(1) / (np.linalg.norm(vectors, axis=1) * np.linalg.norm(want, axis=1))
        worst = min(worst, float(cos.min()))
    return worst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process, ready when GET /health answers 200; stopped with SIGTERM (SIGKILL after 60 s)."""

    def __init__(self, command: list, url: str, log_path: str, env: dict | None = None, timeout: float = 600.0):
        import httpx
        self.url, self.log_path = url, log_path
        self.log = open(log_path, "w")
        started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[0]} exited with {self.process.returncode}; see {log_path}")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() - started > timeout:
                self.stop()
                raise RuntimeError(f"{command[0]} was not ready within {timeout:.0f} s; see {log_path}")
            time.sleep(0.2)
        self.ready_s = time.perf_counter() - started

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode


def thread_env(threads: int | None) -> dict:
    """The environment that gives a server process `threads` CPU threads for torch (OpenMP and MKL); {}: its own
    default (one per core)."""
    return {} if threads is None else {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def fastbert_server(log_path: str, extra: tuple = (), threads: int | None = None) -> Server:
    """`python -m fastbert serve` (the bundled model) on a free port, as users start it, cut at the model's limit."""
    port = free_port()
    return Server([sys.executable, "-m", "fastbert", "serve", "--port", str(port), "--auto-truncate",
                   "--log-level", "warning", *extra], f"http://127.0.0.1:{port}", log_path,
                  env={"TRITON_INTERPRET": "0", **thread_env(threads)})


def infinity_server(command: str, model_path: str, log_path: str, threads: int | None = None) -> Server:
    """Infinity's v2 command on the same folder, torch engine, CPU, fp32, served under the same name, OpenAI's
    routes under /v1, its defaults otherwise (batches of up to 32 texts, sorted by length); its usage reports off."""
    port = free_port()
    return Server([command, "v2", "--model-id", model_path, "--served-model-name", MODEL_NAME, "--engine", "torch",
                   "--device", "cpu", "--dtype", "float32", "--port", str(port), "--url-prefix", "/v1"],
                  f"http://127.0.0.1:{port}", log_path,
                  env={"DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", **thread_env(threads)})


def offline(model_path: str, texts: list, threads: int | None = None) -> tuple[np.ndarray, float]:
    """fastbert.encode of the texts in this process: (vectors, texts/s), the model loaded before the clock starts;
    the CPU path users get (the twins: kernels "torch", whatever TRITON_INTERPRET says in this process)."""
    import torch

    import fastbert
    if threads is not None:
        torch.set_num_threads(threads)
    encoder = fastbert.SentenceEncoder.from_pretrained(model_path, device="cpu", kernels="torch")
    encoder.encode(texts[:8], progress=False)
    started = time.perf_counter()
    vectors = encoder.encode(texts, progress=False)
    return vectors, len(texts) / (time.perf_counter() - started)


def summary(runs: list) -> dict:
    by = {}
    for run in runs:
        by.setdefault(run["server"], []).append(run)
    return {name: {"texts_per_s": statistics.median(r["texts_per_s"] for r in rs),
                   "p50_s": statistics.median(r["p50_s"] for r in rs),
                   "p99_s": statistics.median(r["p99_s"] for r in rs), "rounds": len(rs)}
            for name, rs in by.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve_load.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--infinity", required=True, metavar="PATH", help="Infinity's infinity_emb command (in a "
                        "virtualenv of its own: it pins older transformers / sentence-transformers)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--corpus", type=int, default=512, help="paragraphs the requests draw from")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch in every server and the "
                        "offline encode (OMP_NUM_THREADS / MKL_NUM_THREADS; default: each process's own, one per "
                        "core). On a machine other jobs share, a team of threads whose cores are taken spins at "
                        "every barrier: 1 keeps the comparison about the servers")
    parser.add_argument("--out", default="serve-results")
    args = parser.parse_args(argv)
    from bench import harness

    os.makedirs(args.out, exist_ok=True)
    model_path = str(harness.minilm_path())
    texts = harness.corpus(args.corpus)
    requests = plan(texts, args.requests)
    flat = [texts[j] for r in requests for j in r]
    reference, _ = offline(model_path, texts, args.threads)
    runs, offline_runs = [], []
    for round_ in range(args.rounds):
        for name in ("fastbert", "infinity"):
            log = os.path.join(args.out, f"{name}-{round_}.log")
            server = fastbert_server(log, threads=args.threads) if name == "fastbert" else \
                infinity_server(args.infinity, model_path, log, threads=args.threads)
            try:
                load = run_load(server.url, texts, requests, clients=args.clients)
            finally:
                server.stop()
            cosine = worst_cosine(load.pop("vectors"), requests, reference)
            if cosine < 0.9999:
                raise RuntimeError(f"{name}: a vector differs from fastbert.encode's (cosine {cosine:.6f}); not timed")
            load.update(server=name, round=round_, ready_s=server.ready_s, worst_cosine=cosine,
                        load_avg_1min=os.getloadavg()[0])
            runs.append(load)
            print(f"round {round_} {name:9s} {load['texts_per_s']:7.1f} texts/s  p50 {load['p50_s']:6.2f} s  "
                  f"p99 {load['p99_s']:6.2f} s  (load avg {load['load_avg_1min']:.1f})", flush=True)
        _, rate = offline(model_path, flat, args.threads)
        offline_runs.append(rate)
        print(f"round {round_} offline   {rate:7.1f} texts/s (fastbert.encode, the same {len(flat)} texts)",
              flush=True)
    table = summary(runs)
    table["offline"] = {"texts_per_s": statistics.median(offline_runs), "rounds": len(offline_runs)}
    versions = {}
    for package in ("torch", "transformers", "sentence-transformers", "fastapi", "uvicorn"):
        try:
            from importlib.metadata import version
            versions[package] = version(package)
        except Exception:  # noqa: BLE001
            versions[package] = None
    infinity_version = subprocess.run([os.path.join(os.path.dirname(args.infinity), "pip"), "show", "infinity-emb"],
                                      capture_output=True, text=True).stdout
    infinity_version = next((line.split(":", 1)[1].strip() for line in infinity_version.splitlines()
                             if line.startswith("Version:")), "unknown")
    record = {"summary": table, "runs": runs, "offline_texts_per_s": offline_runs, "texts": len(flat),
              "tokens_cap": 256, "threads": args.threads, "requests": args.requests, "clients": args.clients,
              "corpus": args.corpus,
              "cpu": harness.cpu_model(), "cpu_count": os.cpu_count(), "versions": versions,
              "infinity_emb": infinity_version}
    with open(os.path.join(args.out, "serve.json"), "w") as f:
        json.dump(record, f, indent=1)
    f_, i_ = table["fastbert"], table["infinity"]
    print(json.dumps(table, indent=1))
    print(f"fastbert / Infinity: {f_['texts_per_s'] / i_['texts_per_s']:.2f}x texts/s; "
          f"p99 {f_['p99_s']:.2f} s vs {i_['p99_s']:.2f} s; "
          f"fastbert serve / offline: {f_['texts_per_s'] / table['offline']['texts_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
