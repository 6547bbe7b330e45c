"""How evenly `payments api --workers N` shares its work: many short rounds, and what each worker did in each.

    .venv/bin/python -m bench.shares [--rounds 40] [--seconds 5] [--warmup 3] [--workers 2] [--kind replays|new]
                                     [--json FILE] [--perf]

`make bench` judges the API workers' shares (the busiest's CPU ÷ the
idlest's, at most 1.2 in its least even round) over a handful of rounds; a
skew that comes once in many rounds needs many more to be seen, and seen
twice. This runs only that: the watched API (the defaults) with N worker
processes, and round after round of replays of finished payments (or of
new payments), each round with a fresh set of clients and the same
warm-up as `make bench`'s replay rounds: their connections arrive one by
one, are hashed to a worker's socket and kept even by the workers
(app/fastpath/reuse_port.py), and only then is the round measured.

For each worker in each round it prints the CPU it spent, the clients'
connections it held at the end, the answers it gave on them, and how long
it was runnable but waiting for a CPU (bench/costs.py::CpuMeter.workers).
Those tell the two kinds of skew apart. A worker that spent more because
the scheduler gave it more of the CPUs served more answers at the same
CPU an answer, and the other waited longer for a CPU; a worker that spent
more on each answer (a collection, a slower path) shows a higher CPU an
answer, whatever it served. With `--perf` it also samples the workers'
stacks all through the rounds (bench/cpu_samples.py) and says, round by
round, how much of each worker's CPU was Python's garbage collector, the
kernel and the rest, and where the busiest of a round past the bound spent
what the idlest did not.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import asyncpg
import typer
from rich.markup import escape

from bench.costs import CpuMeter, WorkerShare
from bench.cpu_samples import GC, KERNEL, REST, Recording, Sample, by_window, more_often, seconds_by_kind, unavailable
from bench.load import Load, Paid
from bench.report import balance, fmt, served
from bench.system import PHASED, api, console, database_server, fakes, prepare_databases, running

CLIENTS = 32  # as make bench's rounds
WARMUP_SECONDS = 3.0  # as make bench's: each round's clients connect, one by one, and settle (--warmup)
REPLAY_KEYS = 1000


def figures(shares: list[WorkerShare], answered: int) -> dict[str, Any]:
    """One round's shares as the report reads them (bench/report.py::served), and the answers no worker held."""
    workers = [w.to_json() for w in shares]
    placed = sum(w.requests for w in shares)
    return {"workers": workers, "balance": balance([w.cpu_seconds for w in shares]),
            **served(workers, answered - placed)}


def line(number: int, round_: dict[str, Any]) -> str:
    b = round_["balance"]
    if b is None:
        return f"round {number}: no CPU split to show"
    text = (f"round {number}: CPU {'/'.join(f'{p:.0f}' for p in b['percent'])} (max ÷ min {b['max_over_min']:.2f})"
            f", connections {'/'.join(str(w['connections']) for w in round_['workers'])}")
    if "answers_percent" in round_:
        text += (f", answers {'/'.join(f'{p:.0f}' for p in round_['answers_percent'])}, CPU an answer busiest ÷ "
                 f"idlest {fmt(round_['cpu_per_answer_ratio'], 2)}, waited for a CPU "
                 f"{' / '.join(f'{s:.2f}' for s in round_['waited_seconds'])} s, "
                 f"{round_['answers_unplaced']} on connections closed during it")
    return text


def summary(rounds: list[dict[str, Any]], bound: float) -> str:
    """How many rounds went past `bound`, and, over them, whether the busiest served more or spent more an answer."""
    ratios = [r["balance"]["max_over_min"] for r in rounds if r["balance"]]
    counted = f"{len(rounds)} round{'' if len(rounds) == 1 else 's'}"
    if not ratios:
        return f"{counted}: none split the CPU between two workers that spent any"
    uneven = [r for r in rounds if r["balance"] and r["balance"]["max_over_min"] > bound]
    text = (f"{counted}: max ÷ min median {statistics.median(ratios):.2f}, worst {max(ratios):.2f}; "
            f"{len(uneven)} over {bound:g}")
    explained = [r for r in uneven if "answers_percent" in r]
    if explained:
        text += ("; in those, CPU an answer busiest ÷ idlest "
                 + ", ".join(fmt(r["cpu_per_answer_ratio"], 2) for r in explained)
                 + "; the idlest waited for a CPU "
                 + ", ".join(f"{r['waited_seconds'][-1] - r['waited_seconds'][0]:+.2f}" for r in explained)
                 + " s more than the busiest")
    return text


def profiled(measured: list[dict[str, Any]], samples: Iterable[Sample], bound: float) -> None:
    """Each round's perf samples of each worker, by kind, into the round's figures, and printed.

    Every round gets `on_cpu`: for each worker, busiest first as in
    `workers`, the seconds its samples put in the collector, the kernel and
    the rest. A round past `bound` also gets `more_often`: the functions the
    busiest was found in more than the idlest. Then a line over the rounds
    past the bound: how much of the busiest's extra CPU was each kind's.
    """
    pids = {w["pid"] for r in measured for w in r["workers"]}
    split = by_window(samples, [tuple(r["monotonic"]) for r in measured], pids)
    extra: Counter[str] = Counter()
    uneven = 0
    for number, (round_, found) in enumerate(zip(measured, split, strict=True), start=1):
        workers = round_["workers"]
        round_["on_cpu"] = [seconds_by_kind(found[w["pid"]]) for w in workers]
        text = f"round {number} on the CPU, perf's samples, busiest / idlest: " + ", ".join(
            f"{k} {' / '.join(f'{w[k]:.3f}' for w in round_['on_cpu'])} s" for k in (GC, KERNEL, REST))
        console.print(text)
        if round_["balance"] and round_["balance"]["max_over_min"] > bound and len(workers) > 1:
            uneven += 1
            busiest, idlest = round_["on_cpu"][0], round_["on_cpu"][-1]
            extra.update({k: busiest[k] - idlest[k] for k in (GC, KERNEL, REST)})
            round_["more_often"] = more_often(found[workers[0]["pid"]], found[workers[-1]["pid"]])
            console.print("  the busiest more often in: "
                          # escaped: perf's "[unknown]" would be read as a style by rich, and vanish
                          + (", ".join(f"{escape(name)} +{s:.3f} s" for name, s in round_["more_often"]) or "nothing"))
    if uneven:
        console.print(f"perf, over the {uneven} round{'' if uneven == 1 else 's'} past {bound:g}: the busiest's "
                      "CPU beyond the idlest's, " + ", ".join(f"{k} {extra[k]:+.3f} s" for k in (GC, KERNEL, REST)))
    else:
        console.print(f"perf: no round past {bound:g}")


def main(
    rounds_: int = typer.Option(40, "--rounds", min=1),
    seconds: float = typer.Option(5.0, "--seconds", min=1),
    workers: int = typer.Option(2, "--workers", min=2, help="Worker processes of the API."),
    kind: str = typer.Option("replays", "--kind", help="replays (as make bench's uneven round) or new (payments)."),
    bound: float = typer.Option(1.2, "--bound", help="The busiest ÷ the idlest a round may reach (make bench's target)."),
    warmup: float = typer.Option(WARMUP_SECONDS, "--warmup", min=0,
                                 help="Seconds of each round's clients before it is measured: their connections "
                                      "arrive and the workers even their shares."),
    out: Path | None = typer.Option(None, "--json", help="Also write every round's figures to this file."),
    perf: bool = typer.Option(False, "--perf", help="Sample the workers with perf record all through the rounds: "
                                                     "each worker's CPU in the collector, the kernel and the rest, "
                                                     "round by round (bench/cpu_samples.py)."),
) -> None:
    """Round after round against one API with N workers: each worker's CPU, connections, answers and wait."""
    if kind not in ("replays", "new"):
        raise typer.BadParameter("--kind is replays or new")
    if perf and (reason := unavailable()):
        raise SystemExit(f"--perf cannot sample here: {reason}")
    with database_server() as server:
        dbs = prepare_databases(server)
        psp, rail = fakes(dbs.rails_url)
        service = api(dbs.service_url, psp, rail, workers, PHASED)
        with running([psp, rail, service]):

            async def rounds(meter: CpuMeter, paid: list[Paid]) -> list[dict[str, Any]]:
                measured = []
                for number in range(1, rounds_ + 1):
                    async with Load(service.url, dbs.api_key, CLIENTS) as load:
                        drive = ((lambda s: load.replays(paid, s)) if kind == "replays"
                                 else load.new_payments)
                        await drive(warmup)
                        before = await meter.mark({"API": service.tree()})
                        started = time.monotonic()
                        result = await drive(seconds)
                        ended = time.monotonic()
                        after = await meter.mark({"API": service.tree()})
                        held = service.client_ports()
                    round_ = figures(CpuMeter.workers(before, after, "API", held, result.answered),
                                     result.answered.total())
                    round_["monotonic"] = [started, ended]  # to find the round in a profile of the run
                    measured.append(round_)
                    console.print(line(number, round_))
                return measured

            async def go() -> list[dict[str, Any]]:
                conn = await asyncpg.connect(server.url)
                meter = CpuMeter(conn)
                await meter.setup()
                try:
                    async with Load(service.url, dbs.api_key, CLIENTS) as load:
                        paid: list[Paid] = (await load.new_payments(3.0)).paid[:REPLAY_KEYS]
                    if not paid:
                        raise SystemExit("no payment finished: nothing to replay")
                    if not perf:
                        return await rounds(meter, paid)
                    recording = Recording([w.pid for w in service.workers()])
                    try:
                        with recording:
                            measured = await rounds(meter, paid)
                        profiled(measured, recording.samples(), bound)
                    finally:
                        recording.close()
                    return measured
                finally:
                    await conn.close()

            measured = asyncio.run(go())
    console.print(summary(measured, bound))
    if out is not None:
        out.write_text(json.dumps({"rounds": measured, "seconds": seconds, "warmup": warmup, "kind": kind}, indent=1))


if __name__ == "__main__":
    typer.run(main)
