"""What watching costs a replay: the watched and unwatched APIs on one CPU, at the same time.

    .venv/bin/python -m bench.watching [--rounds 10] [--seconds 5] [--new-payments 0] [--no-control] [--workers 1]

Runs one after the other, as `make bench`'s rounds are, move between runs
of the same code on a 2-CPU virtual machine (a CPU that is slower for a
while slows whichever variant runs then) by more than the 5% the target
allows for watching (docs/reference/performance.md#the-cost-of-watching). `side_by_side` removes most of that noise. It
pins the API processes to the machine's last CPU and everything else of the
run (PostgreSQL, the fakes, the load generator) to the others, and replays
finished payments against all of them at once, each with its own clients.
Sharing one CPU at the same moments, the APIs are slowed alike by whatever
slows that CPU; each round reads each API's CPU time (its CPU clock,
bench/costs.py::cpu_of) per replay and its replays per second, and the
ratios of a round are nearly free of the machine's drift. The pinning is undone at the end.

`make bench` (bench/run.py) runs it after its own replay runs, on its
watched and unwatched APIs and on two more such pairs it starts, and
judges the watching target by the median of the pairs (`across_pairs`). Run
alone, this script starts three APIs: watched (`on`, the defaults),
unwatched (`off`: METRICS_ENABLED=false LOG_LEVEL=WARNING) and unwatched
again (`off-again`, the control: how far two identical processes differ).
`--new-payments S` then drives S seconds of new payments through each (at
once, too) and replays again: whether serving payments makes a process's
later replays dearer. `--no-control` leaves the control out, so that two
APIs share the CPU, as in `make bench`'s pairs; `--workers N` gives each API
N worker processes, as its step with N workers does.
"""

from __future__ import annotations

import asyncio
import os
import statistics
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import typer

from bench.costs import cpu_of, wakeups_of
from bench.load import Load, Paid, RunResult
from bench.system import (
    PHASED, UNWATCHED, SETTINGS, Service, System, console, database_server, fakes, prepare_databases, running,
)

VARIANTS = {"on": SETTINGS[PHASED], "off": SETTINGS[UNWATCHED], "off-again": SETTINGS[UNWATCHED]}
CLIENTS = 16  # per API


def cpu_seconds(service: Service) -> float:
    return sum(s for process in service.tree() if (s := cpu_of(process)) is not None)


def split_seconds(service: Service) -> tuple[float, float, int]:
    """User and system CPU seconds (in the kernel's ticks) and wake-ups so far, of all the service's processes."""
    user = system = 0.0
    wakeups = 0
    for process in service.tree():
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        user, system = user + times.user, system + times.system
        wakeups += wakeups_of(process) or 0
    return user, system, wakeups


def _ours(data_dir: Path | None = None) -> list[psutil.Process]:
    """This process, everything it started, and PostgreSQL's processes (an embedded server's, or a local one's).

    `data_dir`: only the processes of the server in that directory (a
    PostgreSQL process runs in its data directory), so that other servers on
    the machine, another checkout's test run, say, are left where they are.
    """
    me = psutil.Process()
    found = {me.pid: me, **{p.pid: p for p in me.children(recursive=True)}}
    for process in psutil.process_iter(["name"]):
        if (process.info["name"] or "").startswith("postgres") and (data_dir is None or _runs_in(process, data_dir)):
            found.setdefault(process.pid, process)
    return list(found.values())


def _runs_in(process: psutil.Process, directory: Path) -> bool:
    try:
        return Path(process.cwd()) == directory
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        return False


def _set_affinity(process: psutil.Process, cpus: list[int]) -> None:
    try:
        process.cpu_affinity(cpus)
    except (psutil.AccessDenied, psutil.NoSuchProcess):
        pass  # not ours to move (another user's PostgreSQL), or gone


@contextmanager
def pinned(apis: dict[str, Service], data_dir: Path | None = None) -> Iterator[None]:
    """The APIs' processes on the last CPU, the rest of the run on the others; every CPU again at the end.

    `data_dir`: the PostgreSQL server whose processes are moved with the rest
    (`_ours`); by default every PostgreSQL process on the machine.
    """
    every = list(range(os.cpu_count() or 1))
    if len(every) < 2:
        raise RuntimeError("needs at least 2 CPUs: one for the APIs, one for the rest")
    api_pids = {p.pid for api in apis.values() for p in api.tree()}
    moved = _ours(data_dir)
    try:
        for process in moved:
            _set_affinity(process, every[-1:] if process.pid in api_pids else every[:-1])
        yield
    finally:
        for process in moved:
            _set_affinity(process, every)


Split = tuple[float, float, float]  # user seconds, system seconds, wake-ups: per request


async def rounds(apis: dict[str, Service], drive: Callable[[str, float], Awaitable[RunResult]],
                 count: int, seconds: float, splits: dict[str, list[Split]] | None = None,
                 ) -> dict[str, list[tuple[float, float, RunResult]]]:
    """`count` rounds of `drive` against every API at once: (CPU seconds per request, requests/s, result) each.

    `splits`, if given, gets each API's `Split` of every round appended.
    """
    measured: dict[str, list[tuple[float, float, RunResult]]] = {name: [] for name in apis}
    for _ in range(count):
        before = {name: cpu_seconds(api) for name, api in apis.items()}
        split_before = {name: split_seconds(api) for name, api in apis.items()}
        results = await asyncio.gather(*(drive(name, seconds) for name in apis))
        for (name, api), result in zip(apis.items(), results):
            n = max(1, result.succeeded)
            measured[name].append(((cpu_seconds(api) - before[name]) / n, result.succeeded / result.elapsed, result))
            if splits is not None:
                after = split_seconds(api)
                splits.setdefault(name, []).append(
                    tuple((a - b) / n for a, b in zip(after, split_before[name], strict=True)))  # type: ignore[arg-type]
    return measured


def summary(measured: dict[str, list[tuple[float, float, RunResult]]], base: str = "off",
            splits: dict[str, list[Split]] | None = None) -> dict[str, Any]:
    """Per API: median CPU per request; to `base`: each round's CPU ratio and rate ratio, and their medians.

    With `splits`: per API, its user and system CPU and wake-ups per request
    over all the rounds (ticks are coarse: a round's are too few to read one
    by one), and to `base` the ratios of the user and the system times.
    """
    out: dict[str, Any] = {}
    for name, runs in measured.items():
        figures: dict[str, Any] = {
            "cpu_ms_per_request": [round(1000 * cpu, 4) for cpu, _, _ in runs],
            "per_second": [round(rate, 1) for _, rate, _ in runs],
            "cpu_ms_per_request_median": round(1000 * statistics.median(cpu for cpu, _, _ in runs), 4),
        }
        if name != base:
            cpu_ratios = [mine[0] / theirs[0] for mine, theirs in zip(runs, measured[base]) if theirs[0]]
            rate_ratios = [mine[1] / theirs[1] for mine, theirs in zip(runs, measured[base]) if theirs[1]]
            figures |= {
                "cpu_ratio_per_round": [round(r, 3) for r in cpu_ratios],
                "cpu_ratio": round(statistics.median(cpu_ratios), 4) if cpu_ratios else None,
                "rate_ratio_per_round": [round(r, 3) for r in rate_ratios],
                "rate_ratio": round(statistics.median(rate_ratios), 4) if rate_ratios else None,
            }
        out[name] = figures
    if splits:
        requests = {name: [max(1, result.succeeded) for _, _, result in runs] for name, runs in measured.items()}
        totals = {name: [sum(part * n for part, n in zip(parts, requests[name])) / sum(requests[name])
                         for parts in zip(*splits[name])] for name in measured}
        for name, (user, system, wakeups) in totals.items():
            out[name] |= {"user_ms_per_request": round(1000 * user, 4), "system_ms_per_request": round(1000 * system, 4),
                          "wakeups_per_request": round(wakeups, 3)}
            if name != base:
                base_user, base_system, _ = totals[base]
                out[name] |= {"user_ratio": round(user / base_user, 4) if base_user else None,
                              "system_ratio": round(system / base_system, 4) if base_system else None}
    return out


def across_pairs(pairs: list[dict[str, Any]], name: str = "on") -> dict[str, Any]:
    """`name`'s ratios to the base over several pairs of processes: each pair's median, and their median.

    A pair's rounds share the pair's luck: two processes of the same code
    and settings can differ by a few per cent for as long as they live (their
    memory's layout, their hash seed), and every round of the pair carries
    that difference. Rounds cannot average it away; more pairs can. Each
    element of `pairs` is a `summary` of one pair's rounds. `pairs` in the
    answer counts the pairs whose ratio is in the median; `measured`, all of
    them (a pair whose base served nothing has no ratio).
    """
    rates = [pair[name]["rate_ratio"] for pair in pairs if pair[name].get("rate_ratio") is not None]
    cpus = [pair[name]["cpu_ratio"] for pair in pairs if pair[name].get("cpu_ratio") is not None]
    return {
        "measured": len(pairs),
        "pairs": len(rates),
        "rate_ratio_per_pair": rates,
        "rate_ratio": round(statistics.median(rates), 4) if rates else None,
        "cpu_ratio_per_pair": cpus,
        "cpu_ratio": round(statistics.median(cpus), 4) if cpus else None,
    }


def print_summary(title: str, figures: dict[str, Any]) -> None:
    console.print(f"[bold]{title}[/]")
    for name, f in figures.items():
        line = f"  {name:>9}: {f['cpu_ms_per_request_median'] * 1000:6.0f} µs of API CPU per request (median)"
        if "cpu_ratio" in f:
            line += (f"; ÷ off: CPU by round {' '.join(f'{r:.3f}' for r in f['cpu_ratio_per_round'])}, "
                     f"median [bold]{f['cpu_ratio']:.3f}[/]; requests/s median [bold]{f['rate_ratio']:.3f}[/]")
        console.print(line)
        if "user_ms_per_request" in f:
            split = (f"             user {f['user_ms_per_request'] * 1000:6.0f} µs, system "
                     f"{f['system_ms_per_request'] * 1000:6.0f} µs, {f['wakeups_per_request']:.3f} wake-ups per request")
            if f.get("user_ratio") is not None and f.get("system_ratio") is not None:
                split += f"; ÷ off: user {f['user_ratio']:.3f}, system {f['system_ratio']:.3f}"
            console.print(split)


async def side_by_side_replays(apis: dict[str, Service], loads: dict[str, Load], paid: dict[str, list[Paid]],
                               count: int, seconds: float
                               ) -> tuple[dict[str, Any], dict[str, list[RunResult]]]:
    """Replays against every API at once, pinned (`pinned`): the summary, and every round's result to check."""
    def replay(name: str, s: float) -> Awaitable[RunResult]:
        return loads[name].replays(paid[name], s)

    splits: dict[str, list[Split]] = {}
    with pinned(apis):
        await asyncio.gather(*(replay(name, 2.0) for name in apis))  # connections up, on the pinned CPUs
        measured = await rounds(apis, replay, count, seconds, splits)
    return summary(measured, splits=splits), {name: [r for _, _, r in runs] for name, runs in measured.items()}


def main(
    rounds_: int = typer.Option(10, "--rounds", min=1),
    seconds: float = typer.Option(5.0, "--seconds", min=1),
    new_payments: float = typer.Option(0.0, "--new-payments", min=0,
                                        help="Seconds of new payments before a second set of replay rounds."),
    control: bool = typer.Option(True, "--control/--no-control",
                                 help="Also the second unwatched API; without it, two APIs share the CPU, as in "
                                      "make bench's pairs."),
    workers: int = typer.Option(1, "--workers", min=1, help="Worker processes of each API."),
) -> None:
    """Price watching a replay with the watched and unwatched APIs side by side on one CPU."""
    variants = VARIANTS if control else {name: VARIANTS[name] for name in ("on", "off")}
    with database_server() as server:
        dbs = prepare_databases(server)
        psp, rail = fakes(dbs.rails_url)
        system = System()
        system.database_url, system.psp, system.rail = dbs.service_url, psp, rail
        apis = {name: Service.of(system.api_process(command="api", args=("--workers", str(workers)), **settings),
                                 f"{name} API")
                for name, settings in variants.items()}
        with running([psp, rail, *apis.values()]):

            async def go() -> None:
                loads = {name: await Load(api.url, dbs.api_key, CLIENTS).__aenter__() for name, api in apis.items()}
                try:
                    paid = {name: (await load.new_payments(3.0)).paid[:1000] for name, load in loads.items()}
                    if not all(paid.values()):
                        raise SystemExit("no payment finished: nothing to replay")
                    figures, _ = await side_by_side_replays(apis, loads, paid, rounds_, seconds)
                    print_summary(f"replays: {rounds_} rounds of {seconds:g} s, all {len(apis)} at once", figures)
                    if new_payments:
                        with pinned(apis):
                            measured = await rounds(apis, lambda name, s: loads[name].new_payments(s), 1,
                                                    new_payments)
                        print_summary(f"new payments: {new_payments:g} s, all {len(apis)} at once", summary(measured))
                        figures, _ = await side_by_side_replays(apis, loads, paid, rounds_, seconds)
                        print_summary("replays, after the new payments", figures)
                finally:
                    for load in loads.values():
                        await load.__aexit__()

            asyncio.run(go())


if __name__ == "__main__":
    typer.run(main)
