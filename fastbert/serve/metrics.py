"""Prometheus metrics as text-embeddings-inference (TEI) 1.9 exposes them: the same names, labels, types and
histogram buckets, so that a dashboard or an autoscaler built for TEI reads this server unchanged.

TEI writes its counters under their bare names (te_request_count, not the te_request_count_total that
prometheus_client's Counter would write), so this module writes the text format itself: `# TYPE NAME counter`
lines over samples of exactly TEI's names. Every metric is declared once, in METRICS below, which is also what
the tests read.

What each counts (per request: once per HTTP request; per input: once per text, pair or token-id list in it):
    te_request_count{method}        requests received by an inference route; method="single" (one input) or
                                    "batch" (a list); a request refused before its body was read carries no method
    te_request_success{method}      requests answered with a result
    te_request_failure{err}         requests answered with an error, by kind: validation, batch_size, tokenization,
                                    model_type, overloaded, inference, dropped (the client went away)
    te_request_duration             seconds from a request's arrival to its answer (successes)
    te_request_tokenization_duration, te_request_queue_duration, te_request_inference_duration
                                    seconds a request's inputs spent tokenizing, queued, in the model (the mean over
                                    its inputs, as TEI averages a batch request's)
    te_request_input_length         tokens per input
    te_embed_* / te_predict_*       per input (an embedding model's / a reranker's or classifier's): count (inputs
                                    received), success, and the four durations of each input
    te_queue_size                   inputs waiting in the queue
    te_batch_next_size              inputs per batch the model runs
    te_batch_next_tokens            real tokens per batch (no padding is computed)

Updating a metric takes one uncontended lock and, for a histogram, one bisect over its buckets: a request costs a
few microseconds of them, an input less.
"""
from __future__ import annotations

import bisect
import math
import threading
from typing import Iterable, Optional

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _duration_buckets() -> tuple:
    """TEI's buckets for every *_duration histogram: 35 steps of x1.5 from 1e-5 s (1.5e-5 s .. ~1.9e1 s), computed
    by the same float multiplications, so the bounds are the same doubles."""
    value, buckets = 0.00001, []
    for _ in range(35):
        value *= 1.5
        buckets.append(value)
    return tuple(buckets)


DURATION_BUCKETS = _duration_buckets()
BATCH_SIZE_BUCKETS = tuple(float(2 ** i) for i in range(13))     # 1 .. 4096 inputs
BATCH_TOKENS_BUCKETS = tuple(float(2 ** i) for i in range(21))   # 1 .. 1,048,576 tokens


def input_length_buckets(max_input_length: int) -> tuple:
    """TEI's te_request_input_length buckets: the powers of two 1 .. 2^19 up to the model's input limit."""
    return tuple(float(2 ** i) for i in range(20) if 2 ** i <= max_input_length)


_STAGES = ("duration", "tokenization_duration", "queue_duration", "inference_duration")
# name -> (type, label name or None, what it counts); the one list of what /metrics exposes
METRICS = {
    "te_request_count": ("counter", "method", "Requests received by an inference route"),
    "te_request_success": ("counter", "method", "Requests answered with a result"),
    "te_request_failure": ("counter", "err", "Requests answered with an error, by kind"),
    **{f"te_request_{stage}": ("histogram", None, f"Seconds per request: {stage.replace('_', ' ')}")
       for stage in _STAGES},
    "te_request_input_length": ("histogram", None, "Tokens per input"),
    **{f"te_{route}_{what}": ("counter", None, f"Inputs {'received' if what == 'count' else 'answered'} ({route})")
       for route in ("embed", "predict") for what in ("count", "success")},
    **{f"te_{route}_{stage}": ("histogram", None, f"Seconds per input ({route}): {stage.replace('_', ' ')}")
       for route in ("embed", "predict") for stage in _STAGES},
    "te_queue_size": ("gauge", None, "Inputs waiting in the queue"),
    "te_batch_next_size": ("histogram", None, "Inputs per batch"),
    "te_batch_next_tokens": ("histogram", None, "Real tokens per batch"),
}
# the `err` labels, as TEI names its failures
FAILURES = ("validation", "batch_size", "tokenization", "model_type", "overloaded", "inference", "dropped")


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return str(int(value)) if float(value).is_integer() and abs(value) < 2 ** 53 else repr(float(value))


class Histogram:
    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: past every bound (+Inf only)
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, n: int = 1) -> None:
        """`n` observations of `value` (the lock is the caller's)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += n
        self.sum += value * n
        self.count += n

    def lines(self, name: str) -> list:
        out, cumulative = [], 0
        for bound, count in zip(self.bounds + (math.inf,), self.counts):
            cumulative += count
            out.append(f'{name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        out += [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """One app's metrics (two apps in one process count apart). route: "embed" for an embedding model, "predict"
    for a reranker or classifier: which of TEI's per-input families it fills."""

    def __init__(self, route: str = "embed"):
        self.route = route
        self._lock = threading.Lock()
        self._counters = {name: {} for name, (kind, _, _) in METRICS.items() if kind == "counter"}
        # known labels start at 0, so that a first failure is a rise rate() sees
        self._counters["te_request_failure"] = {err: 0 for err in FAILURES}
        self._counters["te_request_count"] = {"single": 0, "batch": 0}
        self._counters["te_request_success"] = {"single": 0, "batch": 0}
        for what in ("count", "success"):
            self._counters[f"te_{route}_{what}"] = {None: 0}
        self._histograms = {f"te_request_{stage}": Histogram(DURATION_BUCKETS) for stage in _STAGES}
        self._histograms.update({f"te_{route}_{stage}": Histogram(DURATION_BUCKETS) for stage in _STAGES})
        self._histograms["te_batch_next_size"] = Histogram(BATCH_SIZE_BUCKETS)
        self._histograms["te_batch_next_tokens"] = Histogram(BATCH_TOKENS_BUCKETS)
        self._queue_size = 0

    def names(self) -> list:
        """The metrics this app exposes (a subset of METRICS: one of the per-input families)."""
        other = "predict" if self.route == "embed" else "embed"
        return [name for name in METRICS if not name.startswith(f"te_{other}_")]

    # ---- the server's side -------------------------------------------------------------------------------------------
    def limit_input_length(self, max_input_length: int) -> None:
        """The model's input limit, known once it loads, sets te_request_input_length's buckets."""
        with self._lock:
            self._histograms["te_request_input_length"] = Histogram(input_length_buckets(max_input_length))

    def request(self, method: Optional[str]) -> None:
        """A request received; method None: refused before its inputs were read."""
        self._inc("te_request_count", method)

    def failure(self, err: str) -> None:
        self._inc("te_request_failure", err)

    def received(self, inputs: int) -> None:
        """A request's inputs, before they are tokenized (te_embed_count / te_predict_count)."""
        with self._lock:
            self._counters[f"te_{self.route}_count"][None] += inputs

    def tokenized(self, lengths: Iterable[int]) -> None:
        """Each input's tokens (te_request_input_length)."""
        with self._lock:
            histogram = self._histograms.get("te_request_input_length")
            if histogram is not None:
                for length in lengths:
                    histogram.observe(length)

    def success(self, method: str, total: float, tokenization: float, batches: list) -> tuple:
        """A request answered: total seconds since it arrived, the seconds its inputs took to tokenize, and
        `batches`, [(inputs, queue seconds, inference seconds, seconds from arrival to that batch's end)] for each
        batch that held its inputs. Returns (queue, inference): the means over its inputs, TEI's per-request
        values (the response's headers)."""
        inputs = sum(b[0] for b in batches) or 1
        queue = sum(b[0] * b[1] for b in batches) / inputs
        inference = sum(b[0] * b[2] for b in batches) / inputs
        route, histograms = self.route, self._histograms
        with self._lock:
            self._counters["te_request_success"][method] = self._counters["te_request_success"].get(method, 0) + 1
            self._counters[f"te_{route}_success"][None] += inputs
            histograms["te_request_duration"].observe(total)
            histograms["te_request_tokenization_duration"].observe(tokenization)
            histograms["te_request_queue_duration"].observe(queue)
            histograms["te_request_inference_duration"].observe(inference)
            for n, queued, inferred, ended in batches:
                histograms[f"te_{route}_duration"].observe(ended, n)
                histograms[f"te_{route}_tokenization_duration"].observe(tokenization, n)
                histograms[f"te_{route}_queue_duration"].observe(queued, n)
                histograms[f"te_{route}_inference_duration"].observe(inferred, n)
        return queue, inference

    # ---- the scheduler's side ----------------------------------------------------------------------------------------
    def queue_size(self, size: int) -> None:
        self._queue_size = size

    def batch(self, inputs: int, tokens: int) -> None:
        with self._lock:
            self._histograms["te_batch_next_size"].observe(inputs)
            self._histograms["te_batch_next_tokens"].observe(tokens)

    # ---- reading -----------------------------------------------------------------------------------------------------
    def _inc(self, name: str, label) -> None:
        with self._lock:
            values = self._counters[name]
            values[label] = values.get(label, 0) + 1

    def value(self, name: str, label=None) -> float:
        """A counter's value (label: its method or err), the gauge's, or a histogram's count."""
        with self._lock:
            if name == "te_queue_size":
                return self._queue_size
            if name in self._histograms:
                return self._histograms[name].count
            return self._counters[name].get(label, 0)

    def exposition(self) -> bytes:
        """Prometheus' text format (version 0.0.4), as TEI's exporter writes it."""
        out = []
        with self._lock:
            for name in self.names():
                kind, label, documentation = METRICS[name]
                if kind == "histogram" and name not in self._histograms:
                    continue  # te_request_input_length before the model has loaded
                out += [f"# HELP {name} {documentation}", f"# TYPE {name} {kind}"]
                if kind == "counter":
                    for value_label, value in self._counters[name].items():
                        labels = f'{{{label}="{value_label}"}}' if value_label is not None else ""
                        out.append(f"{name}{labels} {value}")
                elif kind == "gauge":
                    out.append(f"{name} {self._queue_size}")
                else:
                    out += self._histograms[name].lines(name)
        return ("\n".join(out) + "\n").encode()
