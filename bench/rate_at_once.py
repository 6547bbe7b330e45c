"""New payments through the phased service and the naive twin at the same moments: the rate without the host's drift.

`make bench` and `bench.run --rate-only` (bench/run.py) run this after the
alternating rounds at each worker count. It is a reading, not the judged
figure: the performance target is the median of the alternating rounds'
ratios. But on a 2-CPU virtual machine the host's speed can move from one
round to the next by more than the two services differ by, and rounds one
after the other take that out only when it is even over the run
(docs/reference/performance.md has runs where it was not). Here the two run
at once, each with half of the clients, as the outbox's cost is judged
(bench/outbox.py): whatever slows the machine slows both alike, and
PostgreSQL serves both in the same moments.

Each round counts, per payment that succeeded on each side:

    phased   its API's CPU and its database sessions', and the worker's
             CPU and its sessions': the safe service's own process, which
             sweeps (recovery, retention, reconciliation) whether or not
             there is work; the twin has none
    naive    its API's CPU and its database sessions'

and each side's payments per second. Each side calls a pair of fakes of
its own (bench/run.py starts both APIs afresh for this step, each with a
new pair), so the fakes' work is charged too, at the same moments:

    fakes    the fake PSP's and the fake rail's CPU and their sessions',
             and how often each was woken, per payment of the side that
             called them; and how the side's calls arrived at its fake
             PSP, spread out or bunched (`arrivals`)

and the side's whole work a payment is the service's and its fakes'. A
fake does the same work for either side, so any difference there is what
the side's calls make it do (more wake-ups, longer keys), not the host's
pace: in rounds one after the other the two cannot be told apart.
PostgreSQL's background processes and the load generator serve both and
are charged to neither. A session is told apart by its client port
(bench/sessions.py); over a Unix socket none is anyone's, and the
database's figures are then n/a.

Is the step itself fair to both sides? `bench.run --at-once naive,naive`
(or `phased,phased`) runs it with one service on both sides, the columns
keeping their names: a control. There each pair of fakes serves the same
service, so a difference between the sides is the step's own (the order
the processes started in, which load was opened first). In a control the
worker is charged to neither side: with the phased service on both it
sweeps for both.
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
FAKES = ("psp", "rail")
ROUNDS = 6
# The services on the two sides, in the order of SIDES (--at-once). The
# reading puts each on the side of its name. A control puts one service on
# both, so that whatever differs between the two sides' figures is the
# step's own doing (which pair of fakes started first, which load), not a
# service's.
READING = ("phased", "naive")
CONTROLS = (("naive", "naive"), ("phased", "phased"))


def services_of(text: str) -> tuple[str, str]:
    """--at-once's value, "phased,naive" or a control's ("naive,naive", "phased,phased"): the services of SIDES."""
    services = tuple(part.strip() for part in text.split(","))
    if services == READING or services in CONTROLS:
        return services[0], services[1]
    raise ValueError(f"--at-once takes {','.join(READING)} or a control, "
                     f"{' or '.join(','.join(c) for c in CONTROLS)}; not {text!r}")


# How each side's calls arrive at its fake PSP, read from the fake's own
# request log after each round (`at` is the database's clock as the fake
# logged the call): the median gap between a charge and the side's charge
# before it, and the share of charges that came within BUNCHED of the one
# before. A fake that finds several calls waiting serves them on one
# wake-up; one woken for each pays for each. A side is told by its keys:
# the safe service sends derived keys of 64 characters, the twin fresh
# UUIDs of 36. In a control the two are alike, and there is no figure.
KEY_LENGTHS = {"phased": 64, "naive": 36}
BUNCHED = 0.0005  # seconds
_ARRIVALS = """
SELECT key_length,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY gap) AS median_gap,
       avg((gap < $3)::int)::float8 AS bunched
  FROM (SELECT length(idempotency_key) AS key_length,
               extract(epoch FROM at - lag(at) OVER (PARTITION BY length(idempotency_key) ORDER BY at))::float8 AS gap
          FROM fake_psp.request
         WHERE method = 'POST' AND path = '/v1/charges' AND at >= $1 AND at < $2) AS calls
 WHERE gap IS NOT NULL
 GROUP BY key_length
"""


async def arrivals(rails: asyncpg.Connection, since: Any, until: Any, key_lengths: dict[str, int] | None
                   ) -> dict[str, dict[str, float]]:
    """Each side's charges at its fake PSP between `since` and `until` (the database's clock): the median gap
    to the side's charge before, in ms, and the share of charges bunched; none in a control (`key_lengths` None)."""
    if not key_lengths:
        return {}
    rows = {r["key_length"]: r for r in await rails.fetch(_ARRIVALS, since, until, BUNCHED)}
    return {side: {"psp_gap_ms": round(1000 * rows[length]["median_gap"], 3),
                   "psp_bunched": round(rows[length]["bunched"], 3)}
            for side, length in key_lengths.items() if length in rows}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def fake_role(side: str, fake: str) -> str:
    """The Meter's name for one side's fake ("phased psp")."""
    return f"{side} {fake}"


async def side_by_side(apis: dict[str, Service], worker: Service | None, fakes: dict[str, dict[str, Service]],
                       loads: dict[str, Load], server_url: str, count: int, seconds: float, warmup: float = 1.0,
                       rails_url: str | None = None, key_lengths: dict[str, int] | None = None
                       ) -> tuple[dict[str, Any], dict[str, list[RunResult]]]:
    """`count` rounds of new payments against both APIs at once: the figures, and each side's results to check.

    `fakes` is each side's own pair, by side and then "psp" and "rail"
    (FAKES); a side left out is charged no fakes. With `rails_url` (the
    fakes' database) and `key_lengths` (each side's, KEY_LENGTHS), each
    round also reads how the side's calls arrived at its fake PSP
    (`arrivals`). Before the rounds, both sides run `warmup` seconds, not
    counted.
    """
    conn = await asyncpg.connect(server_url)
    rails = await asyncpg.connect(rails_url) if rails_url and key_lengths else None
    roles = {**apis, **({"worker": worker} if worker is not None else {}),
             **{fake_role(side, fake): service for side, pair in fakes.items() for fake, service in pair.items()}}
    meter = Meter(conn, server_url, roles)
    rounds: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {side: [] for side in SIDES}
    try:
        await asyncio.gather(*(loads[side].new_payments(warmup) for side in SIDES))
        for _ in range(count):
            since = await rails.fetchval("SELECT clock_timestamp()") if rails else None
            before = await meter.mark()
            ran = dict(zip(SIDES, await asyncio.gather(*(loads[side].new_payments(seconds) for side in SIDES))))
            figures = round_figures(before, await meter.mark(), ran)
            if rails:
                until = await rails.fetchval("SELECT clock_timestamp()")
                for side, arrived in (await arrivals(rails, since, until, key_lengths)).items():
                    figures[side] |= arrived
            rounds.append(figures)
            for side in SIDES:
                results[side].append(ran[side])
    finally:
        await conn.close()
        if rails:
            await rails.close()
    return summary(rounds), results


def round_figures(before: Mark, after: Mark, ran: dict[str, RunResult]) -> dict[str, Any]:
    """One round's figures per payment on each side, and its phased ÷ naive ratios.

    The worker, when the marks hold it, is the phased side's; the
    database's figures are n/a unless the sessions could be told apart
    (some session is the twin's). A side's fakes, each with its sessions,
    are charged when the marks hold them.
    """
    mapped = any(after.owner.get(pid) == "naive" for pid in after.sessions)
    figures: dict[str, Any] = {}
    for side in SIDES:
        api, sessions = Meter.spent(before, after, side)
        n = max(1, ran[side].succeeded)
        f = {"payments": ran[side].succeeded, "per_second": round(ran[side].per_second, 1),
             "api_ms": round(1000 * api / n, 4), "sessions_ms": round(1000 * sessions / n, 4) if mapped else None}
        if side == "phased" and "worker" in after.processes:
            worker, worker_sessions = Meter.spent(before, after, "worker")
            f["worker_ms"] = round(1000 * (worker + worker_sessions) / n, 4) if mapped else None
        f["service_ms"] = round(f["api_ms"] + f["sessions_ms"] + (f.get("worker_ms") or 0.0), 4) if mapped else None
        if all(fake_role(side, fake) in after.processes for fake in FAKES):
            for fake in FAKES:
                process, fake_sessions = Meter.spent(before, after, fake_role(side, fake))
                f[f"{fake}_ms"] = round(1000 * (process + fake_sessions) / n, 4) if mapped else None
                f[f"{fake}_wakeups"] = round(Meter.woken(before, after, fake_role(side, fake)) / n, 3)
            f["fakes_ms"] = round(f["psp_ms"] + f["rail_ms"], 4) if mapped else None
            f["whole_ms"] = round(f["service_ms"] + f["fakes_ms"], 4) if mapped else None
        figures[side] = f
    phased, naive = figures["phased"], figures["naive"]
    figures["rate_ratio"] = _ratio(phased["per_second"], naive["per_second"])
    figures["cpu_ratio"] = _ratio(phased["service_ms"], naive["service_ms"])
    figures["db_ratio"] = _ratio(phased["sessions_ms"], naive["sessions_ms"])
    figures["fakes_ratio"] = _ratio(phased.get("fakes_ms"), naive.get("fakes_ms"))
    figures["whole_ratio"] = _ratio(phased.get("whole_ms"), naive.get("whole_ms"))
    return figures


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The medians over rounds of each side's figures per payment, and of the rounds' phased ÷ naive ratios."""
    def median(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return round(statistics.median(present), 4) if present else None

    parts = ("per_second", "api_ms", "sessions_ms", "worker_ms", "service_ms", "psp_ms", "rail_ms", "fakes_ms",
             "whole_ms", "psp_wakeups", "rail_wakeups", "psp_gap_ms", "psp_bunched")
    ratios = ("rate_ratio", "cpu_ratio", "db_ratio", "fakes_ratio", "whole_ratio")
    return {
        "rounds": rounds,
        **{ratio: median([r.get(ratio) for r in rounds]) for ratio in ratios},
        "medians": {side: {part: median([r[side].get(part) for r in rounds]) for part in parts
                           if any(part in r[side] for r in rounds)} for side in SIDES},
    }
