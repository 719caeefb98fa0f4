"""The heart of the server: every request's texts in one queue, gathered into padding-free batches of at most
`max_batch_tokens` real tokens by one model worker, and each result handed back to its own request.

    request (event loop)            Ticket(texts)  --submit-->  queue of Text items (FIFO, across all requests)
    model worker (one thread)       take the oldest texts up to the token budget -> run(batch) -> results
                                    -> each result into its ticket's slot; a ticket whose slots are all filled
                                       wakes its request (loop.call_soon_threadsafe)

The scheduler knows nothing of HTTP, and the model runner knows nothing of requests: a batch is a list of payloads
(token ids and what the model needs with them) and comes back as one result per payload, in order. A batch mixes
texts of any requests because the model runs packed, padding-free: what shares a batch does not change the tokens
computed for a text. A request whose client went away is dropped: its texts leave the queue and are never computed
(texts already in the running batch finish, and their results are discarded).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

logger = logging.getLogger("fastbert.serve")


class StoppedError(Exception):
    """The worker is stopping: nothing new is queued."""


class BackendError(Exception):
    """The model failed on a batch: every request with a text in it gets this (a 424), the worker goes on."""


@dataclass(eq=False)
class Text:
    payload: Any          # what the runner gets for this text (token ids, ...)
    tokens: int           # its real tokens: what it costs in the budget
    ticket: "Ticket"
    slot: int             # its place in the request's results


class Ticket:
    """One request's texts on their way: their results, filled slot by slot as batches finish, and the future the
    request awaits (set on its own event loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int):
        self.loop, self.future = loop, loop.create_future()
        self.results: list = [None] * count
        self.remaining = count
        self.queued_at = time.perf_counter()
        # per batch that held its texts: (texts, seconds queued, seconds in the model, seconds from queueing to the
        # batch's end), filled before its results: the request's timings (TEI's headers and per-input histograms)
        self.batches: list = []
        self.dropped = False    # its client went away

    def _settle(self, value=None, error: BaseException | None = None) -> None:
        def settle():
            if not self.future.done():
                self.future.set_exception(error) if error is not None else self.future.set_result(value)
        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop is closed: nobody waits for the answer
            pass

    def put(self, slot: int, result) -> None:
        self.results[slot] = result
        self.remaining -= 1
        if self.remaining == 0:
            self._settle(self.results)

    def fail(self, error: BaseException) -> None:
        self.remaining = -1  # settled: later results of the same request are dropped
        self._settle(error=error)


class Scheduler:
    """The queue and its model worker. `run(payloads) -> results` is called on the worker thread only, with at
    most `max_batch_tokens` tokens in a batch (a single text longer than the budget is a batch of its own: the
    caller keeps texts within the model's limit and the budget at least that limit). metrics: the app's Metrics."""

    def __init__(self, run: Callable[[Sequence[Any]], Sequence[Any]], max_batch_tokens: int, metrics):
        self.run, self.max_batch_tokens, self.metrics = run, max_batch_tokens, metrics
        self._queue: collections.deque[Text] = collections.deque()
        self._ready = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the event loop's side ------------------------------------------------------------------------------------
    def submit(self, ticket: Ticket, texts: Sequence[Text]) -> None:
        """Queue a request's texts; StoppedError once stop() was called."""
        with self._ready:
            if self._stopping:
                raise StoppedError("the server is shutting down")
            self._queue.extend(texts)
            self.metrics.queue_size(len(self._queue))
            self._ready.notify()

    def drop(self, ticket: Ticket) -> int:
        """Take a request's texts out of the queue (its client went away); returns how many were still queued."""
        with self._ready:
            ticket.dropped = True
            before = len(self._queue)
            self._queue = collections.deque(t for t in self._queue if t.ticket is not ticket)
            self.metrics.queue_size(len(self._queue))
            return before - len(self._queue)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def queued(self) -> int:
        with self._ready:
            return len(self._queue)

    # ---- the worker ----------------------------------------------------------------------------------------------
    def work(self, started: Callable[[], None] = lambda: None) -> None:
        """Run the worker on the calling thread until stop(); `started` is called once it counts as alive. The
        thread that loaded and warmed up the model calls it, so that one thread (and one CPU thread team of torch's,
        which belongs to the thread that runs the ops) does all of the model's work."""
        self._thread = threading.current_thread()
        started()
        self._work()

    def stop(self) -> None:
        """Compute what is queued, then end the worker (and wait for it, from another thread)."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _next_batch(self) -> list[Text] | None:
        """The oldest queued texts, up to the token budget (None: stopping and nothing left)."""
        with self._ready:
            while not self._queue and not self._stopping:
                self._ready.wait()
            if not self._queue:
                return None
            batch, tokens = [], 0
            while self._queue and (not batch or tokens + self._queue[0].tokens <= self.max_batch_tokens):
                text = self._queue.popleft()
                batch.append(text)
                tokens += text.tokens
            self.metrics.queue_size(len(self._queue))
            return batch

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            start = time.perf_counter()
            per_ticket: dict = {}  # each request's texts in this batch, in the order they came
            for text in batch:
                per_ticket[text.ticket] = per_ticket.get(text.ticket, 0) + 1
            tickets = list(per_ticket)
            try:
                results = self.run([text.payload for text in batch])
            except Exception as e:  # noqa: BLE001 - the batch's requests get the error; the server stays up
                logger.exception("the model failed on a batch of %d texts", len(batch))
                error = BackendError(f"the model failed on this batch: {type(e).__name__}: {e}")
                for ticket in tickets:
                    ticket.fail(error)
                continue
            end = time.perf_counter()
            seconds = end - start
            tokens = sum(text.tokens for text in batch)
            self.metrics.batch(len(batch), tokens)
            for ticket, count in per_ticket.items():
                ticket.batches.append((count, start - ticket.queued_at, seconds, end - ticket.queued_at))
            logger.debug("batch: %d texts, %d tokens, from %d requests, %.1f ms", len(batch), tokens, len(tickets),
                         seconds * 1e3)
            for text, result in zip(batch, results):
                if text.ticket.remaining > 0 and not text.ticket.dropped:
                    text.ticket.put(text.slot, result)
