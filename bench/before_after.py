"""Before and after a refactor: the API's CPU per new payment and per replay, both trees' code at once.

    .venv/bin/python -m bench.before_after --baseline DIR [--rounds 6] [--seconds 10] [--clients 16]
    make bench-before-after BASELINE=DIR [ROUNDS=6] [SECONDS=10]

DIR is a checkout of an earlier commit (a worktree of the main before the
change: `git worktree add --detach ../baseline <commit>`). One PostgreSQL
database, migrated by this tree, and one pair of fakes serve two API
processes: `before`, running DIR's code, and `after`, running this tree's.
Both are this virtualenv's `payments api`; each has its tree first on
PYTHONPATH, so `app` is imported from there (the editable install's finder
comes after the path, as tests/mutants.py explains), with the same settings
otherwise. Each side has a pycache directory of its own, so nothing is
written into DIR, and what the process compiled there shows which tree it
really imported: the run stops if `before` did not import DIR's `app`, or
`after` this tree's. The schema must be the same: DIR's migrations are
checked to be this tree's, file for file.

Each side has its own client (API key) and its own load generator with
the same number of clients, and both APIs are pinned to one CPU with the
rest of the run on the other (bench/watching.py::pinned), so whatever slows
the machine slows both alike (the reason is in bench/watching.py). Each
round drives new payments through both at the same moments, then replays
through both the keys that round finished; the order in which the two are
started alternates from round to round. Per round and side: the API
process's CPU seconds (bench/costs.py::cpu_of) per new payment and per replay,
payments and replays per second, and after ÷ before; then the medians.

The target (docs/reference/performance.md#before-and-after-the-machine-refactor):
after ÷ before at most 1.05 for both, the median of the rounds' ratios. It is
printed, not enforced: the exit status is 1 only if an exactly-once check
(bench/checks.py, on each side's own payments and replays) fails, 2 if the
trees cannot be compared.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import typer
from rich.table import Table

from bench import report
from bench.checks import Check, exactly_once, replays_check
from bench.load import Load, Paid, RunResult
from bench.system import (
    PHASED, RAILS_DATABASE, RESULTS, SERVICE_DATABASE, SETTINGS, Server, Service, System, console, database_server,
    fakes, running,
)
from bench.watching import pinned, rounds

ROOT = Path(__file__).resolve().parent.parent
SIDES = ("before", "after")
TARGET = 1.05  # after ÷ before, CPU per new payment and per replay
REPLAY_KEYS = 1000  # the most a round's replays cycle through, as in bench/run.py
WARMUP_SECONDS = 3.0  # of new payments, then of replays, before the rounds (checked, not counted)


# --- The trees ------------------------------------------------------------------


def commit_of(tree: Path) -> str:
    """The tree's commit, `+` if it has changes not committed; `?` outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "?"
    return head + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def differing_migrations(baseline: Path, here: Path = ROOT) -> list[str]:
    """The migration files that are not the same in both trees (empty: one schema serves both)."""
    def files(tree: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted((tree / "migrations" / "versions").glob("*.py"))}

    theirs, ours = files(baseline), files(here)
    return sorted(name for name in theirs.keys() | ours.keys() if theirs.get(name) != ours.get(name))


def imported_app(env: dict[str, str]) -> Path | None:
    """Where a new process with `env` (as the API has) imports `app` from; None if it cannot."""
    found = subprocess.run(
        [sys.executable, "-c", "import app.main, app; print(app.__file__)"],
        # From /, so that only PYTHONPATH, not the current directory, can find a tree.
        cwd="/", env=env | {"PYTHONDONTWRITEBYTECODE": "1"}, capture_output=True, text=True,
    )
    return Path(found.stdout.strip()).parent.parent if found.returncode == 0 and found.stdout.strip() else None


def compiled_apps(pycache: Path, trees: list[Path]) -> list[Path]:
    """Of `trees`, those whose app/main.py a process writing to `pycache` (PYTHONPYCACHEPREFIX) compiled."""
    return [tree for tree in trees
            if any((pycache / tree.relative_to(tree.anchor) / "app").glob("main.*.pyc"))]


def postgres_directory(server: Server) -> Path:
    """The server's data directory, where its processes run: they, and no other server's, are pinned with the rest.

    A server of DATABASE_URL on another machine has no process here, and
    nothing of it is moved.
    """
    if server.embedded:
        return server.system.postgres.embedded.data_dir

    async def ask() -> str:
        conn = await asyncpg.connect(server.url)
        try:
            return await conn.fetchval("SHOW data_directory")
        finally:
            await conn.close()

    try:
        return Path(asyncio.run(ask()))
    except asyncpg.InsufficientPrivilegeError:
        raise SystemExit("the bench pins PostgreSQL's processes: it needs to read data_directory (a superuser, "
                         "or a role in pg_read_all_settings)") from None


# --- The figures ----------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One side's figures in one round."""

    payments: int
    payments_per_s: float
    payment_cpu_ms: float  # the API's CPU per new payment
    replays: int
    replays_per_s: float
    replay_cpu_ms: float  # the API's CPU per replay


def ratio(after: float, before: float) -> float | None:
    return round(after / before, 4) if before else None


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def summary(measured: list[dict[str, Side]]) -> dict[str, Any]:
    """Each round's after ÷ before; the medians of each side's figures and of the rounds' ratios."""
    figures = ("payments_per_s", "payment_cpu_ms", "replays_per_s", "replay_cpu_ms")
    per_round = [{
        "before": vars(r["before"]), "after": vars(r["after"]),
        "payment_cpu_ratio": ratio(r["after"].payment_cpu_ms, r["before"].payment_cpu_ms),
        "replay_cpu_ratio": ratio(r["after"].replay_cpu_ms, r["before"].replay_cpu_ms),
        "payments_per_s_ratio": ratio(r["after"].payments_per_s, r["before"].payments_per_s),
        "replays_per_s_ratio": ratio(r["after"].replays_per_s, r["before"].replays_per_s),
    } for r in measured]
    ratios = ("payment_cpu_ratio", "replay_cpu_ratio", "payments_per_s_ratio", "replays_per_s_ratio")
    return {
        "rounds": per_round,
        "medians": {side: {f: median([getattr(r[side], f) for r in measured]) for f in figures} for side in SIDES},
        **{name: median([r[name] for r in per_round]) for name in ratios},
    }


def verdict(figures: dict[str, Any], target: float = TARGET) -> str:
    """The one line that answers the question, from `summary`'s medians of the rounds' ratios."""
    payment, replay = figures["payment_cpu_ratio"], figures["replay_cpu_ratio"]
    met = payment is not None and replay is not None and payment <= target and replay <= target
    return (f"CPU per payment after/before = {report.fmt(payment, 3)}, per replay = {report.fmt(replay, 3)} "
            f"(target <= {target:.2f}): {'met' if met else 'not met'}")


def merged(results: list[RunResult]) -> RunResult:
    """One side's runs as one, for the exactly-once check over all of them."""
    total = RunResult()
    for result in results:
        total.latencies += result.latencies
        total.statuses.update(result.statuses)
        total.paid += result.paid
        total.references += result.references
        total.elapsed += result.elapsed
    return total


# --- The run --------------------------------------------------------------------


@dataclass
class Run:
    """Everything a side-by-side run measured, and what its checks need."""

    measured: list[dict[str, Side]]
    new: dict[str, list[RunResult]]  # each side's runs of new payments, the warm-up's included
    replays: dict[str, list[tuple[RunResult, list[Paid]]]]  # each side's replay runs, with the keys replayed


async def side_by_side(apis: dict[str, Service], loads: dict[str, Load], count: int, seconds: float,
                       data_dir: Path | None) -> Run:
    """`count` rounds, each new payments through both APIs at once, then replays of that round's keys."""
    run = Run([], {side: [] for side in SIDES}, {side: [] for side in SIDES})
    with pinned(apis, data_dir):
        # Connections up and caches filled, on the pinned CPUs; checked with the rest, not counted.
        warm = await rounds(apis, lambda side, s: loads[side].new_payments(s), 1, WARMUP_SECONDS)
        warm_paid = {side: warm[side][0][2].paid[-REPLAY_KEYS:] for side in SIDES}
        for side in SIDES:
            run.new[side].append(warm[side][0][2])
        if not all(warm_paid.values()):
            raise RuntimeError("warm-up: no new payment finished on "
                               + ", ".join(side for side in SIDES if not warm_paid[side]))
        warm = await rounds(apis, lambda side, s: loads[side].replays(warm_paid[side], s), 1, WARMUP_SECONDS)
        for side in SIDES:
            run.replays[side].append((warm[side][0][2], warm_paid[side]))
        for number in range(count):
            # Which side's clients start first alternates (gather starts them in this order).
            order = {side: apis[side] for side in (SIDES if number % 2 == 0 else SIDES[::-1])}
            new = await rounds(order, lambda side, s: loads[side].new_payments(s), 1, seconds)
            paid = {side: new[side][0][2].paid[-REPLAY_KEYS:] for side in SIDES}
            for side in SIDES:
                run.new[side].append(new[side][0][2])
            if not all(paid.values()):
                raise RuntimeError(f"round {number + 1}: no new payment finished on "
                                   + ", ".join(side for side in SIDES if not paid[side]) + ": nothing to replay")
            replays = await rounds(order, lambda side, s: loads[side].replays(paid[side], s), 1, seconds)
            figures = {}
            for side in SIDES:
                (payment_cpu, payment_rate, payments), = new[side]
                (replay_cpu, replay_rate, replayed), = replays[side]
                run.replays[side].append((replayed, paid[side]))
                figures[side] = Side(payments.succeeded, round(payment_rate, 1), round(1000 * payment_cpu, 4),
                                     replayed.succeeded, round(replay_rate, 1), round(1000 * replay_cpu, 4))
            run.measured.append(figures)
            print_round(number + 1, figures)
    return run


async def checks_of(run: Run, service_url: str, rails_url: str, client_ids: dict[str, int]) -> dict[str, list[Check]]:
    """bench/checks.py's exactly-once checks, each side on its own client's payments and its own replays."""
    found: dict[str, list[Check]] = {}
    for side in SIDES:
        new = merged(run.new[side])
        checks = [Check("new payments answered 201", new.succeeded > 0, f"{new.succeeded} of {new.requests}")]
        checks += await exactly_once(PHASED, service_url, rails_url, client_ids[side], new)
        replayed = {p.key: p for _, keys in run.replays[side] for p in keys}
        checks += await replays_check(rails_url, merged([r for r, _ in run.replays[side]]), list(replayed.values()))
        found[side] = checks
    return found


# --- Printing -------------------------------------------------------------------


def print_round(number: int, figures: dict[str, Side]) -> None:
    b, a = figures["before"], figures["after"]
    payment, replay = ratio(a.payment_cpu_ms, b.payment_cpu_ms), ratio(a.replay_cpu_ms, b.replay_cpu_ms)
    console.print(
        f"round {number}, before and after: new payments {b.payments_per_s:.0f}/s and {a.payments_per_s:.0f}/s, "
        f"API CPU {b.payment_cpu_ms:.3f} and {a.payment_cpu_ms:.3f} ms each (after/before {report.fmt(payment, 3)}); "
        f"replays {b.replays_per_s:.0f}/s and {a.replays_per_s:.0f}/s, "
        f"{1000 * b.replay_cpu_ms:.0f} and {1000 * a.replay_cpu_ms:.0f} µs each (after/before {report.fmt(replay, 3)})")


def print_summary(figures: dict[str, Any], commits: dict[str, str]) -> None:
    f = report.fmt
    m = figures["medians"]
    for kind, rate, cpu, cpu_ratio, rate_ratio, unit, scale, digits in (
            ("new payment", "payments_per_s", "payment_cpu_ms", "payment_cpu_ratio", "payments_per_s_ratio",
             "ms", 1, 3),
            ("replay", "replays_per_s", "replay_cpu_ms", "replay_cpu_ratio", "replays_per_s_ratio", "µs", 1000, 0)):
        table = Table(title=f"API CPU per {kind}: before ({commits['before']}) and after ({commits['after']}) "
                            "at once on one CPU")
        for column in ("round", f"{unit} before", f"{unit} after", "after/before", "per s before", "per s after",
                       "after/before"):
            table.add_column(column, justify="right")
        for number, r in enumerate(figures["rounds"], 1):
            table.add_row(str(number), f(scale * r["before"][cpu], digits), f(scale * r["after"][cpu], digits),
                          f(r[cpu_ratio], 3), f(r["before"][rate], 0), f(r["after"][rate], 0), f(r[rate_ratio], 3))

        def scaled(value: float | None) -> float | None:
            return None if value is None else scale * value

        table.add_row("median", f(scaled(m["before"][cpu]), digits), f(scaled(m["after"][cpu]), digits),
                      f(figures[cpu_ratio], 3), f(m["before"][rate], 0), f(m["after"][rate], 0),
                      f(figures[rate_ratio], 3), style="bold")
        console.print(table)
    console.print("after/before: each round's ratio; in the last row, the median of the rounds' ratios")


def print_checks(found: dict[str, list[Check]]) -> None:
    for side, checks in found.items():
        for check in checks:
            mark = "[green]ok[/]" if check.ok else "[bold red]FAIL[/]"
            console.print(f"  {side:>6} {mark} {check.name}: {check.detail}")


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"nproc": os.cpu_count(), "cpu_model": model, "python": platform.python_version()}


# --- CLI ------------------------------------------------------------------------


def main(
    baseline: Path = typer.Option(..., "--baseline", help="A checkout of the code before (its `app` is served)."),
    rounds_: int = typer.Option(6, "--rounds", min=1, help="Rounds: new payments, then replays, both sides at once."),
    seconds: float = typer.Option(10.0, "--seconds", min=1, help="Seconds of new payments, and of replays, per round."),
    clients: int = typer.Option(16, "--clients", min=1, help="Concurrent clients per API."),
) -> None:
    """This tree's API against the baseline's, side by side on one CPU: CPU per new payment and per replay."""
    baseline = baseline.resolve()
    trees = {"before": baseline, "after": ROOT}
    if not (baseline / "app" / "__init__.py").is_file():
        console.print(f"[red]{baseline} holds no app/ package: not a checkout of this service[/]")
        raise typer.Exit(2)
    if baseline == ROOT:
        console.print("[red]--baseline is this tree: nothing to compare[/]")
        raise typer.Exit(2)
    if differing := differing_migrations(baseline):
        console.print(f"[red]the trees' migrations differ ({', '.join(differing)}): one database cannot serve both[/]")
        raise typer.Exit(2)
    commits = {side: commit_of(tree) for side, tree in trees.items()}
    started_at, load_at_start = datetime.now(UTC), os.getloadavg()
    clock = time.monotonic()
    console.print(f"before: {baseline} ({commits['before']}); after: {ROOT} ({commits['after']}); "
                  f"load average {load_at_start[0]:.2f} {load_at_start[1]:.2f} {load_at_start[2]:.2f}")

    with tempfile.TemporaryDirectory(prefix="before-after-") as scratch, database_server() as server:
        system = server.system
        with console.status("creating the bench databases"):
            rails_url = system.create_database(RAILS_DATABASE, migrate=False)
            service_url = system.create_database(SERVICE_DATABASE)  # migrated by this tree (the same schema)
            keys = {side: system.create_client(f"bench-{side}") for side in SIDES}  # (client id, API key)
        psp, rail = fakes(rails_url)
        on = System()
        on.database_url, on.psp, on.rail = service_url, psp, rail
        pycache = {side: Path(scratch) / side for side in SIDES}
        apis = {side: Service.of(on.api_process(
                    command="api", args=("--workers", "1"), **SETTINGS[PHASED],
                    PYTHONPATH=str(trees[side]), PYTHONPYCACHEPREFIX=str(pycache[side])), f"{side} API")
                for side in SIDES}
        with running([psp, rail, *apis.values()]):
            for side in SIDES:
                compiled = compiled_apps(pycache[side], list(trees.values()))
                imported = imported_app(apis[side].env)
                if compiled != [trees[side]] or imported != trees[side]:
                    console.print(f"[bold red]the {side} API does not run {trees[side]}'s code[/]: it compiled "
                                  f"app/ of {[str(t) for t in compiled]}, and its environment imports app from "
                                  f"{imported}")
                    raise typer.Exit(2)
            console.print(f"before API {apis['before'].url} and after API {apis['after'].url}, each importing app "
                          f"from its own tree (checked); {clients} clients each; {rounds_} rounds of {seconds:g} s "
                          "of new payments, then of replays")
            data_dir = postgres_directory(server)

            async def go() -> tuple[Run, dict[str, list[Check]]]:
                loads = {side: Load(apis[side].url, keys[side][1], clients) for side in SIDES}
                for load in loads.values():
                    await load.__aenter__()
                try:
                    run = await side_by_side(apis, loads, rounds_, seconds, data_dir)
                finally:
                    for load in loads.values():
                        await load.__aexit__()
                return run, await checks_of(run, service_url, rails_url, {side: keys[side][0] for side in SIDES})

            run, found = asyncio.run(go())

    load_at_end = os.getloadavg()
    figures = summary(run.measured)
    print_summary(figures, commits)
    console.print("exactly-once, each side on its own client:")
    print_checks(found)
    passed = all(check.ok for checks in found.values() for check in checks)
    console.print(f"load average at the start {load_at_start[0]:.2f}, at the end {load_at_end[0]:.2f} "
                  f"({time.monotonic() - clock:.0f} s)")
    console.print(f"[bold]{verdict(figures)}[/]")
    results = {
        "timestamp": started_at.isoformat(timespec="seconds"),
        "wall_clock_s": round(time.monotonic() - clock, 1),
        "trees": {side: {"path": str(tree), "commit": commits[side]} for side, tree in trees.items()},
        "parameters": {"rounds": rounds_, "seconds": seconds, "clients_per_api": clients,
                       "settings": SETTINGS[PHASED], "target": TARGET},
        "machine": machine() | {"load_average_at_start": load_at_start, "load_average_at_end": load_at_end},
        "figures": figures,
        "exactly_once": {side: [vars(c) for c in checks] for side, checks in found.items()},
        "exactly_once_pass": passed,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"before-after-{started_at.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    console.print(f"results: {path}")
    if not passed:
        raise typer.Exit(1)


if __name__ == "__main__":
    typer.run(main)
