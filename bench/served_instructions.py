"""`python -m bench.served_instructions`: a replay's instructions in the whole API process, as uvicorn serves it.

    .venv/bin/python -m bench.served_instructions [--variants phased,unwatched] [--seconds 30]
        [--clients 8] [--repeats 2] [--tolerance 0.01] [--cache-sim]

Not on a request's path: a bench of its own, beside bench/instructions.py.
That one counts the app's instructions, driven straight through its ASGI
interface, with no server around it. The side-by-side rounds that judge
watching (bench/watching.py) time the whole API process instead: uvicorn's
HTTP work, the event loop's, and whatever runs beside the requests (the
metrics' flush once a second, the /metrics thread). This counts that whole
process, so that a gap between the two figures can be told apart: more
instructions somewhere the app's count does not look, or the same
instructions run slower (the processor's caches, the kernel's work, which
no instruction count sees).

How. `payments api --workers 1` (one process: uvicorn serves in it, the
/metrics thread runs in it too) is started under `valgrind --tool=callgrind`,
against the fake PSP and rail and a PostgreSQL of the bench's own
(bench/instructions.py's stack: the same patient timeouts, so no call is
retried). A load generator in this process (bench/load.py, over HTTP, as in
`make bench`) pays a few payments through it and replays them to warm it
up. Then each window: callgrind's counts are zeroed from outside
(`callgrind_control --zero`, through valgrind's gdbserver), `clients`
clients replay for `seconds`, every request is answered before the window
ends, and the counts are dumped (`callgrind_control --dump`). A window's
instructions ÷ its replays is the figure; each variant runs `repeats`
processes, and a figure is given only if they agree within `tolerance`.

What the figure holds beyond the replays themselves: the event loop's
idle turns in the window, and work done by the clock (uvicorn's timers;
in the watched process also the metrics' flush and the /metrics
thread's poll), which under valgrind's slowdown falls on fewer replays a
second than natively, so it weighs more here than in a native run: both
variants' figures are a little high, the watched one's a little more.
docs/reference/performance.md says by how much, from two runs at
different speeds.

`--cache-sim` also has callgrind simulate the caches and the branch
predictor (`--cache-sim=yes --branch-sim=yes`; about twice as slow) and
prints each variant's misses per replay: the first-level instruction and
data caches' (I1mr, D1mr + D1mw), the last level's (ILmr + DLmr + DLmw) and
the mispredicted branches (Bcm + Bim). A model of one process alone, not
of this machine's processor with another process beside it; the
instruction count is the same with or without it.

A run that cannot produce a figure (no valgrind, a dump not written,
repeats that disagree, a replay not answered as expected) says NO FIGURE
and why, and exits 1.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass

import typer

from bench.instructions import OUT, PATIENT, SAFE, NoFigure, Stack, agreed, patient_stack, require_valgrind, spread
from bench.load import Load
from bench.system import LOGS, PHASED, SETTINGS, UNWATCHED, console
from devtools.processes import NotHealthy

# Under valgrind the API starts in a minute or two, and answers 30-100 times slower than natively.
START_SECONDS = 600
CONTROL_SECONDS = 120  # for one callgrind_control command (it waits for the process to reach valgrind)
PAY_SECONDS = 30.0  # new payments to replay: a few dozen under valgrind
WARM_SECONDS = 20.0
_EVENTS = re.compile(r"^events:\s+(.+)$", re.MULTILINE)
_SUMMARY = re.compile(r"^summary:\s+([\d ]+)$", re.MULTILINE)
# What --cache-sim prints per replay: a name, and the events it adds up.
MISSES = {"I1 misses": ("I1mr",), "D1 misses": ("D1mr", "D1mw"), "LL misses": ("ILmr", "DLmr", "DLmw"),
          "mispredicted branches": ("Bcm", "Bim")}


def dump_events(text: str, window: str) -> dict[str, int]:
    """Every event of one window by name (Ir first): the `summary:` of the dump `callgrind_control
    --dump=<window>` wrote (what callgrind counted since the window's zeroing); else no figure."""
    if f"desc: Trigger: dump {window}" not in text.splitlines():
        raise NoFigure(f"a callgrind dump was not the window {window!r}'s")
    names, found = _EVENTS.search(text), _SUMMARY.search(text)
    if names is None or found is None:
        raise NoFigure(f"the window {window!r}'s dump has no events: or summary: line")
    events = dict(zip(names.group(1).split(), (int(n) for n in found.group(1).split()), strict=False))
    if events.get("Ir", 0) <= 0:
        raise NoFigure(f"the window {window!r}'s dump counted no instructions")
    return events


def control(pid: int, *args: str) -> None:
    """`callgrind_control ARGS PID`; no figure if it fails."""
    command = shutil.which("callgrind_control")
    if command is None:
        raise NoFigure("callgrind_control is not installed beside valgrind: no windows")
    done = subprocess.run([command, *args, str(pid)], capture_output=True, text=True, timeout=CONTROL_SECONDS)
    if done.returncode != 0 or "OK." not in done.stdout:
        raise NoFigure(f"callgrind_control {' '.join(args)} {pid} failed: {(done.stdout + done.stderr).strip()}")


@dataclass(frozen=True)
class Served:
    """One callgrind process of one variant: its windows' instructions per replay."""

    variant: str
    repeat: int
    per_replay: list[float]
    misses: dict[str, float] | None = None  # --cache-sim: MISSES per replay, over all the windows


async def count(stack: Stack, variant: str, repeat: int, windows: int, seconds: float, clients: int,
                cache_sim: bool = False) -> Served:
    """One `payments api` of `variant` under callgrind, warmed up; `windows` windows of replays counted."""
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"served-{variant}-r{repeat}.out"
    for old in OUT.glob(f"{out.name}*"):
        old.unlink()
    process = stack.system.api_process(f"served-{variant}-r{repeat}", args=("--workers", "1"),
                                       **SETTINGS[variant], **PATIENT)
    process.env["PYTHONHASHSEED"] = "0"  # set and dict order, and so the work, alike in every run
    # The console script run by this Python, under valgrind: `payments api` itself, not a wrapper.
    process.argv = [require_valgrind(), "--tool=callgrind", f"--callgrind-out-file={out}",
                    *(("--cache-sim=yes", "--branch-sim=yes") if cache_sim else ()), sys.executable, *process.argv]
    process.log = LOGS / f"{out.stem}.log"
    process.log.unlink(missing_ok=True)
    process.timeout, process.grace = START_SECONDS, 60
    try:
        process.start()
    except NotHealthy as exc:
        raise NoFigure(f"{variant} under callgrind did not start: {exc}") from None
    try:
        async with Load(process.url, stack.api_key, clients) as load:
            paid = (await load.new_payments(PAY_SECONDS)).paid
            if not paid:
                raise NoFigure(f"{variant}: no new payment answered 201 within {PAY_SECONDS:g} s under callgrind")
            await load.replays(paid, WARM_SECONDS)
            figures, events, replays = [], Counter(), 0
            for number in range(1, windows + 1):
                name = f"w{number}"
                control(process.pid, "--zero")
                result = await load.replays(paid, seconds)
                control(process.pid, f"--dump={name}")
                if result.failed or not result.succeeded:
                    raise NoFigure(f"{variant}: {result.failed} of {result.requests} replays were not the stored "
                                   f"answer ({dict(result.statuses)})")
                dumps = sorted(OUT.glob(f"{out.name}.*"), key=lambda p: int(p.suffix[1:]))
                if len(dumps) != number:
                    raise NoFigure(f"{variant}: callgrind wrote {len(dumps)} dumps after {number} windows")
                counted = dump_events(dumps[-1].read_text(errors="replace"), name)
                events.update(counted)
                replays += result.succeeded
                figures.append(counted["Ir"] / result.succeeded)
                console.print(f"{variant} repeat {repeat} window {number}: {result.succeeded} replays, "
                              f"{figures[-1]:,.0f} instructions each")
            misses = None
            if cache_sim:
                if not all(e in events for parts in MISSES.values() for e in parts):
                    raise NoFigure(f"{variant}: --cache-sim, but the dumps hold only {sorted(events)}")
                misses = {name: sum(events[e] for e in parts) / replays for name, parts in MISSES.items()}
            return Served(variant, repeat, figures, misses)
    finally:
        process.stop()


async def run_all(stack: Stack, chosen: list[str], repeats: int, windows: int, seconds: float,
                  clients: int, cache_sim: bool) -> list[Served]:
    """Every variant's repeats, one callgrind process at a time, the variants taking turns."""
    return [await count(stack, variant, repeat, windows, seconds, clients, cache_sim)
            for repeat in range(1, repeats + 1) for variant in chosen]


def report(served: list[Served], chosen: list[str], tolerance: float) -> None:
    means = {}
    for variant in chosen:
        # A process's figure is the mean of its windows; the processes must agree.
        figures = [sum(s.per_replay) / len(s.per_replay) for s in served if s.variant == variant]
        means[variant] = agreed(f"{variant} per replay, served", figures, tolerance)
        console.print(f"{variant}: {means[variant]:,.0f} instructions per replay in the whole API process "
                      f"(repeats within {spread(figures):.2%})")
    if {PHASED, UNWATCHED} <= set(chosen):
        console.print(f"phased ÷ unwatched per replay, served = {means[PHASED] / means[UNWATCHED]:.4f}")
    if all(s.misses is not None for s in served):
        # A model's counts: shown per process, and their means; not held to the tolerance.
        for name in MISSES:
            by = {v: sum(s.misses[name] for s in served if s.variant == v) / sum(s.variant == v for s in served)
                  for v in chosen}
            line = ", ".join(f"{v} {by[v]:,.0f}" for v in chosen)
            if {PHASED, UNWATCHED} <= set(chosen) and by[UNWATCHED]:
                line += f" (÷ {by[PHASED] / by[UNWATCHED]:.3f})"
            console.print(f"{name} per replay (simulated): {line}")


def main(
    variants: str = typer.Option(f"{PHASED},{UNWATCHED}", help="phased and/or unwatched, comma-separated."),
    seconds: float = typer.Option(30.0, min=5, help="Each window's replays, in seconds (under valgrind)."),
    windows: int = typer.Option(2, min=1, help="Windows per process."),
    clients: int = typer.Option(8, min=1, help="Concurrent clients replaying."),
    repeats: int = typer.Option(2, min=2, help="Processes per variant; their figures must agree."),
    tolerance: float = typer.Option(0.01, min=0, help="How far (a fraction) the repeats may disagree."),
    cache_sim: bool = typer.Option(False, "--cache-sim", help="Also simulate the caches and branch predictor."),
) -> None:
    """A replay's instructions in the whole `payments api` process, watched and unwatched."""
    chosen = [v.strip() for v in variants.split(",") if v.strip()]
    if not chosen or set(chosen) - set(SAFE):
        raise typer.BadParameter("--variants is phased and/or unwatched")
    try:
        console.print(subprocess.run([require_valgrind(), "--version"], capture_output=True, text=True).stdout.strip())
        with patient_stack() as (stack, _):
            served = asyncio.run(run_all(stack, chosen, repeats, windows, seconds, clients, cache_sim))
            report(served, chosen, tolerance)
    except NoFigure as exc:
        console.print(f"[bold red]NO FIGURE: {exc}[/]")
        raise typer.Exit(1) from None


if __name__ == "__main__":
    typer.run(main)
