"""The hot path's batched metrics scrape exactly as the same observations made one by one.

app/observability/metrics.py adds up each request's timing, each replay's
count and the payment path's counts and timings (`counter`, `histogram`)
in the process, and writes them to prometheus_client once a second. These tests pin what that must never change: the scraped buckets,
count and sum of n batched observations are those of n `observe` calls (a
wrong bucket for a value on a bound, a lost sum, or a prometheus_client
release that keeps its values elsewhere would each fail here), nothing is
written before the flush inside an event loop, one flush is scheduled for
all the batches, and outside any loop a count is written at once.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from app.observability import metrics

BUCKETS = (0.001, 0.01, 0.1, 1.0)
# Below the first bound, on each bound (`le` is inclusive), between bounds, and past the last.
VALUES = (0.0, 0.0005, 0.001, 0.002, 0.01, 0.05, 0.1, 0.1, 0.99, 1.0, 1.5, 30.0)


def pair(kind: type, name: str, **options) -> tuple[CollectorRegistry, object, CollectorRegistry, object]:
    """The same metric in two registries: one to fill one by one, one through a batch."""
    direct, batched = CollectorRegistry(), CollectorRegistry()
    return (direct, kind(name, "a test metric", ["route"], registry=direct, **options).labels("/x"),
            batched, kind(name, "a test metric", ["route"], registry=batched, **options).labels("/x"))


def test_a_batch_of_observations_scrapes_as_the_observations_one_by_one():
    direct, one_by_one, batched, child = pair(Histogram, "t_seconds", buckets=BUCKETS)
    batch = metrics.Batched(child)
    for amount in VALUES:
        one_by_one.observe(amount)
        batch.observe(amount)  # no event loop here: written at once
    assert generate_latest(batched) == generate_latest(direct)


def test_inside_a_loop_nothing_is_written_until_the_flush_the_loop_was_given():
    direct, one_by_one, batched, child = pair(Histogram, "t_seconds", buckets=BUCKETS)
    _, counted_direct, counter_registry, counter_child = pair(Counter, "t_replays")
    batch, counter = metrics.Batched(child), metrics.BatchedCounter(counter_child)
    empty = generate_latest(batched)

    async def requests() -> list[tuple[float, object]]:
        loop = asyncio.get_running_loop()
        scheduled: list[tuple[float, object]] = []
        loop.call_later = lambda delay, callback: scheduled.append((delay, callback))  # type: ignore[method-assign]
        for amount in VALUES:
            batch.observe(amount)
            counter.inc()
        return scheduled

    scheduled = asyncio.run(requests())
    assert generate_latest(batched) == empty
    assert counter_child._value.get() == 0
    # One flush for both batches, FLUSH_SECONDS from the first count.
    assert scheduled == [(metrics.FLUSH_SECONDS, metrics.flush)]
    _, callback = scheduled[0]
    callback()
    for amount in VALUES:
        one_by_one.observe(amount)
        counted_direct.inc()
    assert generate_latest(batched) == generate_latest(direct)
    assert counter_child._value.get() == len(VALUES)
    # Written once: a second flush adds nothing.
    metrics.flush()
    assert generate_latest(batched) == generate_latest(direct)


def test_the_payment_paths_counts_are_batched_once_per_label_set():
    # The engine's counts and the rail calls' timings go through these: a
    # new payment's start and end and its two calls would otherwise each be
    # a locked write to the shared files, on the request's path.
    registry = CollectorRegistry()
    finished = Counter("t_finished", "a test metric", ["status"], registry=registry)
    started = Counter("t_started", "a test metric", registry=registry)
    calls = Histogram("t_call_seconds", "a test metric", ["system"], buckets=BUCKETS, registry=registry)
    assert metrics.counter(finished, "succeeded") is metrics.counter(finished, "succeeded")
    assert metrics.counter(finished, "failed") is not metrics.counter(finished, "succeeded")
    assert metrics.histogram(calls, "psp") is metrics.histogram(calls, "psp")

    async def a_payment() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later = lambda delay, callback: None  # type: ignore[method-assign]  (the flush is ours to call)
        metrics.counter(started).inc()
        metrics.histogram(calls, "psp").observe(0.02)
        metrics.counter(finished, "succeeded").inc()

    asyncio.run(a_payment())
    assert registry.get_sample_value("t_started_total") == 0
    assert registry.get_sample_value("t_finished_total", {"status": "succeeded"}) == 0
    assert registry.get_sample_value("t_call_seconds_count", {"system": "psp"}) == 0
    metrics.flush()
    assert registry.get_sample_value("t_started_total") == 1
    assert registry.get_sample_value("t_finished_total", {"status": "succeeded"}) == 1
    assert registry.get_sample_value("t_call_seconds_count", {"system": "psp"}) == 1
    assert registry.get_sample_value("t_call_seconds_bucket", {"system": "psp", "le": "0.1"}) == 1
