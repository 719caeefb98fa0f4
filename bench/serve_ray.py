"""Serving on Ray: the OpenAI-style load of bench/serve_load.py against the server as a Ray Serve deployment with 1
and 2 CPU replicas, next to the single process, on one local Ray cluster, in interleaved rounds.

    python bench/serve_ray.py [--rounds 3] [--requests 300] [--clients 32] [--out DIR]
    python bench/serve_ray.py --memory [--out DIR]      what one server process holds, step by step

The load is serve_load.py's, unchanged: `clients` closed-loop clients (32), `requests` (300) POST /v1/embeddings of
1..16 texts drawn (seed 0) from 512 real paragraphs, encoding_format float; texts/s = all texts / wall time, and
each request's latency at p50 and p99. Every vector is checked against fastbert.encode offline before a run counts.

The contenders, each deployed fresh and removed before the next, rounds alternating 1 replica, 2 replicas, single:
  ray-1       fastbert.serve.ray.deployment(replicas=1), a replica of 1 CPU (one torch thread)
  ray-2       the same with replicas=2 (one torch thread each)
  single      `python -m fastbert serve` (serve_load.py's fastbert_server) with one torch thread
All on a local cluster started here (ray.init(num_cpus=2), no dashboard), with Ray Serve's proxy on 127.0.0.1. Per
run, the CPU seconds each process took during the load (/proc: the replicas, Ray Serve's proxy and controller, the
single server, and this process, whose threads are the clients) and each replica's memory after it (RSS, and USS:
the pages no other process shares); before the rounds, the CPU per text of tokenizing and of fastbert.encode in
this process (one torch thread), from which the serving work per text follows. Results: DIR/serve-ray.json (every
run), a table on stdout. --memory: one server process's memory after its imports, with the model, and after a
batch of the whole token budget (DIR/memory.json).

Not under `pytest bench/ --benchmark-disable`: a Ray cluster and one loaded replica take 10-30 s to start on the
2-core machine before the first request, and tests/serve/test_serve_ray.py already runs this deployment under load
in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)  # `python bench/serve_ray.py` puts bench/ first; the package needs the repo root

from bench import procs  # noqa: E402 - after the repo root is on the path

# each process of ours: a replica, Ray Serve's proxy and controller, the single server (their command lines)
PROCESSES = {"replica": "ray::ServeReplica:fastbert:Server", "proxy": "ray::ProxyActor",
             "controller": "ray::ServeController", "single": "-m fastbert serve"}


def processes() -> dict:
    """{pid: role} of this run's processes named in PROCESSES that run now."""
    found = {}
    for pid, line in procs.command_lines().items():
        for role, mark in PROCESSES.items():
            if (line.startswith(mark) or (role == "single" and mark in line)) and procs.descends_from(pid):
                found[pid] = role
    return found


def memory(pid: int) -> dict:
    """RSS and USS (MiB) of a process."""
    import psutil
    info = psutil.Process(pid).memory_full_info()
    return {"rss_mib": info.rss / 2 ** 20, "uss_mib": info.uss / 2 ** 20}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured(run_load, url, texts, requests, clients) -> dict:
    """The load, with each of our processes' CPU seconds over it (this process's: the clients)."""
    pids = processes()
    before = {pid: procs.cpu_seconds(pid) for pid in pids}
    own = time.process_time()
    load = run_load(url, texts, requests, clients=clients)
    cpu = {}
    for pid, role in pids.items():
        cpu.setdefault(role, []).append(procs.cpu_seconds(pid) - before[pid])
    load["cpu_s"] = {role: sum(v) for role, v in cpu.items()}
    load["cpu_s"]["clients"] = time.process_time() - own
    load["cpu_s_per_replica"] = cpu.get("replica", [])
    load["memory"] = {role: [memory(pid) for pid, r in pids.items() if r == role]
                      for role in ("replica", "single", "proxy") if role in pids.values()}
    return load


def host_costs(model_path: str, texts: list) -> dict:
    """CPU milliseconds per text, in this process with one torch thread: the tokenizer alone (what a GPU replica
    still does on its host) and fastbert.encode whole (tokenizing, the forward, pooling), the model loaded first."""
    import torch

    import fastbert
    encoder = fastbert.SentenceEncoder.from_pretrained(model_path, device="cpu", kernels="torch")
    torch.set_num_threads(1)
    encoder.encode(texts[:8], progress=False)
    started = time.process_time()
    encoder.tokenizer(texts, truncation=True, max_length=encoder.pipeline.max_seq_length)
    tokenize = time.process_time() - started
    started = time.process_time()
    encoder.encode(texts, progress=False)
    encode = time.process_time() - started
    return {"tokenize_cpu_ms_per_text": 1e3 * tokenize / len(texts),
            "encode_cpu_ms_per_text": 1e3 * encode / len(texts)}


# What a replica's memory is made of, step by step, in a fresh process of its own: its imports, the model loaded by
# the app, then after its largest batch (the whole 16,384-token budget in one forward).
BREAKDOWN = """
import json, os, sys, time, psutil
def mib():
    info = psutil.Process().memory_full_info()
    return {"rss_mib": info.rss / 2 ** 20, "uss_mib": info.uss / 2 ** 20}
steps = {"python": mib()}
import torch, transformers, fastapi, ray, ray.serve
import fastbert.serve
torch.set_num_threads(1)
steps["imports (torch, transformers, fastbert.serve, ray.serve)"] = mib()
from fastapi.testclient import TestClient
from bench import harness
api = fastbert.serve.app(harness.minilm_path(), device="cpu", kernels="torch", auto_truncate=True)
texts = harness.corpus(512)
with TestClient(api) as client:
    while client.get("/health").status_code != 200:
        time.sleep(0.05)
    steps["model loaded (the app's lifespan: weights, tokenizer, warm-up)"] = mib()
    service = api.state.service
    payloads = service.model.prepare(texts, "", None, True, "right", "inputs")
    batch, tokens = [], 0
    for p in sorted(payloads, key=lambda p: -len(p[0])):
        if tokens + len(p[0]) <= 16384:
            batch.append(p)
            tokens += len(p[0])
    service.model.run(batch)
    steps[f"after one batch of {tokens} real tokens ({len(batch)} texts)"] = mib()
print(json.dumps(steps))
"""


def memory_breakdown() -> dict:
    """BREAKDOWN in a child process (this one has loaded other things): {step: {rss_mib, uss_mib}}."""
    import subprocess
    out = subprocess.run([sys.executable, "-c", BREAKDOWN], capture_output=True, text=True, cwd=REPO, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0", "HF_HUB_OFFLINE": "1"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/serve_ray.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--corpus", type=int, default=512, help="paragraphs the requests draw from")
    parser.add_argument("--out", default="serve-ray-results")
    parser.add_argument("--memory", action="store_true", help="only the memory breakdown of one server process "
                        "(DIR/memory.json)")
    args = parser.parse_args(argv)
    if args.memory:
        os.makedirs(args.out, exist_ok=True)
        steps = memory_breakdown()
        with open(os.path.join(args.out, "memory.json"), "w") as f:
            json.dump(steps, f, indent=1)
        for step, m in steps.items():
            print(f"{m['rss_mib']:7.0f} MiB RSS {m['uss_mib']:7.0f} MiB USS  {step}")
        return 0

    import ray
    from ray import serve

    from bench import harness
    from bench.serve_load import fastbert_server, offline, plan, run_load, worst_cosine
    from fastbert.serve import ray as on_ray

    os.makedirs(args.out, exist_ok=True)
    model_path = str(harness.minilm_path())
    texts = harness.corpus(args.corpus)
    requests = plan(texts, args.requests)
    reference, _ = offline(model_path, texts, threads=1)
    flat = [texts[j] for r in requests for j in r]
    host = host_costs(model_path, flat)
    print(f"CPU per text in one process: tokenizing {host['tokenize_cpu_ms_per_text']:.3f} ms, fastbert.encode "
          f"(1 thread, tokenizing included) {host['encode_cpu_ms_per_text']:.2f} ms", flush=True)
    started = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cluster_s = time.perf_counter() - started
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    runs = []
    try:
        for round_ in range(args.rounds):
            for name in ("ray-1", "ray-2", "single"):
                started = time.perf_counter()
                if name == "single":
                    server = fastbert_server(os.path.join(args.out, f"single-{round_}.log"),
                                             extra=("--device", "cpu", "--kernels", "torch"), threads=1)
                    target = server.url
                else:
                    replicas = int(name[-1])
                    serve.run(on_ray.deployment(replicas=replicas, cpus_per_replica=1, device="cpu", kernels="torch",
                                                auto_truncate=True, log_level="warning"),
                              name=on_ray.APP_NAME, route_prefix="/")
                    target = url
                ready_s = time.perf_counter() - started
                try:
                    load = measured(run_load, target, texts, requests, args.clients)
                finally:
                    if name == "single":
                        server.stop()
                    else:
                        serve.delete(on_ray.APP_NAME)
                cosine = worst_cosine(load.pop("vectors"), requests, reference)
                if cosine < 0.9999:
                    raise RuntimeError(f"{name}: a vector differs from fastbert.encode's (cosine {cosine:.6f})")
                load.update(server=name, round=round_, ready_s=ready_s, worst_cosine=cosine,
                            load_avg_1min=os.getloadavg()[0])
                runs.append(load)
                cpu = ", ".join(f"{role} {seconds:.1f}" for role, seconds in sorted(load["cpu_s"].items()))
                print(f"round {round_} {name:7s} {load['texts_per_s']:6.1f} texts/s  p50 {load['p50_s']:5.2f} s  "
                      f"p99 {load['p99_s']:5.2f} s  ready {ready_s:4.1f} s  wall {load['wall_s']:5.1f} s  "
                      f"CPU s: {cpu}  (load avg {load['load_avg_1min']:.1f})", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    table = {}
    for name in ("ray-1", "ray-2", "single"):
        mine = [r for r in runs if r["server"] == name]
        table[name] = {key: statistics.median(r[key] for r in mine) for key in ("texts_per_s", "p50_s", "p99_s",
                                                                                "ready_s")}
        table[name]["rounds"] = len(mine)
        for role in ("replica", "proxy", "single", "clients"):
            if role in mine[0]["cpu_s"]:
                table[name][f"{role}_cpu_ms_per_text"] = statistics.median(1e3 * r["cpu_s"][role] / r["texts"]
                                                                           for r in mine)
        table[name]["proxy_cpu_ms_per_request"] = statistics.median(1e3 * r["cpu_s"].get("proxy", 0) / r["requests"]
                                                                    for r in mine)
    from importlib.metadata import version
    record = {"summary": table, "runs": runs, "host_costs": host, "cluster_start_s": cluster_s, "texts": len(flat),
              "requests": args.requests, "clients": args.clients, "corpus": args.corpus, "cpu": harness.cpu_model(),
              "cpu_count": os.cpu_count(),
              "versions": {p: version(p) for p in ("torch", "transformers", "ray", "fastapi", "uvicorn")}}
    with open(os.path.join(args.out, "serve-ray.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(table, indent=1))
    one, two = table["ray-1"]["texts_per_s"], table["ray-2"]["texts_per_s"]
    print(f"2 replicas / 1 replica: {two / one:.2f}x texts/s; 1 replica / single process: "
          f"{one / table['single']['texts_per_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
