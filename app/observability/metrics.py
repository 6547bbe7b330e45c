"""Every Prometheus metric the service exports, defined once, here.

Where it sits: a leaf below every layer. The API (app/api/metrics.py, the
replay shortcut), the engine (app/machine/engine.py), the rail clients
(app/rails/gateways.py) and the worker (app/workers/) count and time through
it. The API's processes add up to one view in prometheus_client's
multiprocess mode, which reads PROMETHEUS_MULTIPROC_DIR when first imported,
so the parent of `payments api` prepares it before anything imports this
module, and serves /metrics from the files on a port of its own
(app/observability/multiproc.py). Everything the hot path counts or times
(a request, a payment's start and end, a rail call) is added up here and
written once a second (`flush`). docs/operations.md lists every metric and
explains the bounded labels, the multiprocess files and the batching.
"""

from __future__ import annotations

import asyncio
import functools
import os
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector,
    disable_created_metrics, multiprocess, start_http_server,
)

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"

# No `_created` series beside every counter and histogram: a second series
# per label set that no query here needs (multiprocess mode has none anyway).
disable_created_metrics()

# The service's own metrics, and nothing else: the list docs/operations.md
# must match. (The worker serves the standard process metrics beside them.)
REGISTRY = CollectorRegistry(auto_describe=True)

# Request latencies: a replay takes a few milliseconds, a new payment a few
# hundred, a payment whose PSP hangs up to the call timeout (5 s by default).
_HTTP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# An external call: milliseconds on a good day, the timeout on a bad one.
_CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# --- The payment path: the API, and whoever drives a payment (API or worker) ---

# One histogram serves as the request counter too: its `_count` series, by
# route, method and status, is the number of requests, so a request costs
# one observation instead of an observation and an increment.
HTTP_REQUESTS = Histogram(
    "payments_http_request_duration_seconds",
    "HTTP requests answered, by route template, method and status code, and how long each took.",
    ["route", "method", "status"], buckets=_HTTP_BUCKETS, registry=REGISTRY,
)
PROBLEMS = Counter(
    "payments_problems",
    "problem+json answers, by problem type (request-in-progress and duplicate-payment are the 409s, "
    "idempotency-key-reused the 422s, service-unavailable the 503s).",
    ["problem"], registry=REGISTRY,
)
REFUSED = Counter(
    "payments_http_refused",
    "Connections and requests the HTTP protocol refused before the application answered them, by reason "
    "(head_too_large, head_timeout, body_timeout, peer_connections).",
    ["reason"], registry=REGISTRY,
)
REPLAYS = Counter(
    "payments_replays",
    "Retries of finished payments answered with the stored response, by what answered them.",
    ["answered_by"], registry=REGISTRY,
)
STARTED = Counter(
    "payments_started",
    "New payments: an Idempotency-Key claimed and its payment created (Handler1 committed).",
    registry=REGISTRY,
)
FINISHED = Counter(
    "payments_finished",
    "Payments that reached a final status, counted once, by the process whose phase finished them.",
    ["status"], registry=REGISTRY,
)
REFUNDS_STARTED = Counter(
    "payments_refunds_started",
    "New client refunds: an Idempotency-Key claimed at the refund endpoint (its refund reserved, or refused).",
    registry=REGISTRY,
)
BATCHES_ACCEPTED = Counter(
    "payments_batches_accepted",
    "Payment batch uploads accepted: a key claimed at the batch endpoint, the batch, its rows and their outbox stored.",
    registry=REGISTRY,
)
REFUNDS_FINISHED = Counter(
    "payments_refunds_finished",
    "Client refunds that reached a final status (succeeded, failed), counted once, by the process whose phase "
    "finished them.",
    ["status"], registry=REGISTRY,
)
TAKEOVERS = Counter(
    "payments_takeovers",
    "Operations taken over after their lease ran out or was released (by a client retry or the worker), "
    "by the recovery point they resumed from.",
    ["recovery_point"], registry=REGISTRY,
)
RELEASES = Counter(
    "payments_releases",
    "Operations given back at a SENT point without an applied answer, for a later attempt, by recovery point "
    "and cause (unknown, settling, not_applied, error, stopping).",
    ["recovery_point", "cause"], registry=REGISTRY,
)
PARKS = Counter(
    "payments_parks",
    "Operations parked as indeterminate (attempts exhausted, or a legacy payout unknown), by recovery point "
    "and cause.",
    ["recovery_point", "cause"], registry=REGISTRY,
)
UNPARKS = Counter(
    "payments_unparks",
    "Parked operations taken back by someone who learned their outcome, by recovery point and by what "
    "(reprobe, reconciliation).",
    ["recovery_point", "by"], registry=REGISTRY,
)
EXTERNAL_CALLS = Histogram(
    "payments_external_call_duration_seconds",
    "Exchanges with the PSP and the rail: how long each took, by system (psp, rail), call (send, probe, "
    "statement) and outcome class (applied, not_applied, settling, not_found, unknown).",
    ["system", "call", "outcome"], buckets=_CALL_BUCKETS, registry=REGISTRY,
)


# --- The hot path's batches ---------------------------------------------------------

# How long what the hot path counted may wait in this process before it is
# written where a scrape reads it.
FLUSH_SECONDS = 1.0

_dirty: list[Batched | BatchedCounter] = []  # what holds counts not yet written
_flush_loop: asyncio.AbstractEventLoop | None = None  # the loop a flush is due on


class Batched:
    """One histogram child's observations, added up here until the next `flush` writes them to it.

    The sum of n observations, and each bucket's count, written once: in the
    scrape exactly what n calls of `observe` would have written. For the
    event loop's thread only (the API's requests), like the loop itself.
    """

    __slots__ = ("child", "bounds", "counts", "total", "dirty")

    def __init__(self, child: Histogram) -> None:
        self.child = child
        # prometheus_client keeps the bounds and the per-bucket values of a
        # histogram child in these attributes; tests/unit/test_metrics_batches.py
        # checks that a batch scrapes exactly as the same observations would.
        self.bounds: list[float] = list(child._upper_bounds)  # ends with +Inf
        self.counts = [0] * len(self.bounds)
        self.total = 0.0
        self.dirty = False

    def observe(self, amount: float) -> None:
        # A bucket holds the observations up to its bound, inclusive (`le`):
        # the first bound >= amount, which +Inf always is.
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.total += amount
        if not self.dirty:
            self.dirty = True
            _pending(self)

    def write(self) -> None:
        for bucket, count in zip(self.child._buckets, self.counts):
            if count:
                bucket.inc(count)
        self.child._sum.inc(self.total)
        self.counts = [0] * len(self.bounds)
        self.total, self.dirty = 0.0, False


class BatchedCounter:
    """A counter child's increments, added up here until the next `flush` (same rules as `Batched`)."""

    __slots__ = ("child", "count", "dirty")

    def __init__(self, child: Counter) -> None:
        self.child, self.count, self.dirty = child, 0, False

    def inc(self) -> None:
        self.count += 1
        if not self.dirty:
            self.dirty = True
            _pending(self)

    def write(self) -> None:
        self.child.inc(self.count)
        self.count, self.dirty = 0, False


def _pending(batch: Batched | BatchedCounter) -> None:
    """`batch` holds counts: write them within FLUSH_SECONDS (at once where no event loop runs)."""
    global _flush_loop
    _dirty.append(batch)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        flush()
        return
    # By the loop, not a flag: a loop that closed with a flush still due
    # (tests run several, one after the other) does not stop this one's.
    if _flush_loop is not loop:
        _flush_loop = loop
        loop.call_later(FLUSH_SECONDS, flush)


def flush() -> None:
    """Write what the batches hold to prometheus_client (its files, in multiprocess mode)."""
    global _flush_loop
    _flush_loop = None
    while _dirty:
        _dirty.pop().write()


_counters: dict[tuple[Counter, tuple[str, ...]], BatchedCounter] = {}
_histograms: dict[tuple[Histogram, tuple[str, ...]], Batched] = {}


def counter(metric: Counter, *labels: str) -> BatchedCounter:
    """`metric.labels(*labels)`, batched: resolved once per label set, written at the next `flush`.

    For the event loop's thread (the API's requests, the worker's sweeps),
    like `Batched`; the worker's own metrics below are written directly.
    """
    found = _counters.get((metric, labels))
    if found is None:
        found = _counters[(metric, labels)] = BatchedCounter(metric.labels(*labels) if labels else metric)
    return found


def histogram(metric: Histogram, *labels: str) -> Batched:
    """`metric.labels(*labels)`, batched, as `counter`."""
    found = _histograms.get((metric, labels))
    if found is None:
        found = _histograms[(metric, labels)] = Batched(metric.labels(*labels))
    return found


# The children of every replay, resolved at import.
REPLAYED_BY_SHORTCUT = counter(REPLAYS, "shortcut")
REPLAYED_BY_ROUTE = counter(REPLAYS, "route")

_requests: dict[tuple[str, str, int], Batched] = {}


def request_timer(route: str, method: str, status: int) -> Batched:
    """The batched HTTP_REQUESTS child for a route template, method and status (the status as the server gives it)."""
    found = _requests.get((route, method, status))
    if found is None:
        found = _requests[(route, method, status)] = histogram(HTTP_REQUESTS, route, method, str(status))
    return found


# --- The worker's own ------------------------------------------------------------


@dataclass(frozen=True)
class WorkerMetrics:
    sweeps: Counter
    recoveries: Counter
    last_sweep: Gauge
    backlog: Gauge
    lag: Gauge
    unfinished: Gauge
    parked: Gauge
    reconciliation_runs: Counter
    reconciliation_breaks: Counter
    reconciliation_settled: Counter


@functools.cache
def worker() -> WorkerMetrics:
    """The worker's metrics, registered on first use: in the worker process only.

    Created lazily so an API process, which never sweeps, exports none of
    them: a `payments_worker_last_sweep_timestamp_seconds` of 0 from every
    API replica would fire the "worker stopped sweeping" alert.
    """
    made = WorkerMetrics(
        sweeps=Counter(
            "payments_worker_sweeps", "Recovery sweeps, by result (ok, failed: the database was unavailable or a bug).",
            ["result"], registry=REGISTRY,
        ),
        recoveries=Counter(
            "payments_worker_recoveries",
            "Stranded operations the sweep tried, by what became of each (finished, pending, skipped, errors), "
            "and parked ones driven on after a re-probe answered (healed).",
            ["result"], registry=REGISTRY,
        ),
        last_sweep=Gauge(
            "payments_worker_last_sweep_timestamp_seconds", "When the last sweep that completed ended (Unix time).",
            registry=REGISTRY,
        ),
        backlog=Gauge(
            "payments_worker_backlog",
            "Operations due for the recovery sweep now: unfinished, not parked, no live owner, due, and older "
            "than WORKER_MIN_AGE_SECONDS.",
            registry=REGISTRY,
        ),
        lag=Gauge(
            "payments_worker_lag_seconds",
            "How long the oldest operation in the backlog has been due (0 when the backlog is empty).",
            registry=REGISTRY,
        ),
        unfinished=Gauge(
            "payments_unfinished_operations", "Operations started and not finished, not parked (in flight or due).",
            registry=REGISTRY,
        ),
        parked=Gauge(
            "payments_parked_operations",
            "Operations parked as indeterminate now: re-probed every PARKED_RECHECK_SECONDS, or waiting for "
            "reconciliation.",
            registry=REGISTRY,
        ),
        reconciliation_runs=Counter(
            "payments_reconciliation_runs",
            "Reconciliation runs of a statement window, by result (finished, failed, statement_unavailable).",
            ["result"], registry=REGISTRY,
        ),
        reconciliation_breaks=Counter(
            "payments_reconciliation_breaks",
            "Reconciliation breaks recorded (each once), by kind: what a person must look at.",
            ["kind"], registry=REGISTRY,
        ),
        reconciliation_settled=Counter(
            "payments_reconciliation_settled",
            "Parked payouts settled from the rail's statements, by outcome (succeeded, refunding).",
            ["outcome"], registry=REGISTRY,
        ),
    )
    # Every series of a known label value exists from the first scrape, at 0,
    # so that rate() and increase() see the first event.
    for counter, values in (
        (made.sweeps, ("ok", "failed")),
        (made.recoveries, ("finished", "pending", "skipped", "errors", "healed")),
        (made.reconciliation_runs, ("finished", "failed", "statement_unavailable")),
        (made.reconciliation_settled, ("succeeded", "refunding")),
    ):
        for value in values:
            counter.labels(value)
    return made


# --- Leaving, and the worker's endpoint -------------------------------------------


def process_exiting() -> None:
    """An API process is stopping: drop its live gauges' files (counters and histograms stay, as they must).

    The service defines no live gauge today; this keeps one added later from
    reporting a dead process's value. First the batches are written: what
    this process counted in its last second is not lost.
    """
    flush()
    if os.environ.get(MULTIPROC_DIR):
        multiprocess.mark_process_dead(os.getpid())


def serve(host: str, port: int) -> Callable[[], None]:
    """The worker's /metrics on `host:port` (a thread of its own); returns how to stop it.

    Serves this process's metrics and the standard process ones (CPU, memory,
    open files). OSError if the port is taken.
    """
    served = CollectorRegistry()
    served.register(REGISTRY)  # type: ignore[arg-type]  (a registry is a collector)
    ProcessCollector(registry=served)
    PlatformCollector(registry=served)
    server, thread = start_http_server(port, addr=host, registry=served)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop
