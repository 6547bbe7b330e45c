"""`make bench`: what exactly-once costs, measured against the same flow without it.

The phased service (`payments api`) and its naive twin (`naive-twin`,
the same five steps with no keys, no phases, no fencing) run side by side on
this machine, against the same PostgreSQL, fake PSP and fake rail. The bench
drives each in turn with the same load and prints ratios, because only
ratios measured in one run mean anything: runs of one configuration drift
from one minute to the next (docs/reference/performance.md), and a figure
from another machine or another day is not comparable at all.

The figures, and why each matters (the ones with targets are in the "targets" table):

the cost of watching: new payments/s and replays/s with metrics and logs
(the defaults) ÷ with them switched off (METRICS_ENABLED=false,
LOG_LEVEL=WARNING), side by side in the same rounds
    Watching the service must not slow it down noticeably: the target is at
    least 0.95x for both (docs/operations.md#what-watching-costs).
new payments/s and p50 / p99 latency, phased vs naive, and their ratio
    The price of safety. The phased service does more per payment (a key
    row, leases, fencing, a stored response) but commits three times where
    the twin commits five; the target is at least the twin's rate (1.0x,
    the median of the rounds' own ratios) with a p99 at most 2x the twin's,
    and the service database's backends spending no more CPU per payment
    than the twin's. p99 shows the queueing that a mean hides; the ratio's
    min-max over the rounds is the run-to-run spread.
new payments, the phased service and the naive twin at once (not judged)
    The rounds above alternate, and a host whose speed moves between rounds
    favours whichever side its quick rounds fall to. After them, both run
    at the same moments, each with half of the clients and a pair of fakes
    of its own (bench/rate_at_once.py): each side's payments/s, the
    service's own CPU per payment (its API, its database sessions, and for
    the phased service its worker) and its fakes', and how its calls
    arrive at its fake PSP, with the host's moves shared by both.
new payments/s with webhooks, and its ratio to the phased service without
    The outbox's cost: the "webhooks" variant is the phased service paid by
    a client with a webhook endpoint, so every payment also writes its event
    and delivery, and one `payments worker` POSTs them to the fake merchant
    during the run. The undelivered backlog at the start and end of each
    run shows whether the dispatcher keeps up (it must not grow). These
    rounds run at other moments than the phased ones, and the fake
    merchant's work (which a real merchant's machine does) slows only
    theirs, so the target is judged after them, side by side
    (bench/outbox.py): new payments with and without webhooks at the same
    time, each API with half of the clients, and the service's own CPU per
    payment (its API, its worker, their database sessions) compared; once
    with the fake merchant taking one event a POST, then with it taking
    lists of up to --events-per-post (docs/outbox-inbox.md#several-events-in-one-post).
    The target, judged on the second: with webhooks at most 1.05x without.
replays/s and p50 / p99 (phased only)
    A retry of a finished payment must be answered from the stored response,
    without touching the PSP or the rail. Clients retry when the system is
    struggling, so a replay has to be much cheaper than a payment: the
    target is at least 10x the new-payment rate.
writing transactions per payment (from the WAL), and xact_commit per payment
    See bench/costs.py: the target is 3 per payment (the twin does 5).
refunds/s beside new payments/s, and writing transactions per refund
    The second operation on the machine, priced like the first: partial
    refunds of the payments the phased rounds made, after every other step
    (so no figure above moves). A refund that the PSP takes at once is two
    writing transactions, the target: the claim (key row, the amount
    reserved on the payment, the refund created) and the PSP's answer
    recorded (the refund, its ledger posting, the key row finished). Its
    check: one PSP refund per refund, each posted and balanced, each
    payment's refunded amount its refunds' sum.
CPU ms per payment, by process
    See bench/costs.py: who spends the machine's two cores.
the kernel's part of the CPU, wake-ups and preemptions per payment, the API's and the fakes'
    See bench/costs.py: whether the two sides' calls reach the fakes alike, and
    where a process's CPU went when it differs between them.
the API's CPU by worker process, at 2 or more workers per API
    Each round's split between the worker processes, and the busiest's CPU ÷
    the idlest's: a worker left with few of the keep-alive connections
    leaves the API bound by one process's CPU. The target: at most 1.2x in
    the least even round. Beside it, for each worker, the clients'
    connections it held at the end, the answers it gave on them, and how
    long it waited for a CPU: a worker that spent more because it served
    more, given more of the CPUs, shows even CPU an answer; one that spent
    more on each answer does not.
the database-only ceiling (pgbench)
    See bench/ceiling.py: our rate as a fraction of what PostgreSQL alone
    could do with the same statements.
exactly-once
    See bench/checks.py: checked after every run; FAIL exits with status 1.

How it runs (most of the time is the measured runs: with three rounds, the earlier default, it took
20-25 minutes on a 2-CPU machine; now five; `--rate-only` runs the rounds of phased and naive alone, and
both at once,
`--outbox-only` the side-by-side rounds with and without webhooks alone, with a warm-up of their own,
`--watching-only` the watching step alone, the run's own pair given payments to replay by a warm-up):

    create payments_bench and payments_bench_rails; start the fake PSP and rail
    for each worker count (1, then 2):
        start `payments api --workers N` three times (watched: the defaults;
        unwatched: metrics off, logging at WARNING; webhooks: the defaults
        again, in a process of its own) and `naive-twin --workers N`
        for each round: phased, unwatched, webhooks, naive (odd rounds), the reverse (even)
        (webhooks: the phased service paid by a client with a webhook endpoint,
        while a worker's dispatcher delivers to the fake merchant):
            warm-up (not counted); the measured run; the exactly-once check;
            idle until PostgreSQL has published its statistics
        new payments, phased and naive at once (bench/rate_at_once.py), both
        APIs started afresh, each with a new pair of fakes: a warm-up, then
        6 rounds of half a measured run, each side checked;
        idle until PostgreSQL has published their statistics
        replays of each one's last finished keys: 3 s of each, not counted
        (settling), and idle until PostgreSQL has published them; then in
        the order watched, unwatched, unwatched, watched, unwatched,
        watched, watched, unwatched, a quarter of the replay time each:
        warm-up, run, check
        the same replays, watched and unwatched at once on one CPU
        (bench/watching.py): 8 rounds on the run's own two APIs, then
        on two more pairs started for the step, each after a measured
        run's time of new payments through both at once (checked); the
        watching target for replays is the median of the three pairs
        new payments with and without webhooks at once (bench/outbox.py),
        the merchant taking one event a POST, then lists (the judged pass):
        each pass the worker's CPU at rest for 5 s, then 6 rounds of a quarter
        of a measured run, each until its webhooks are delivered: the outbox's target
        idle until PostgreSQL has published the side-by-side steps' statistics;
        refunds through the phased API of the rounds' phased and unwatched
        payments, oldest first, each once, then again: warm-up, a measured
        run as long as a round's, check
        stop the APIs
    the batch round (bench/batches.py): a 10,000-row batch over a NATS server of its own, alone between
    two HTTP runs (the time from upload to batch.completed), then another beside HTTP clients at the
    same moments (rows/s over new payments/s, target 0.9x), checked row by row
    pgbench with the service's SQL (the ceiling); report; JSON

Alternating the order cancels drift (a warming cache, a growing table, a
noisy neighbour) between the variants instead of charging it to one of
them. Everything is on one machine: the load generator and the fakes take
their share of the CPU (the CPU table says how much), which is why the same
code is faster on a bigger machine and why only the ratios travel.

Results: the terminal, bench/results/bench-<UTC timestamp>.json (every figure,
per round too), service logs in bench/results/logs/.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import aiohttp
import asyncpg
import psutil
import typer

from app.admin import create_client
from app.outbox.endpoints import MAX_EVENTS_PER_POST
from bench import batches, ceiling, costs, outbox, rate_at_once, report, watching
from bench.checks import Check, exactly_once, refunds_check, replays_check
from bench.costs import STATS_SETTLE_SECONDS, CpuMeter, Wal, WalCount, WorkerShare
from bench.load import Load, Paid, RunResult, latency_ms, refund_order
from bench.report import REFUNDS
from bench.system import (
    NAIVE, PHASED, RESULTS, UNWATCHED, WEBHOOKS, Databases, Server, Service, api, apis, console, database_server, fakes,
    merchant_and_worker, prepare_databases, register_webhook, running, set_events_per_post,
)

REPLAY_KEYS = 1000
# Who "the service" is when the outbox's cost is counted in CPU: the API, the
# worker (whose dispatcher sends the webhooks) and the service database's
# sessions; not the fakes, the fake merchant, or the load generator.
SERVICE_ROLES = ("API", "worker", costs.PG_PARTS[costs.SERVICE_DATABASE])
# Replays of each variant before the measured ones (not counted).
SETTLE_REPLAY_SECONDS = 3.0
# Rounds of replays with the watched and unwatched APIs at once on one CPU
# (bench/watching.py), each a quarter of the replay time.
SIDE_BY_SIDE_ROUNDS = 8
# Pairs of watched and unwatched APIs those rounds are run on: the run's
# own, then fresh ones; the target judges the median of the pairs.
WATCHING_PAIRS = 3
# Rounds of new payments through the same pairs, watched and unwatched at
# once, each with half of the clients, each a quarter of a measured run:
# the judged figure of watching's cost to a new payment.
WATCHING_NEW_ROUNDS = 4
# Rounds of new payments with and without webhooks at once (bench/outbox.py),
# each a quarter of a measured run.
OUTBOX_ROUNDS = 6
# Rounds of new payments through the phased service and the naive twin at once
# (bench/rate_at_once.py), each half a measured run: a reading beside the rate.
RATE_AT_ONCE_ROUNDS = rate_at_once.ROUNDS
# The fake merchant's endpoint in those rounds: first one event a POST, then
# up to this many in one POST (docs/outbox-inbox.md#several-events-in-one-post),
# the pass the outbox's target judges. As many as one read of the
# dispatcher's default slots can take.
LIST_SIZE = 16
# The kind of a replay run, by the variant that answers it.
REPLAYS = {PHASED: "replays", UNWATCHED: "replays-unwatched"}
T = TypeVar("T")
DEFAULT_WORKERS = "1,2"
RUNS = 5  # the rate is the median of the rounds' ratios: five give it a middle that one bad round cannot move


@dataclass(frozen=True)
class Params:
    concurrency: int
    duration: float
    warmup: float
    runs: int
    workers: list[int]
    replay_duration: float
    pgbench_duration: float
    rate_only: bool = False  # only the rounds of new payments, phased and naive (--rate-only)
    outbox_only: bool = False  # only the rounds with and without webhooks at once (--outbox-only)
    watching_only: bool = False  # only the watching step, new payments and replays at once (--watching-only)
    events_per_post: int = LIST_SIZE  # the endpoint's list size in the judged outbox rounds (--events-per-post)
    at_once: tuple[str, str] = rate_at_once.READING  # the services on the two sides of the rounds at once (--at-once)


@dataclass
class Measured:
    """One measured run: what the clients saw, and what it cost."""

    kind: str  # "phased", "unwatched", "webhooks", "naive", "replays", "replays-unwatched" or "refunds"
    workers: int
    round: int
    warm: RunResult
    result: RunResult
    wal: WalCount | str = "not measured"
    xact_delta: int | None = None
    cpu: dict[str, float] = field(default_factory=dict)  # CPU seconds by process during the run
    wakeups: dict[str, int] = field(default_factory=dict)  # wake-ups by process of ours during the run
    preemptions: dict[str, int] = field(default_factory=dict)  # times taken off a CPU with work left, the same
    kernel: dict[str, float] = field(default_factory=dict)  # the kernel's CPU seconds for each process of ours
    api_workers: list[WorkerShare] = field(default_factory=list)  # each of the API's worker processes, the busiest first
    others: list[tuple[str, float]] = field(default_factory=list)  # the busiest processes not ours
    checks: list[Check] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)  # seconds of the bench's own time, by step
    # The webhooks variant: webhooks the fake merchant had not applied when
    # the measured run started and when it ended, how long after the end the
    # dispatcher took to deliver the rest, and the merchant's applied and our
    # given-up (dead) deliveries so far.
    backlog: dict[str, float | int | None] = field(default_factory=dict)
    # The refunds: how many payments there were to refund, and how many refunds were sent.
    pool: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        n = self.result.succeeded
        window = self.warm.succeeded + n
        return {
            "kind": self.kind,
            "workers": self.workers,
            "round": self.round,
            "warmup": {"requests": self.warm.requests, "succeeded": self.warm.succeeded},
            "run": self.result.summary(),
            "wal": self.wal.to_json(n) if isinstance(self.wal, WalCount) else {"n/a": self.wal},
            "xact_commit": {
                "delta": self.xact_delta,
                "operations": window,
                "per_operation": None if self.xact_delta is None or not window else self.xact_delta / window,
            },
            "cpu_seconds": {k: round(v, 3) for k, v in self.cpu.items()},
            "cpu_seconds_api_by_process": [w.cpu_seconds for w in self.api_workers],
            "api_connections_by_process": [w.connections for w in self.api_workers],
            # The same order (the busiest first): each worker's answers, its wait for a CPU, and
            # the answers on connections closed before the end, which no worker is credited with.
            "api_workers": [w.to_json() for w in self.api_workers],
            "api_answers_unplaced": self.result.answered.total() - sum(w.requests for w in self.api_workers)
            if self.api_workers else None,
            "cpu_seconds_busiest_other_processes": dict(self.others),
            "cpu_ms_per_operation": {k: round(v * 1000 / n, 3) if n else None for k, v in self.cpu.items()},
            "wakeups": self.wakeups,
            "preemptions": self.preemptions,
            "cpu_seconds_in_kernel": {k: round(v, 3) for k, v in self.kernel.items()},
            "machine_busy_percent": round(100 * self.cpu.get(costs.MACHINE, 0.0)
                                          / (self.result.elapsed * (os.cpu_count() or 1)), 1)
            if self.result.elapsed else None,
            "bench_seconds": self.timings,
            **({"webhook_backlog": self.backlog} if self.backlog else {}),
            **({"refund_pool": self.pool} if self.pool else {}),
            "exactly_once": {"pass": self.passed,
                             "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks]},
        }


def verdict(checks: list[Check]) -> dict[str, Any]:
    """The exactly-once verdict of a side-by-side step: pass, and the first few failed checks."""
    return {"pass": all(c.ok for c in checks),
            "checks": [{"check": c.name, "ok": c.ok, "detail": c.detail} for c in checks if not c.ok][:5]}


class Bench:
    """The measured runs of one bench, on one server, with one pair of fakes."""

    def __init__(self, params: Params, server: Server, dbs: Databases, psp: Service, rail: Service,
                 extra: list[Service] | None = None) -> None:
        self.params, self.server, self.dbs, self.psp, self.rail = params, server, dbs, psp, rail
        self.merchant, self.worker = extra or (None, None)
        self.runs: list[Measured] = []
        self.side_by_side: dict[str, dict[str, Any]] = {}  # by worker count
        self.outbox: dict[str, dict[str, Any]] = {}  # by worker count
        self.rate_at_once: dict[str, dict[str, Any]] = {}  # by worker count
        self.settled = 0  # xact_commit when PostgreSQL last published everything

    async def __call__(self) -> dict[str, Any]:
        self.conn = await asyncpg.connect(self.server.url)  # the `postgres` database: reading counts nothing
        try:
            self.wal = Wal(self.conn, self.server)
            await self.wal.setup()
            if self.wal.available:
                await self.wal.learn_tables(self.dbs.service_url)
            else:
                console.print(f"[yellow]writing transactions per payment: n/a[/] ({self.wal.reason})")
            self.cpu = CpuMeter(self.conn)
            await self.cpu.setup()
            about = await machine(self.conn)
            for workers in self.params.workers:
                await self.worker_count(workers)
            p = self.params
            only = p.rate_only or p.outbox_only or p.watching_only
            batch_figures = {} if only else await batches.measure(
                self.dbs, self.psp, self.rail, concurrency=p.concurrency, duration=p.duration, warmup=p.warmup)
            ceiling_figures = {} if only else await self.ceiling()
        finally:
            await self.wal.release()
            await self.conn.close()
        return {
            "machine": about,
            "runs": [m.to_json() for m in self.runs],
            "watching_side_by_side": self.side_by_side,
            "outbox_side_by_side": self.outbox,
            "rate_at_once": self.rate_at_once,
            "pooled_latency_ms": self.pooled_latency(),
            "ceiling": ceiling_figures,
            "batches": batch_figures,
        }

    def pooled_latency(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """Percentiles over all rounds' requests together, per worker count and kind."""
        pooled: dict[str, dict[str, list[float]]] = {}
        for m in self.runs:
            pooled.setdefault(str(m.workers), {}).setdefault(m.kind, []).extend(m.result.latencies)
        return {w: {kind: latency_ms(sorted(v)) for kind, v in kinds.items()} for w, kinds in pooled.items()}

    async def worker_count(self, workers: int) -> None:
        p = self.params
        services = apis(self.dbs.service_url, self.psp, self.rail, workers)
        if p.outbox_only:  # the two APIs it compares, and no others idling on the same CPUs
            services = {variant: services[variant] for variant in (PHASED, WEBHOOKS)}
        if p.watching_only:  # likewise
            services = {variant: services[variant] for variant in (PHASED, UNWATCHED)}
        with running(list(services.values())):
            if p.outbox_only:
                console.rule(f"{workers} worker{'s' if workers > 1 else ''} per API: {OUTBOX_ROUNDS} rounds of "
                             f"new payments with and without webhooks at once, {p.concurrency} clients")
                await self.outbox_side_by_side(services, workers, warmup=max(1.0, p.warmup))
                return
            if p.watching_only:
                console.rule(f"{workers} worker{'s' if workers > 1 else ''} per API: watched and unwatched at once, "
                             f"{WATCHING_PAIRS} pairs of APIs, {p.concurrency} clients")
                await self.watching_alone(services, workers)
                return
            console.rule(f"{workers} worker{'s' if workers > 1 else ''} per API: "
                         f"{p.runs} round{'s' if p.runs > 1 else ''} of {p.duration:g} s each, {p.concurrency} clients")
            self.settled = await costs.xact_commit(self.conn)  # the APIs have not run a query yet
            last: dict[str, list[Paid]] = {}
            refundable: list[Paid] = []  # every payment of the phased service's rounds, oldest first
            for round_ in range(1, p.runs + 1):
                order = (PHASED, UNWATCHED, WEBHOOKS, NAIVE) if round_ % 2 else (NAIVE, WEBHOOKS, UNWATCHED, PHASED)
                if p.rate_only:
                    order = tuple(v for v in order if v in (PHASED, NAIVE))
                for variant in order:
                    if variant == WEBHOOKS:
                        await self.webhooks_round(services[WEBHOOKS], workers, round_)
                        continue
                    async with Load(services[variant].url, self.dbs.api_key, p.concurrency) as load:
                        measured = await self.measure(
                            variant, workers, round_, services[variant], load.new_payments, p.duration,
                            lambda run, v=variant: exactly_once(
                                v, self.dbs.service_url, self.dbs.rails_url, self.dbs.client_id, run),
                        )
                    last[variant] = measured.result.paid
                    if variant in (PHASED, UNWATCHED):
                        refundable += measured.warm.paid + measured.result.paid
            await self.rate_side_by_side(workers)
            if p.rate_only:
                return
            # Replays, watched and unwatched, in the order A B B A B A A B,
            # each for a quarter of the replay time: drift between them
            # cancels as in the rounds, and a burst of other work on the
            # machine during one run weighs a quarter of its variant's mean.
            # First one settling run of each, not counted: the first replay
            # run after the new-payment rounds was the slowest in three runs
            # of the bench out of three, which the order would charge to A.
            for variant in (PHASED, UNWATCHED):
                if not last.get(variant):
                    console.print(f"[red]no {variant} payment finished: nothing to replay[/]")
                    return
                async with Load(services[variant].url, self.dbs.api_key, p.concurrency) as load:
                    await load.replays(last[variant][:REPLAY_KEYS], SETTLE_REPLAY_SECONDS)
            await self.settle_statistics(workers)  # the first measured replays' xact_commit: theirs, not these
            replay_rounds: Counter[str] = Counter()
            order = (PHASED, UNWATCHED, UNWATCHED, PHASED, UNWATCHED, PHASED, PHASED, UNWATCHED)
            for variant in order:
                replayed = last[variant][:REPLAY_KEYS]
                replay_rounds[variant] += 1
                async with Load(services[variant].url, self.dbs.api_key, p.concurrency) as load:
                    await self.measure(
                        REPLAYS[variant], workers, replay_rounds[variant], services[variant],
                        lambda duration, r=replayed: load.replays(r, duration), p.replay_duration / 4,
                        lambda run, r=replayed: replays_check(self.dbs.rails_url, run, r),
                    )
            await self.watching_side_by_side(services, last, workers)
            await self.outbox_side_by_side(services, workers)
            await self.refund_round(services[PHASED], refundable, workers)

    async def settle_statistics(self, workers: int) -> None:
        """Idle until PostgreSQL has published every commit so far, and count from there.

        A measured run's xact_commit is the difference from the count when
        the statistics last settled; work that is not a measured run (the
        steps side by side, the replays that settle the APIs) would otherwise
        be charged to the next one.
        """
        with console.status(f"[{workers}w] idling {STATS_SETTLE_SECONDS:g} s for PostgreSQL's statistics"):
            await asyncio.sleep(STATS_SETTLE_SECONDS)
            self.settled = await costs.xact_commit(self.conn)

    async def rate_side_by_side(self, workers: int) -> None:
        """New payments through the phased service and the naive twin at once (bench/rate_at_once.py).

        Not judged: the rate's target is the median of the alternating
        rounds above. Here both sides share every moment of the machine, so
        a host that changes speed between rounds cannot favour either.
        Each side calls a pair of fakes of its own, so that the fakes' work
        can be charged to it: for this step both sides are started afresh,
        each API with a new pair, alike. The worker stays the one of the
        run, and is charged to the phased side. With --at-once naive,naive
        or phased,phased the step is a control, one service on both sides
        (bench/rate_at_once.py).
        """
        services = self.params.at_once
        control = services != rate_at_once.READING
        both: dict[str, Service] = {}
        pairs: dict[str, dict[str, Service]] = {}
        for side, variant in zip(rate_at_once.SIDES, services):
            psp, rail = fakes(self.dbs.rails_url, whose=f"{side} at once")
            both[side] = api(self.dbs.service_url, psp, rail, workers, variant, whose="at once")
            pairs[side] = {"psp": psp, "rail": rail}
        seconds = max(1.0, self.params.duration / 2)
        half = max(1, self.params.concurrency // 2)
        started = [service for side in both for service in (pairs[side]["psp"], pairs[side]["rail"], both[side])]
        pairing = f"{services[0]} and {services[1]}" + (" (a control)" if control else "")
        with running(started), console.status(
                f"[{workers}w] new payments, {pairing} at once: {RATE_AT_ONCE_ROUNDS} rounds of {seconds:g} s"):
            async with Load(both["phased"].url, self.dbs.api_key, half) as phased, \
                    Load(both["naive"].url, self.dbs.api_key, half) as naive:
                # In a control the worker is charged to neither side: with the
                # phased service on both, it sweeps for both.
                figures, results = await rate_at_once.side_by_side(
                    both, None if control else self.worker, pairs, {"phased": phased, "naive": naive},
                    self.server.url, RATE_AT_ONCE_ROUNDS, seconds, rails_url=self.dbs.rails_url,
                    key_lengths=None if control else rate_at_once.KEY_LENGTHS)
            checks: list[Check] = []
            for side, variant in zip(rate_at_once.SIDES, services):
                for result in results[side]:
                    checks += await exactly_once(variant, self.dbs.service_url, self.dbs.rails_url,
                                                 self.dbs.client_id, result)
        self.rate_at_once[str(workers)] = {"rounds": RATE_AT_ONCE_ROUNDS, "seconds": seconds, "figures": figures,
                                           "services": dict(zip(rate_at_once.SIDES, services)),
                                           "exactly_once": verdict(checks)}
        if not self.params.rate_only:  # the replays' xact_commit after this must be theirs alone
            await self.settle_statistics(workers)
        m = figures["medians"]
        console.print(f"[{workers}w] new payments, {pairing} at once: payments/s phased ÷ naive "
                      f"{report.fmt(figures['rate_ratio'], 3)} ({report.fmt(m['phased'].get('per_second'))} ÷ "
                      f"{report.fmt(m['naive'].get('per_second'))}); the service's CPU per payment "
                      f"{report.fmt(m['phased'].get('service_ms'), 2)} ÷ {report.fmt(m['naive'].get('service_ms'), 2)} "
                      f"ms, ratio {report.fmt(figures['cpu_ratio'], 3)}; its database sessions' ratio "
                      f"{report.fmt(figures['db_ratio'], 3)}; its fakes' {report.fmt(figures['fakes_ratio'], 3)}; "
                      f"with its fakes {report.fmt(m['phased'].get('whole_ms'), 2)} ÷ "
                      f"{report.fmt(m['naive'].get('whole_ms'), 2)} ms, ratio {report.fmt(figures['whole_ratio'], 3)} "
                      f"(medians of {RATE_AT_ONCE_ROUNDS} rounds); exactly-once "
                      + ("ok" if all(c.ok for c in checks) else "[red]FAILED[/]"))

    async def watching_alone(self, services: dict[str, Service], workers: int) -> None:
        """--watching-only: the watching step, its own pair first given payments to replay by a warm-up.

        In a full run the rounds before the step leave the run's own pair
        the payments it replays; here each API serves new payments for
        the run's warm-up time (at least a second), one after the other,
        each payment checked, and the step runs as in a full run.
        """
        last: dict[str, list[Paid]] = {}
        checks: list[Check] = []
        with console.status(f"[{workers}w] the run's own APIs: new payments to replay, one after the other"):
            for variant in (PHASED, UNWATCHED):
                async with Load(services[variant].url, self.dbs.api_key, self.params.concurrency) as load:
                    result = await load.new_payments(max(1.0, self.params.warmup))
                checks += await exactly_once(variant, self.dbs.service_url, self.dbs.rails_url, self.dbs.client_id,
                                             result)
                last[variant] = result.paid
        if not all(last.values()):  # a failure of the bench: no step to run
            checks.append(Check("the run's own APIs served new payments", False, "no payment finished"))
            self.side_by_side[str(workers)] = {"exactly_once": verdict(checks)}
            console.print(f"[red]{workers}w: no payment finished: nothing to replay[/]")
            return
        await self.watching_side_by_side(services, last, workers, checks)

    async def watching_side_by_side(self, services: dict[str, Service], last: dict[str, list[Paid]],
                                    workers: int, checks_before: list[Check] | None = None) -> None:
        """New payments and replays, watched and unwatched at once (bench/watching.py): the judged figures.

        The runs above, one after the other, drift by more than the 5% the
        target allows; here whatever slows the machine slows both alike. What
        the rounds of one pair of processes cannot remove is that pair's own
        luck, which each of its rounds carries (bench/watching.py::across_pairs):
        so the run's own pair is measured, then `WATCHING_PAIRS - 1` pairs
        started for the step, and each target judges the median of the pairs.
        Each pair first serves new payments at once (`watching_new_payments`),
        then replays at once on one CPU (`watching_pair`); a fresh pair
        replays the payments it has just served. `checks_before`: those of
        the payments `last` holds, when this step is the run's only one
        (`watching_alone`), in the step's verdict.
        """
        own = {"on": services[PHASED], "off": services[UNWATCHED]}
        paid = {"on": last[PHASED][:REPLAY_KEYS], "off": last[UNWATCHED][:REPLAY_KEYS]}
        new, _, checks = await self.watching_new_payments(own, workers, "the run's own APIs")
        pairs = [await self.watching_pair(own, paid, workers, "the run's own APIs", checks) | {"new_payments": new}]
        unpaired: list[Check] = []  # a fresh pair's checks when it has no rounds to carry them
        for number in range(2, WATCHING_PAIRS + 1):
            whose = f"watching pair {number}"
            fresh = {"on": api(self.dbs.service_url, self.psp, self.rail, workers, PHASED, whose=whose),
                     "off": api(self.dbs.service_url, self.psp, self.rail, workers, UNWATCHED, whose=whose)}
            with running(list(fresh.values())):
                new, served, checks = await self.watching_new_payments(fresh, workers, whose)
                if not all(served.values()):  # a failure of the bench, not a pair to leave out quietly
                    unpaired += checks + [Check(f"{whose} served new payments", False, "no payment finished")]
                    console.print(f"[red]{whose}: no payment finished: nothing to replay[/]")
                    continue
                pairs.append(await self.watching_pair(fresh, served, workers, f"{whose}, started for the step",
                                                      checks) | {"new_payments": new})
        judged = watching.across_pairs([pair["figures"] for pair in pairs])
        judged_new = watching.across_pairs([pair["new_payments"] for pair in pairs])
        self.side_by_side[str(workers)] = {
            "rounds": SIDE_BY_SIDE_ROUNDS, "seconds": pairs[0]["seconds"], "pairs": pairs, "judged": judged,
            "new_payments": {"rounds": WATCHING_NEW_ROUNDS, "seconds": self.watching_new_seconds,
                             "judged": judged_new},
            "exactly_once": verdict([check for pair in pairs for check in pair.pop("checks")] + unpaired
                                    + list(checks_before or [])),
        }
        for what, each, figures in (("new payments", "payment", judged_new), ("replays", "replay", judged)):
            console.print(f"[{workers}w] {what} side by side, judged over {figures['pairs']} of the "
                          f"{figures['measured']} pairs of APIs measured: "
                          f"watched ÷ unwatched, {what}/s {report.fmt(figures['rate_ratio'], 3)} (pairs "
                          f"{', '.join(f'{r:.3f}' for r in figures['rate_ratio_per_pair'])}), API CPU per "
                          f"{each} {report.fmt(figures['cpu_ratio'], 3)} (pairs "
                          f"{', '.join(f'{r:.3f}' for r in figures['cpu_ratio_per_pair'])}); medians of the pairs")

    @property
    def watching_new_seconds(self) -> float:
        return max(1.0, self.params.duration / WATCHING_NEW_ROUNDS)

    async def watching_new_payments(self, pair: dict[str, Service], workers: int, whose: str
                                    ) -> tuple[dict[str, Any], dict[str, list[Paid]], list[Check]]:
        """New payments through both of `pair` at once, half the clients each: watching's cost to a new payment.

        A warm-up, not counted (a fresh pair's first requests are its
        slowest), then `WATCHING_NEW_ROUNDS` rounds, each reading both APIs'
        CPU per payment and payments per second at the same moments
        (bench/watching.py::rounds). Not pinned: most of a new payment's work
        is the database's and the fakes', and pinning only the APIs would
        not make the two sides share anything more than they already do. Every
        payment is checked; the figures (bench/watching.py::summary), the
        payments to replay, and the checks.
        """
        seconds = self.watching_new_seconds
        half = max(1, self.params.concurrency // 2)
        with console.status(f"[{workers}w] new payments, watched and unwatched at once ({whose}): warm-up, then "
                            f"{WATCHING_NEW_ROUNDS} rounds of {seconds:g} s"):
            async with Load(pair["on"].url, self.dbs.api_key, half) as on, \
                    Load(pair["off"].url, self.dbs.api_key, half) as off:
                loads = {"on": on, "off": off}
                warm = dict(zip(loads, await asyncio.gather(*(load.new_payments(self.params.warmup)
                                                              for load in loads.values()))))
                measured = await watching.rounds(pair, lambda name, s: loads[name].new_payments(s),
                                                 WATCHING_NEW_ROUNDS, seconds)
        results = {name: [warm[name], *(result for _, _, result in measured[name])] for name in pair}
        checks = [check for name, variant in (("on", PHASED), ("off", UNWATCHED)) for result in results[name]
                  for check in await exactly_once(variant, self.dbs.service_url, self.dbs.rails_url,
                                                  self.dbs.client_id, result)]
        figures = watching.summary(measured)
        console.print(f"[{workers}w] new payments, watched and unwatched at once ({whose}): watched ÷ unwatched, "
                      f"API CPU per payment {report.fmt(figures['on'].get('cpu_ratio'), 3)}, payments/s "
                      f"{report.fmt(figures['on'].get('rate_ratio'), 3)} (medians of {WATCHING_NEW_ROUNDS} rounds); "
                      "exactly-once "
                      + ("ok" if all(c.ok for c in checks) else "[red]FAILED[/]"))
        paid = {name: [p for result in results[name] for p in result.paid][:REPLAY_KEYS] for name in pair}
        return figures, paid, checks

    async def watching_pair(self, pair: dict[str, Service], paid: dict[str, list[Paid]], workers: int,
                            whose: str, checks: list[Check] | None = None) -> dict[str, Any]:
        """`SIDE_BY_SIDE_ROUNDS` rounds of replays against both of `pair` at once on one CPU, and their checks."""
        seconds = max(1.0, self.params.replay_duration / 4)
        checks = list(checks or [])
        with console.status(f"[{workers}w] replays, watched and unwatched at once on one CPU ({whose}): "
                            f"{SIDE_BY_SIDE_ROUNDS} rounds of {seconds:g} s"):
            async with Load(pair["on"].url, self.dbs.api_key, self.params.concurrency // 2) as on, \
                    Load(pair["off"].url, self.dbs.api_key, self.params.concurrency // 2) as off:
                figures, results = await watching.side_by_side_replays(
                    pair, {"on": on, "off": off}, paid, SIDE_BY_SIDE_ROUNDS, seconds)
            checks += [check for name in pair for result in results[name]
                       for check in await replays_check(self.dbs.rails_url, result, paid[name])]
        on_figures = figures["on"]
        console.print(f"[{workers}w] replays side by side on one CPU ({whose}): watched ÷ unwatched, API CPU per "
                      f"replay {on_figures['cpu_ratio']:.3f}, replays/s {on_figures['rate_ratio']:.3f} (medians of "
                      f"{SIDE_BY_SIDE_ROUNDS} rounds); exactly-once "
                      + ("ok" if all(c.ok for c in checks) else "[red]FAILED[/]"))
        return {"whose": whose, "seconds": seconds, "figures": figures, "exactly_once": verdict(checks),
                "checks": checks}

    async def outbox_side_by_side(self, services: dict[str, Service], workers: int, warmup: float = 1.0) -> None:
        """New payments with and without webhooks at once (bench/outbox.py): the outbox's judged figure.

        The webhooks rounds above run at other moments than the phased
        ones, and the fake merchant's work slows only theirs; here both
        sides share every moment of the machine, the merchant's work
        included, and only the service's own CPU per payment is compared.
        Two passes: the merchant's endpoint takes one event a POST, then
        lists of up to --events-per-post (the judged figure). With
        --outbox-only the APIs have served nothing before: `warmup`, not
        counted, takes them past their first requests.
        """
        sizes = [1] + ([self.params.events_per_post] if self.params.events_per_post > 1 else [])
        passes = {}
        for size in sizes:
            await set_events_per_post(self.dbs, size)
            passes[size] = await self.outbox_pass(services, workers, size, warmup)
        self.outbox[str(workers)] = passes[sizes[-1]] | {
            "events_per_post": sizes[-1],
            **({"one_event_a_post": passes[1]} if len(sizes) > 1 else {}),
        }

    async def outbox_pass(self, services: dict[str, Service], workers: int, size: int,
                          warmup: float) -> dict[str, Any]:
        """One pass of `outbox_side_by_side`, the endpoint taking up to `size` events a POST."""
        both = {"without": services[PHASED], "with": services[WEBHOOKS]}
        seconds = max(1.0, self.params.duration / 4)
        half = max(1, self.params.concurrency // 2)
        posts = "one event a POST" if size == 1 else f"up to {size} events a POST"
        with console.status(f"[{workers}w] new payments with and without webhooks ({posts}) at once: "
                            f"{OUTBOX_ROUNDS} rounds of {seconds:g} s"):
            async with Load(both["without"].url, self.dbs.api_key, half) as without, \
                    Load(both["with"].url, self.dbs.webhook_api_key, half) as with_:
                figures, results = await outbox.side_by_side(
                    both, self.worker, {"without": without, "with": with_}, self.server.url,
                    self.dbs.service_url, self.dbs.rails_url, self.dbs.webhook_client_id, OUTBOX_ROUNDS, seconds,
                    warmup)
            checks: list[Check] = []
            for side, client_id in (("without", self.dbs.client_id), ("with", self.dbs.webhook_client_id)):
                for result in results[side]:
                    checks += await exactly_once(PHASED, self.dbs.service_url, self.dbs.rails_url, client_id, result)
            for result in results["with"]:
                ok, detail = await outbox.delivered_check(
                    self.dbs.service_url, self.dbs.rails_url, self.dbs.webhook_client_id, result)
                checks.append(Check("every payment's webhook applied by the merchant", ok, detail))
            checks.append(Check("the dispatcher delivered every round's webhooks", figures["all_drained"],
                                f"all applied {figures['drained_after_end_s']} s after each round's end"))
        m = figures["medians"]
        console.print(f"[{workers}w] new payments with and without webhooks ({posts}) at once: the service's CPU per payment "
                      f"{report.fmt(m['without'].get('service_ms'), 2)} -> {report.fmt(m['with'].get('service_ms'), 2)} "
                      f"ms, ratio {report.fmt(figures['cpu_ratio'], 3)} (median of {OUTBOX_ROUNDS} rounds); "
                      f"payments/s ratio {report.fmt(figures['rate_ratio'], 3)}; not yet applied at each round's end "
                      f"{figures['backlog_at_end']}, all applied after {figures['drained_after_end_s']} s; exactly-once "
                      + ("ok" if all(c.ok for c in checks) else "[red]FAILED[/]"))
        return {"rounds": OUTBOX_ROUNDS, "seconds": seconds, "figures": figures, "exactly_once": verdict(checks)}

    async def refund_round(self, api: Service, refundable: list[Paid], workers: int) -> None:
        """Partial refunds of the rounds' payments (bench/load.py's refund_order): refunds/s and their costs.

        It runs after every other step of this worker count, so none of their
        figures moves. The side-by-side steps before it do not count their
        commits, so the system first idles until PostgreSQL has published
        theirs: the refunds' xact_commit is then theirs alone.
        """
        p = self.params
        await self.settle_statistics(workers)
        payments = refund_order(refundable)
        async with Load(api.url, self.dbs.api_key, p.concurrency) as load:
            measured = await self.measure(
                REFUNDS, workers, 1, api, lambda duration: load.refunds(payments, duration), p.duration,
                lambda run: refunds_check(self.dbs.service_url, self.dbs.rails_url, self.dbs.client_id, run),
            )
        sent = measured.warm.requests + measured.result.requests
        measured.pool = {"payments": len(refundable), "refunds_sent": sent}
        if next(payments, None) is None:
            console.print(f"  [yellow]every one of the {len(refundable)} payments was refunded to its end before "
                          f"the {p.duration:g} s were up: the run was {measured.result.elapsed:.1f} s[/]")
        elif len(refundable) < p.concurrency:
            console.print(f"  [yellow]{len(refundable)} payments for {p.concurrency} clients: refunds of one "
                          "payment waited for each other[/]")

    async def webhooks_round(self, api: Service, workers: int, round_: int) -> None:
        """The phased service again, paid by the client with a webhook endpoint: the same load, plus the
        events' deliveries, which the worker's dispatcher POSTs to the fake merchant as the run goes.

        The backlog (the client's events the fake merchant has not applied,
        bench/outbox.py) is sampled every second of the measured run (a
        dispatcher that keeps up holds it flat), and after the run the bench
        notes how long the dispatcher takes to deliver what is left.
        """
        p = self.params
        client_id = self.dbs.webhook_client_id
        conn = await asyncpg.connect(self.dbs.service_url)
        merchant = await asyncpg.connect(self.dbs.rails_url)  # the fake merchant's records
        calls: list[float] = []  # one per drive: the warm-up, then the measured run
        samples: list[int] = []
        drained: asyncio.Task | None = None

        async def sample(stop: asyncio.Event) -> None:
            while not stop.is_set():
                samples.append(await outbox.backlog(conn, merchant, client_id))
                try:
                    await asyncio.wait_for(stop.wait(), 1.0)
                except TimeoutError:
                    pass

        try:
            async with Load(api.url, self.dbs.webhook_api_key, p.concurrency) as load:
                async def drive(duration: float) -> RunResult:
                    nonlocal drained
                    calls.append(duration)
                    if len(calls) == 1:  # the warm-up
                        return await load.new_payments(duration)
                    stop = asyncio.Event()
                    sampler = asyncio.create_task(sample(stop))
                    result = await load.new_payments(duration)
                    stop.set()
                    await sampler
                    samples.append(await outbox.backlog(conn, merchant, client_id))
                    drained = asyncio.create_task(outbox.drained(conn, merchant, client_id))
                    return result

                measured = await self.measure(
                    WEBHOOKS, workers, round_, api, drive, p.duration,
                    lambda run: exactly_once(
                        PHASED, self.dbs.service_url, self.dbs.rails_url, self.dbs.webhook_client_id, run),
                )
            measured.backlog = {
                "at_start": samples[0] if samples else None,
                "at_end": samples[-1] if samples else None,
                "max": max(samples) if samples else None,
                "samples_each_second": samples,
                "drained_after_end_s": await drained if drained else None,
                # So far in the bench: the webhooks the merchant applied, and the
                # deliveries we gave up on (a retried one keeps its row).
                "delivered": await outbox.applied(merchant),
                "dead": await conn.fetchval("SELECT count(*) FROM webhook_delivery WHERE state = 'dead'"),
            }
            b = measured.backlog
            console.print(f"  webhook backlog: {b['at_start']} at the start of the run, at most {b['max']}, "
                          f"{b['at_end']} at its end; "
                          + (f"all delivered {b['drained_after_end_s']:g} s after it" if b["drained_after_end_s"]
                             is not None else f"not all delivered {outbox.DRAIN_WAIT_SECONDS:g} s after it"))
        finally:
            if drained is not None and not drained.done():
                drained.cancel()
            await merchant.close()
            await conn.close()

    async def measure(
        self, kind: str, workers: int, round_: int, api: Service,
        drive: Callable[[float], Any], duration: float, check: Callable[[RunResult], Any],
    ) -> Measured:
        """Warm-up, the measured run, then (while PostgreSQL publishes its statistics) its costs and checks."""
        def roles() -> dict[str, list[psutil.Process]]:
            found = {"API": api.tree(), "fake PSP": self.psp.tree(), "fake rail": self.rail.tree()}
            if self.worker is not None:
                # Running in every variant (idle but for its sweeps, except in the webhooks one).
                found |= {"worker": self.worker.tree(), "fake merchant": self.merchant.tree()}
            return found

        label = f"[{workers}w] " + (f"round {round_} {kind}" if round_ else kind)
        clock = [time.monotonic()]

        def lap() -> float:
            clock.append(time.monotonic())
            return round(clock[-1] - clock[-2], 2)

        with console.status(f"{label}: warm-up {self.params.warmup:g} s"):
            warm = await drive(self.params.warmup)
        timings = {"warm-up": lap()}
        with console.status(f"{label}: {duration:g} s, {self.params.concurrency} clients"):
            start_lsn = await self.wal.start()
            before = await self.cpu.mark(roles())
            result = await drive(duration)
            after = await self.cpu.mark(roles())
            held = api.client_ports()  # while the clients' kept-alive connections are still open
            end_lsn = await self.wal.end()
        timings["run"] = lap()
        measured = Measured(kind, workers, round_, warm, result, cpu=CpuMeter.spent(before, after),
                            wakeups=CpuMeter.woken(before, after),
                            preemptions=CpuMeter.preemptions(before, after),
                            kernel=CpuMeter.kernel_part(before, after),
                            api_workers=CpuMeter.workers(before, after, "API", held, result.answered),
                            others=CpuMeter.busiest_others(before, after))
        with console.status(f"{label}: checking; idling {STATS_SETTLE_SECONDS:g} s for PostgreSQL's statistics"):
            measured.wal, measured.checks = await asyncio.gather(
                self.timed(timings, "WAL count", self.wal.count(start_lsn, end_lsn)),
                self.timed(timings, "exactly-once check", check(result)),
            )
            await self.wal.release()
            await asyncio.sleep(max(0.0, clock[-1] + STATS_SETTLE_SECONDS - time.monotonic()))
            settled = await costs.xact_commit(self.conn)
        timings["after the run"] = lap()
        measured.xact_delta, self.settled = settled - self.settled, settled
        measured.timings = timings
        self.runs.append(measured)
        console.print(report.progress_line(label, measured.to_json()))
        return measured

    @staticmethod
    async def timed(timings: dict[str, float], name: str, work: Awaitable[T]) -> T:
        started = time.monotonic()
        try:
            return await work
        finally:
            timings[name] = round(time.monotonic() - started, 2)

    async def ceiling(self) -> dict[str, Any]:
        """pgbench with the service's SQL for one payment, as a client of its own."""
        p = self.params
        binary = ceiling.pgbench_binary(self.server)
        if binary is None:
            return {"n/a": "no pgbench found (PATH, or the embedded PostgreSQL's)"}
        client_id, api_key = await asyncio.to_thread(create_client, self.dbs.service_url, "pgbench")
        try:
            path, titles = await ceiling.write_script(api_key, client_id)
        except ceiling.RecordingFailed as exc:
            return {"n/a": f"could not record the service's statements for one payment: {exc}"}
        threads = min(2, p.concurrency)
        with console.status(f"pgbench: the service's SQL for one payment, {p.concurrency} connections, "
                            f"{p.pgbench_duration:g} s"):
            process = ceiling.run_pgbench(binary, self.dbs.service_url, p.concurrency, threads, p.pgbench_duration)
            output = asyncio.create_task(asyncio.to_thread(process.communicate))
            # CPU is measured in the middle of the run, while pgbench's connections exist (a
            # backend's CPU time goes when it exits), as a rate, divided by pgbench's rate.
            margin = min(1.0, p.pgbench_duration / 4)
            await asyncio.sleep(margin)
            try:
                roles = {"pgbench": [psutil.Process(process.pid)]}
            except psutil.NoSuchProcess:  # it failed at once; parse() says why
                roles = {}
            before, t0 = await self.cpu.mark(roles), time.monotonic()
            await asyncio.sleep(max(0.5, p.pgbench_duration - 2 * margin))
            after, t1 = await self.cpu.mark(roles), time.monotonic()
            stdout, _ = await output
        result = ceiling.parse(stdout, process.returncode, titles)
        spent = CpuMeter.spent(before, after)
        spent.pop(costs.LOAD_GENERATOR, None)
        per_payment = {k: round(v / (t1 - t0) * 1000 / result.tps, 3) if result.tps else None
                       for k, v in spent.items()}
        figures = {
            "binary": binary,
            "script": str(path),
            "clients": p.concurrency,
            "threads": threads,
            "duration_s": p.pgbench_duration,
            "tps": result.tps,
            "transactions": result.transactions,
            "failed": result.failed,
            "latency_ms": result.latency_ms,
            "statement_ms": dict(result.statement_ms),
            "cpu_ms_per_payment": per_payment,
            "machine_busy_percent": round(100 * spent[costs.MACHINE] / ((t1 - t0) * (os.cpu_count() or 1)), 1),
            "pgbench_client_id": client_id,
        }
        if result.problem:
            figures["n/a"] = result.problem
        return figures


def webhook_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per worker count: the new-payment rate with webhooks over the rate without, and the backlogs."""
    summary: dict[str, Any] = {}
    for workers in sorted({r["workers"] for r in runs}):
        def rates(kind: str) -> list[float]:
            return [r["run"]["per_second"] for r in runs if r["workers"] == workers and r["kind"] == kind]

        def cpu_ms(kind: str, roles: tuple[str, ...]) -> float:
            """CPU ms per payment of `roles`, added up, the mean over the rounds of `kind`."""
            per_round = [sum(r["cpu_ms_per_operation"].get(role) or 0.0 for role in roles)
                         for r in runs if r["workers"] == workers and r["kind"] == kind]
            return sum(per_round) / len(per_round) if per_round else 0.0

        phased, hooked = rates(PHASED), rates(WEBHOOKS)
        if not phased or not hooked:
            continue
        ours_without, ours_with = cpu_ms(PHASED, SERVICE_ROLES), cpu_ms(WEBHOOKS, SERVICE_ROLES)
        summary[str(workers)] = {
            "phased_per_second": round(sum(phased) / len(phased), 1),
            "webhooks_per_second": round(sum(hooked) / len(hooked), 1),
            "ratio": round(sum(hooked) / len(hooked) / (sum(phased) / len(phased)), 3),
            # The cost to the service itself, whatever else shares the CPUs:
            # its API, its worker (the dispatcher) and its database sessions.
            "service_cpu_ms_per_payment": {"without": round(ours_without, 3), "with": round(ours_with, 3),
                                           "ratio": round(ours_with / ours_without, 3) if ours_without else None},
            "merchant_cpu_ms_per_payment": round(cpu_ms(WEBHOOKS, ("fake merchant",)), 3),
            "machine_cpu_ms_per_payment": {"without": round(cpu_ms(PHASED, (costs.MACHINE,)), 3),
                                           "with": round(cpu_ms(WEBHOOKS, (costs.MACHINE,)), 3)},
            "backlog_by_round": [r.get("webhook_backlog") for r in runs
                                 if r["workers"] == workers and r["kind"] == WEBHOOKS],
        }
    return summary


def print_webhooks(summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="the outbox's cost: the phased service with webhook endpoints vs without", title_justify="left")
    for column in ("workers", "new payments/s without", "with webhooks", "ratio",
                   "the service's CPU ms per payment: without -> with (ratio)", "the whole machine's",
                   "backlog at start -> end (max) of each run", "all delivered after the end"):
        table.add_column(column)
    for workers, w in summary.items():
        backlogs = [b or {} for b in w["backlog_by_round"]]
        ours, machine_ = w["service_cpu_ms_per_payment"], w["machine_cpu_ms_per_payment"]
        table.add_row(
            workers, f"{w['phased_per_second']:.0f}", f"{w['webhooks_per_second']:.0f}", f"{w['ratio']:.2f}",
            f"{ours['without']:.2f} -> {ours['with']:.2f} ({report.fmt(ours['ratio'], 2)})",
            f"{machine_['without']:.2f} -> {machine_['with']:.2f}",
            ", ".join(f"{b.get('at_start')} -> {b.get('at_end')} ({b.get('max')})" for b in backlogs),
            ", ".join("-" if b.get("drained_after_end_s") is None else f"{b['drained_after_end_s']:g} s"
                      for b in backlogs),
        )
    console.print(table)


def print_outbox_side_by_side(results: dict[str, Any]) -> None:
    """bench/outbox.py's rounds, per worker count: the judged figure of the outbox's cost."""
    from rich.table import Table

    sides = results.get("outbox_side_by_side", {})
    if not sides:
        return
    table = Table(title="the outbox's cost, judged: new payments with and without webhooks at the same time "
                        "(bench/outbox.py), CPU ms per payment, medians of the rounds", title_justify="left")
    for column in ("workers", "side", "API", "its DB sessions", "worker (dispatcher)", "its DB sessions",
                   "the service", "payments/s"):
        table.add_column(column, justify="right")
    for workers, judged in sides.items():
        for side in report.outbox_passes(judged):  # the pass with one event a POST first, then the judged one
            is_judged = side is judged
            posts = f"{judged.get('events_per_post', 1) if is_judged else 1} a POST"
            m = side["figures"]["medians"]
            for name in ("without", "with"):
                f = m[name]
                table.add_row(workers, name if name == "without" else f"with ({posts})",
                              report.fmt(f.get("api_ms"), 3), report.fmt(f.get("sessions_ms"), 3),
                              report.fmt(f.get("worker_ms"), 3) if name == "with" else "-",
                              report.fmt(f.get("worker_sessions_ms"), 3) if name == "with" else "-",
                              report.fmt(f.get("service_ms"), 3), report.fmt(f.get("per_second"), 0))
            rounds = side["figures"]["rounds"]
            ratio = report.fmt(side["figures"]["cpu_ratio"], 3)
            table.add_row(workers, "with ÷ without", "", "", "", "",
                          (f"[bold]{ratio}[/] (target <= {report.TARGETS['outbox'][2]:.2f}; rounds: " if is_judged
                           else f"{ratio} (not judged; rounds: ")
                          + ", ".join(report.fmt(r["cpu_ratio"], 2) for r in rounds) + ")",
                          report.fmt(side["figures"]["rate_ratio"], 3))
    console.print(table)


def outbox_verdict(results: dict[str, Any]) -> dict[str, Any]:
    """--outbox-only's summary: the outbox's target per worker count (as `blocks`, like report.summarize's),
    and the side-by-side rounds' exactly-once verdict."""
    sides = results.get("outbox_side_by_side", {})
    return {
        "blocks": [{"workers": int(workers), "targets": [report.target("outbox", side["figures"]["cpu_ratio"])]}
                   for workers, side in sides.items()],
        "exactly_once_pass": bool(sides) and all(
            p["exactly_once"]["pass"] for side in sides.values() for p in report.outbox_passes(side)),
    }


def watching_verdict(results: dict[str, Any]) -> dict[str, Any]:
    """--watching-only's summary: the two watching targets per worker count (as `blocks`, like
    report.summarize's), and the step's exactly-once verdict."""
    sides = results.get("watching_side_by_side", {})
    return {
        "blocks": [{"workers": int(workers), "targets": [
            report.target("watching_new", side.get("new_payments", {}).get("judged", {}).get("rate_ratio")),
            report.target("watching_replays", side.get("judged", {}).get("rate_ratio"))]}
            for workers, side in sides.items()],
        "exactly_once_pass": bool(sides) and all(side["exactly_once"]["pass"] for side in sides.values()),
    }


def print_watching_failures(results: dict[str, Any]) -> None:
    """--watching-only's last lines: each failed check of the step (the first few), and the verdict."""
    for workers, side in results.get("watching_side_by_side", {}).items():
        for c in side["exactly_once"]["checks"]:
            console.print(f"[red]FAIL[/] {workers}w watched and unwatched at once: {c['check']}: {c['detail']}")
    verdict_ = "[bold green]PASS[/]" if results["exactly_once_pass"] else "[bold red]FAIL[/]"
    console.print(f"exactly-once, after every round: {verdict_}")


def print_outbox_failures(results: dict[str, Any]) -> None:
    """--outbox-only's last lines: each failed check of the side-by-side rounds, and the verdict."""
    for workers, side in results.get("outbox_side_by_side", {}).items():
        for c in (c for p in report.outbox_passes(side) for c in p["exactly_once"]["checks"]):
            console.print(f"[red]FAIL[/] {workers}w with and without webhooks at once: {c['check']}: {c['detail']}")
    verdict = "[bold green]PASS[/]" if results["exactly_once_pass"] else "[bold red]FAIL[/]"
    console.print(f"exactly-once, after every round: {verdict}")


async def machine(conn: asyncpg.Connection) -> dict[str, Any]:
    names = ["fsync", "synchronous_commit", "max_connections", "shared_buffers", "wal_level", "io_method"]
    settings = dict(await conn.fetch("SELECT name, setting || coalesce(unit, '') FROM pg_settings "
                                     "WHERE name = ANY($1::text[])", names))
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),  # others' work shows here
        "postgresql": await conn.fetchval("SHOW server_version"),
        "postgresql_settings": settings,
        "python": platform.python_version(),
    }


# --- CLI ----------------------------------------------------------------------------


def _loop_factory() -> tuple[Callable[[], asyncio.AbstractEventLoop] | None, str]:
    try:
        import uvloop
    except ImportError:
        return None, "asyncio"
    return uvloop.new_event_loop, "uvloop"


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main(
    concurrency: int = typer.Option(32, min=1, help="Concurrent clients (and pgbench connections)."),
    duration: float = typer.Option(20.0, min=1, help="Seconds of each measured run of new payments."),
    warmup: float = typer.Option(3.0, min=0, help="Seconds of warm-up before each measured run (not counted)."),
    runs: int = typer.Option(RUNS, min=1, help="Rounds: each runs the phased service and the naive twin once."),
    workers: str = typer.Option(DEFAULT_WORKERS, help="Worker processes per API, comma-separated (1,2)."),
    replay_duration: float = typer.Option(20.0, min=1, help="Seconds of replays per worker count."),
    pgbench_duration: float = typer.Option(20.0, min=1, help="Seconds of pgbench (the database-only ceiling)."),
    quick: bool = typer.Option(
        False, "--quick", help="A smoke run: 4 s runs, 1 s warm-up, 1 round, 1 worker (unless --workers)."
    ),
    rate_only: bool = typer.Option(
        False, "--rate-only", help="Only the rounds of new payments, phased and naive, alternating: the rate "
        "and database CPU targets (no replays, side-by-sides, refunds or pgbench)."
    ),
    outbox_only: bool = typer.Option(
        False, "--outbox-only", help="Only the rounds of new payments with and without webhooks at once "
        "(bench/outbox.py), after a warm-up: the outbox's target (no other rounds, replays, refunds or pgbench)."
    ),
    watching_only: bool = typer.Option(
        False, "--watching-only", help="Only the watching step: new payments, then replays on one CPU, watched "
        "and unwatched at once, over three pairs of APIs (bench/watching.py), after a warm-up that gives the "
        "first pair payments to replay: the two watching targets (no other rounds, refunds or pgbench)."
    ),
    at_once: str = typer.Option(
        ",".join(rate_at_once.READING), "--at-once", help="The services on the two sides of the rounds at once "
        "(bench/rate_at_once.py), the columns phased and naive: phased,naive; or one service on both, naive,naive "
        "or phased,phased, a control of the step itself."
    ),
    events_per_post: int = typer.Option(
        LIST_SIZE, "--events-per-post", min=1, max=MAX_EVENTS_PER_POST, help="The judged rounds of the outbox's cost: at most this "
        "many events in one POST to the fake merchant (docs/outbox-inbox.md#several-events-in-one-post), after a "
        "pass with one event a POST; 1: that pass alone, judged."
    ),
) -> None:
    """Phased service vs naive twin, side by side, with replays, costs and the database-only ceiling."""
    if quick:  # everything short; the worker counts too, unless given
        duration, warmup, runs, replay_duration, pgbench_duration = 4.0, 1.0, 1, 4.0, 4.0
        workers = "1" if workers == DEFAULT_WORKERS else workers
    try:
        worker_counts = [int(w) for w in workers.split(",") if w.strip()]
    except ValueError:
        raise typer.BadParameter("--workers takes counts such as 1,2") from None
    if rate_only + outbox_only + watching_only > 1:
        raise typer.BadParameter("--rate-only, --outbox-only and --watching-only each run only their own rounds: "
                                 "give one")
    try:
        services_at_once = rate_at_once.services_of(at_once)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    params = Params(concurrency, duration, warmup, runs, worker_counts, replay_duration, pgbench_duration, rate_only,
                    outbox_only, watching_only, events_per_post, services_at_once)
    signal.signal(signal.SIGTERM, _interrupt)
    started_at = datetime.now(UTC)
    clock = time.monotonic()
    loop_factory, loop_name = _loop_factory()
    try:
        with database_server() as server:
            dbs = prepare_databases(server)
            psp, rail = fakes(dbs.rails_url)
            merchant, worker = merchant_and_worker(dbs, psp, rail)
            with running([psp, rail, merchant]), asyncio.Runner(loop_factory=loop_factory) as runner:
                register_webhook(dbs, merchant)
                with running([worker]):
                    console.print(f"fake PSP {psp.url}, fake rail {rail.url}, fake merchant {merchant.url} "
                                  f"(records in payments_bench_rails), one worker; logs in {RESULTS / 'logs'}")
                    measured = runner.run(Bench(params, server, dbs, psp, rail, [merchant, worker])())
    except KeyboardInterrupt:
        console.print("[red]interrupted[/]: every process started here was stopped")
        raise typer.Exit(130) from None
    except (asyncpg.InterfaceError, asyncpg.PostgresConnectionError, ConnectionError) as exc:
        # A shared server (the embedded one is reused if it is running) may be
        # stopped by whoever started it; the figures of such a run mean nothing.
        console.print(f"[red]lost PostgreSQL mid-run ({exc}); was it stopped by another process?[/]")
        raise typer.Exit(2) from None

    results = {
        "timestamp": started_at.isoformat(timespec="seconds"),
        "wall_clock_s": round(time.monotonic() - clock, 1),
        "parameters": {
            "concurrency": concurrency,
            "duration_s": duration,
            "warmup_s": warmup,
            "rounds": runs,
            "rate_only": rate_only,
            "outbox_only": outbox_only,
            "watching_only": watching_only,
            "events_per_post": events_per_post,
            "at_once": ",".join(services_at_once),
            "workers": worker_counts,
            "replay_duration_s": replay_duration,
            "replay_keys_max": REPLAY_KEYS,
            "pgbench_duration_s": pgbench_duration,
            "server": "DATABASE_URL's server" if os.environ.get("DATABASE_URL") else "embedded PostgreSQL",
            "load_generator": f"aiohttp {aiohttp.__version__} on {loop_name}",
        },
        **measured,
    }
    if outbox_only:
        results |= outbox_verdict(results)
        print_outbox_side_by_side(results)
        report.print_targets(results)
        print_outbox_failures(results)
    elif watching_only:
        results |= watching_verdict(results)
        report.print_targets(results)
        print_watching_failures(results)
    else:
        results |= report.summarize(results)
        results["webhooks"] = webhook_summary(results["runs"])
        report.print_report(results)
        if not rate_only:
            print_webhooks(results["webhooks"])
            print_outbox_side_by_side(results)
            batches.print_round(results["batches"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"bench-{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    console.print(f"results: {path}")
    if not results["exactly_once_pass"] or not batches.passed(results["batches"]):
        raise typer.Exit(1)


cli = typer.Typer(add_completion=False)
cli.command()(main)

if __name__ == "__main__":
    cli()
