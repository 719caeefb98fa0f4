"""Prometheus metrics under text-embeddings-inference's names, so that dashboards built for TEI read this server.

Each app has its own registry (two apps in one process count apart). TEI exposes its counters without the `_total`
suffix prometheus_client's Counter type adds to a counter's samples (te_request_count, not te_request_count_total);
dashboards query TEI's names, so the three counters are exposed by a collector of their own under exactly those
names (their TYPE line says untyped; rate() and increase() read them as counters). Histograms and the gauge are
prometheus_client's own.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.core import Metric

# seconds: a request on a busy CPU takes seconds, a batch on a GPU a millisecond
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _Counters:
    """te_request_count, te_request_success, te_request_failure{err}: monotonic counts under TEI's sample names."""

    HELP = {"te_request_count": "Requests received (inference routes)",
            "te_request_success": "Requests answered with a result",
            "te_request_failure": "Requests answered with an error, by kind (err)"}

    def __init__(self):
        self._lock = threading.Lock()
        self.values = {("te_request_count", ()): 0.0, ("te_request_success", ()): 0.0}

    def inc(self, name: str, **labels) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self.values[key] = self.values.get(key, 0.0) + 1

    def collect(self):
        with self._lock:
            values = dict(self.values)
        for name, documentation in self.HELP.items():
            metric = Metric(name, documentation, "unknown")
            for (sample, labels), value in sorted(values.items()):
                if sample == name:
                    metric.add_sample(name, dict(labels), value)
            yield metric


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        self.counters = _Counters()
        self.registry.register(self.counters)
        histogram = lambda name, doc, buckets: Histogram(name, doc, buckets=buckets,  # noqa: E731
                                                          registry=self.registry)
        self.request_duration = histogram("te_request_duration", "Seconds from a request's arrival to its answer",
                                          DURATION_BUCKETS)
        self.queue_duration = histogram("te_queue_duration", "Seconds a request's first text waited in the queue",
                                        DURATION_BUCKETS)
        self.inference_duration = histogram("te_inference_duration", "Seconds one batch took in the model",
                                            DURATION_BUCKETS)
        self.batch_size = histogram("te_batch_size", "Texts per batch", SIZE_BUCKETS)
        self.batch_tokens = histogram("te_batch_tokens", "Real tokens per batch (no padding is computed)",
                                      TOKEN_BUCKETS)
        self.queue_size = Gauge("te_queue_size", "Texts waiting in the queue", registry=self.registry)

    def request(self) -> None:
        self.counters.inc("te_request_count")

    def success(self, seconds: float) -> None:
        self.counters.inc("te_request_success")
        self.request_duration.observe(seconds)

    def failure(self, err: str) -> None:
        self.counters.inc("te_request_failure", err=err)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
