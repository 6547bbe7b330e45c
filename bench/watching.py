"""What watching costs a replay, to about 1%: the watched and unwatched APIs on one CPU, at the same time.

    .venv/bin/python -m bench.watching [--rounds 10] [--seconds 5] [--new-payments 0]

`make bench` gives the figure the target is judged by, the throughput with
metrics and logs on ÷ off, from runs one after the other; on a 2-CPU
virtual machine those move by 5% between runs of the same code (a CPU that
is slower for a while slows whichever variant runs then). This script
removes most of that noise, to find where a few percent go. It starts three
API processes of the phased service, watched (`on`, the defaults),
unwatched (`off`: METRICS_ENABLED=false LOG_LEVEL=WARNING) and unwatched
again (`off-again`, the control: how far two identical processes differ),
pins the three to the machine's last CPU and everything else (PostgreSQL,
the fakes, this load generator) to the others, and replays finished
payments against all three at once. Each round reads each API's CPU time
(user + system) per replay; as all three share one CPU at the same moments,
the ratio of two of them in a round is nearly free of the machine's drift.
It prints each round's ratios to `off` and their median.

`--new-payments S` first drives S seconds of new payments through each API
(at once, too), then replays again: whether serving payments makes a
process's later replays dearer.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Awaitable, Callable

import psutil
import typer

from bench.load import Load, RunResult
from bench.system import (
    PHASED, UNWATCHED, SETTINGS, Service, System, console, database_server, fakes, prepare_databases, running,
)

VARIANTS = {"on": SETTINGS[PHASED], "off": SETTINGS[UNWATCHED], "off-again": SETTINGS[UNWATCHED]}
CLIENTS = 16  # per API


def cpu_seconds(service: Service) -> float:
    times = psutil.Process(service.pid).cpu_times()
    return times.user + times.system


def pin(apis: dict[str, Service], others: list[Service]) -> None:
    """The APIs on the last CPU; PostgreSQL, the fakes and this process on the rest."""
    cpus = list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        raise typer.BadParameter("needs at least 2 CPUs: one for the APIs, one for the rest")
    for api in apis.values():
        psutil.Process(api.pid).cpu_affinity(cpus[-1:])
    rest = cpus[:-1]
    psutil.Process().cpu_affinity(rest)
    for service in others:
        psutil.Process(service.pid).cpu_affinity(rest)
    for process in psutil.process_iter(["name"]):
        if (process.info["name"] or "").startswith("postgres"):
            try:
                process.cpu_affinity(rest)
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                pass


async def rounds(apis: dict[str, Service], drive: Callable[[str, float], Awaitable[RunResult]],
                 count: int, seconds: float, title: str) -> None:
    per_op: dict[str, list[float]] = {name: [] for name in apis}
    for _ in range(count):
        before = {name: cpu_seconds(api) for name, api in apis.items()}
        results = await asyncio.gather(*(drive(name, seconds) for name in apis))
        for (name, api), result in zip(apis.items(), results):
            per_op[name].append((cpu_seconds(api) - before[name]) / max(1, result.succeeded))
    console.print(f"[bold]{title}[/]: API CPU per request, {count} rounds of {seconds:g} s, all three at once")
    for name in apis:
        ratios = [mine / off for mine, off in zip(per_op[name], per_op["off"])]
        console.print(f"  {name:>9}: median {1e6 * statistics.median(per_op[name]):6.0f} µs"
                      + ("" if name == "off" else
                         f"; ÷ off by round {' '.join(f'{r:.3f}' for r in ratios)}, "
                         f"median [bold]{statistics.median(ratios):.3f}[/]"))


def main(
    rounds_: int = typer.Option(10, "--rounds", min=1),
    seconds: float = typer.Option(5.0, "--seconds", min=1),
    new_payments: float = typer.Option(0.0, "--new-payments", min=0,
                                        help="Seconds of new payments before a second set of replay rounds."),
) -> None:
    """Price watching a replay with the watched and unwatched APIs side by side on one CPU."""
    with database_server() as server:
        dbs = prepare_databases(server)
        psp, rail = fakes(dbs.rails_url)
        system = System()
        system.database_url, system.psp, system.rail = dbs.service_url, psp, rail
        apis = {name: Service.of(system.api_process(command="api", args=("--workers", "1"), **settings),
                                 f"{name} API")
                for name, settings in VARIANTS.items()}
        with running([psp, rail, *apis.values()]):
            pin(apis, [psp, rail])

            async def go() -> None:
                loads = {name: await Load(api.url, dbs.api_key, CLIENTS).__aenter__() for name, api in apis.items()}
                try:
                    paid = {name: (await load.new_payments(3.0)).paid[:1000] for name, load in loads.items()}
                    if not all(paid.values()):
                        raise SystemExit("no payment finished: nothing to replay")

                    def replay(name: str, s: float) -> Awaitable[RunResult]:
                        return loads[name].replays(paid[name], s)

                    await asyncio.gather(*(replay(name, 2.0) for name in apis))  # connections up, caches warm
                    await rounds(apis, replay, rounds_, seconds, "replays")
                    if new_payments:
                        await rounds(apis, lambda name, s: loads[name].new_payments(s), 1, new_payments,
                                     "new payments")
                        await rounds(apis, replay, rounds_, seconds, "replays, after the new payments")
                finally:
                    for load in loads.values():
                        await load.__aexit__()

            asyncio.run(go())


if __name__ == "__main__":
    typer.run(main)
