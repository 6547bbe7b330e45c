"""New payments through the phased service and the naive twin at the same moments: the rate without the host's drift.

`make bench` and `bench.run --rate-only` (bench/run.py) run this after the
alternating rounds at each worker count. It is a reading, not the judged
figure: the performance target is the median of the alternating rounds'
ratios. But on a 2-CPU virtual machine the host's speed can move from one
round to the next by more than the two services differ by, and rounds one
after the other take that out only when it is even over the run
(docs/reference/performance.md has runs where it was not). Here the two run
at once, each with half of the clients, as the outbox's cost is judged
(bench/outbox.py): whatever slows the machine slows both alike, and the
fakes and PostgreSQL serve both in the same moments.

Each round counts, per payment that succeeded on each side:

    phased   its API's CPU and its database sessions', and the worker's
             CPU and its sessions': the safe service's own process, which
             sweeps (recovery, retention, reconciliation) whether or not
             there is work; the twin has none
    naive    its API's CPU and its database sessions'

and each side's payments per second. The fakes and PostgreSQL's
background processes serve both and are charged to neither. A session is
told apart by its client port (bench/sessions.py); over a Unix socket none
is anyone's, and the database's figures are then n/a.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import asyncpg

from bench.load import Load, RunResult
from bench.sessions import Mark, Meter
from bench.system import Service

SIDES = ("phased", "naive")
ROUNDS = 6


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


async def side_by_side(apis: dict[str, Service], worker: Service | None, loads: dict[str, Load], server_url: str,
                       count: int, seconds: float, warmup: float = 1.0
                       ) -> tuple[dict[str, Any], dict[str, list[RunResult]]]:
    """`count` rounds of new payments against both APIs at once: the figures, and each side's results to check.

    Before the rounds, both sides run `warmup` seconds, not counted.
    """
    conn = await asyncpg.connect(server_url)
    meter = Meter(conn, server_url, {**apis, **({"worker": worker} if worker is not None else {})})
    rounds: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {side: [] for side in SIDES}
    try:
        await asyncio.gather(*(loads[side].new_payments(warmup) for side in SIDES))
        for _ in range(count):
            before = await meter.mark()
            ran = dict(zip(SIDES, await asyncio.gather(*(loads[side].new_payments(seconds) for side in SIDES))))
            rounds.append(round_figures(before, await meter.mark(), ran))
            for side in SIDES:
                results[side].append(ran[side])
    finally:
        await conn.close()
    return summary(rounds), results


def round_figures(before: Mark, after: Mark, ran: dict[str, RunResult]) -> dict[str, Any]:
    """One round's figures per payment on each side, and its phased ÷ naive ratios.

    The worker is the phased side's; the database's figures are n/a unless
    the sessions could be told apart (some session is the twin's).
    """
    mapped = any(after.owner.get(pid) == "naive" for pid in after.sessions)
    figures: dict[str, Any] = {}
    for side in SIDES:
        api, sessions = Meter.spent(before, after, side)
        n = max(1, ran[side].succeeded)
        f = {"payments": ran[side].succeeded, "per_second": round(ran[side].per_second, 1),
             "api_ms": round(1000 * api / n, 4), "sessions_ms": round(1000 * sessions / n, 4) if mapped else None}
        if side == "phased":
            worker, worker_sessions = Meter.spent(before, after, "worker")
            f["worker_ms"] = round(1000 * (worker + worker_sessions) / n, 4) if mapped else None
        f["service_ms"] = round(f["api_ms"] + f["sessions_ms"] + (f.get("worker_ms") or 0.0), 4) if mapped else None
        figures[side] = f
    phased, naive = figures["phased"], figures["naive"]
    figures["rate_ratio"] = _ratio(phased["per_second"], naive["per_second"])
    figures["cpu_ratio"] = _ratio(phased["service_ms"], naive["service_ms"])
    figures["db_ratio"] = _ratio(phased["sessions_ms"], naive["sessions_ms"])
    return figures


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over rounds of each side's figures per payment, and of the rounds' phased ÷ naive ratios."""
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return round(statistics.median(present), 4) if present else None

    parts = ("per_second", "api_ms", "sessions_ms", "worker_ms", "service_ms")
    return {
        "rounds": rounds,
        **{ratio: median([r[ratio] for r in rounds]) for ratio in ("rate_ratio", "cpu_ratio", "db_ratio")},
        "medians": {side: {part: median([r[side].get(part) for r in rounds]) for part in parts
                           if any(part in r[side] for r in rounds)} for side in SIDES},
    }
