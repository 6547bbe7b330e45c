"""What the outbox adds to a new payment's cost: the service with and without webhooks, at the same time.

`make bench` (bench/run.py) runs this after its own rounds at each worker
count, and judges the outbox's target by it. Its rounds one after the other
(the `webhooks` variant, then the phased service without) cannot tell the
outbox's cost from the machine's: on two CPUs shared by everything, the fake
merchant's work (a real merchant's machine's) slows every process of the
webhooks run, the service's included, and the runs drift between themselves
by more than the target allows
(docs/reference/performance.md#judged-side-by-side-met-runs-7-and-8).

Here the two APIs of the bench that serve the phased service with the same
settings run at once, each with half of the clients: one for the client with
no webhook endpoint (`without`), one for the client whose endpoint is the
fake merchant (`with`), whose events the worker's dispatcher delivers while
the round runs. Whatever slows the machine, the merchant included, slows both
alike. Each round counts, per payment that succeeded:

    without   its API's CPU, and its API's database sessions'
    with      the same for its API, and the worker's CPU and its sessions'
              (the dispatcher's claims, POSTs and records), counted until
              the fake merchant has applied every webhook of the round

Delivered is the merchant's word, not ours: a webhook counts once the
merchant's inbox holds its webhook-id, the event's id
(`fake_merchant.processed_message`, in the fakes' database), whatever the
service's `webhook_delivery` keeps of it: that table is the dispatcher's
bookkeeping, and a delivery that succeeded need not leave a row there.

The worker's other loops (recovery, retention, reconciliation) sweep all
the time, webhooks or not: a deployment without endpoints runs them too. So
the worker's CPU while idle is measured first (`IDLE_SECONDS` with no load),
and that rate times each round's length is taken off the worker's CPU in
the round; the figures keep both. The database sessions are told apart by
their client port (bench/sessions.py). A server reached over a Unix socket
has no client ports: the figure is then n/a, not a guess.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

import asyncpg

from bench.load import Load, RunResult
from bench.sessions import Meter
from bench.system import Service

# How long a round waits for the dispatcher to deliver the round's webhooks.
DRAIN_WAIT_SECONDS = 60.0
# How long the worker's CPU is watched with nothing to do, before the rounds.
IDLE_SECONDS = 5.0
SIDES = ("without", "with")


async def applied(merchant: asyncpg.Connection) -> int:
    """The webhooks the fake merchant has applied: the ids in its inbox, each once (its primary key)."""
    return await merchant.fetchval("SELECT count(*) FROM fake_merchant.processed_message")


async def backlog(service: asyncpg.Connection, merchant: asyncpg.Connection, client_id: int) -> int:
    """The client's events whose webhooks the fake merchant has not applied yet.

    One the dispatcher gave up on stays here for good: it was never delivered.

    The merchant is this client's endpoint and no other's, so every id in
    its inbox is one of the client's events. The inbox is read first: each
    id in it is of an event already committed, so the events read after
    are at least as many, and a webhook applied between the two reads cannot
    take the backlog below zero.
    """
    done = await applied(merchant)
    return await service.fetchval("SELECT count(*) FROM event WHERE client_id = $1", client_id) - done


async def drained(service: asyncpg.Connection, merchant: asyncpg.Connection, client_id: int) -> float | None:
    """Seconds until the merchant has applied every event of the client (the dispatcher has caught up);
    None if some are still not applied after DRAIN_WAIT_SECONDS."""
    started = time.monotonic()
    while time.monotonic() - started < DRAIN_WAIT_SECONDS:
        if await backlog(service, merchant, client_id) == 0:
            return round(time.monotonic() - started, 2)
        await asyncio.sleep(0.05)  # polling the backlog, bounded by DRAIN_WAIT_SECONDS
    return None


async def delivered_check(service_url: str, merchant_url: str, client_id: int, run: RunResult) -> tuple[bool, str]:
    """Every payment of the round that succeeded has its event, and the merchant applied its event's webhook."""
    service = await asyncpg.connect(service_url)
    try:
        rows = await service.fetch(
            "SELECT e.id::text AS event_id FROM payment p LEFT JOIN event e ON e.payment_id = p.id "
            "WHERE p.client_id = $1 AND p.status = 'succeeded' AND p.reference = ANY($2::text[])",
            client_id, [p.reference for p in run.paid])
    finally:
        await service.close()
    events = [r["event_id"] for r in rows if r["event_id"] is not None]
    merchant = await asyncpg.connect(merchant_url)
    try:
        delivered = await merchant.fetchval(
            "SELECT count(*) FROM fake_merchant.processed_message WHERE webhook_id = ANY($1::text[])", events)
    finally:
        await merchant.close()
    ok = len(rows) == delivered == run.succeeded
    return ok, f"{run.succeeded} answered 201, {len(rows)} succeeded, {delivered} webhooks applied by the merchant"


async def side_by_side(apis: dict[str, Service], worker: Service, loads: dict[str, Load], server_url: str,
                       service_url: str, merchant_url: str, client_id: int, count: int, seconds: float,
                       warmup: float = 1.0) -> tuple[dict[str, Any], dict[str, list]]:
    """`count` rounds of new payments against both APIs at once: the figures, and each side's results to check.

    `client_id` is the `with` side's client, whose endpoint is the fake
    merchant keeping its records at `merchant_url`. Before the rounds, both
    sides run `warmup` seconds, not counted: their connections up, and
    APIs that have served nothing yet past their first requests.
    """
    conn = await asyncpg.connect(server_url)
    service = await asyncpg.connect(service_url)
    merchant = await asyncpg.connect(merchant_url)
    meter = Meter(conn, server_url, {**apis, "worker": worker})
    rounds: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {side: [] for side in SIDES}
    try:
        await asyncio.gather(*(loads[side].new_payments(warmup) for side in SIDES))
        await drained(service, merchant, client_id)
        idle_from, idle_started = await meter.mark(), time.monotonic()
        await asyncio.sleep(IDLE_SECONDS)  # measuring the worker's CPU at rest, not waiting for anything
        idle_cpu, idle_sessions = Meter.spent(idle_from, await meter.mark(), "worker")
        idle_seconds = time.monotonic() - idle_started
        rest_cpu, rest_sessions = idle_cpu / idle_seconds, idle_sessions / idle_seconds  # CPU s per s
        for _ in range(count):
            before, started = await meter.mark(), time.monotonic()
            ran = dict(zip(SIDES, await asyncio.gather(*(loads[side].new_payments(seconds) for side in SIDES))))
            load_end = await meter.mark()
            left = await backlog(service, merchant, client_id)
            caught_up = await drained(service, merchant, client_id)
            after = await meter.mark()
            elapsed = time.monotonic() - started
            figures: dict[str, Any] = {"backlog_at_end": left, "drained_after_end_s": caught_up,
                                       "seconds": round(elapsed, 2)}
            for side in SIDES:
                results[side].append(ran[side])
                api, sessions = Meter.spent(before, load_end, side)
                n = max(1, ran[side].succeeded)
                figures[side] = {"payments": ran[side].succeeded, "per_second": round(ran[side].per_second, 1),
                                 "api_ms": round(1000 * api / n, 4), "sessions_ms": round(1000 * sessions / n, 4)}
            worker_cpu, worker_sessions = Meter.spent(before, after, "worker")
            n = max(1, ran["with"].succeeded)
            figures["with"] |= {
                "worker_ms_with_its_rest": round(1000 * worker_cpu / n, 4),
                "worker_sessions_ms_with_their_rest": round(1000 * worker_sessions / n, 4),
                "worker_ms": round(1000 * max(0.0, worker_cpu - rest_cpu * elapsed) / n, 4),
                "worker_sessions_ms": round(1000 * max(0.0, worker_sessions - rest_sessions * elapsed) / n, 4),
            }
            mapped = any(after.owner.get(pid) == "without" for pid in after.sessions)
            for side in SIDES:
                f = figures[side]
                f["service_ms"] = round(f["api_ms"] + f["sessions_ms"] + f.get("worker_ms", 0.0)
                                        + f.get("worker_sessions_ms", 0.0), 4) if mapped else None
            w, wo = figures["with"], figures["without"]
            figures["cpu_ratio"] = round(w["service_ms"] / wo["service_ms"], 4) \
                if mapped and wo["service_ms"] else None
            figures["rate_ratio"] = round(w["per_second"] / wo["per_second"], 4) if wo["per_second"] else None
            rounds.append(figures)
    finally:
        await merchant.close()
        await service.close()
        await conn.close()
    return summary(rounds) | {"worker_at_rest_cpu_ms_per_s": [round(1000 * rest_cpu, 3), round(1000 * rest_sessions, 3)]}, results


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over rounds of the service's CPU per payment on each side, and of the rounds' ratios."""
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return round(statistics.median(present), 4) if present else None

    parts = ("api_ms", "sessions_ms", "worker_ms", "worker_sessions_ms", "service_ms", "per_second")
    return {
        "rounds": rounds,
        "cpu_ratio": median([r["cpu_ratio"] for r in rounds]),
        "rate_ratio": median([r["rate_ratio"] for r in rounds]),
        "medians": {side: {part: median([r[side].get(part) for r in rounds]) for part in parts
                           if any(part in r[side] for r in rounds)} for side in SIDES},
        "all_drained": all(r["drained_after_end_s"] is not None for r in rounds),
        "backlog_at_end": [r.get("backlog_at_end") for r in rounds],
        "drained_after_end_s": [r["drained_after_end_s"] for r in rounds],
    }
