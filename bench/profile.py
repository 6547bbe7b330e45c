"""Where an API process spends its CPU under the bench's load: py-spy, summarised.

    .venv/bin/python -m bench.profile [--variant phased|unwatched|naive] [--replays] [--duration 10] [--workers 1]

Starts the same system as `make bench` (its own databases, the fakes, one
API), drives it with the bench's load generator, and meanwhile samples the
API's Python stacks with py-spy (`record --format raw`, 100 Hz, busy threads
only). py-spy needs to attach to another process (root, or ptrace allowed).
A busy thread, to py-spy, is one the kernel says is running or ready to
run: on a loaded machine the API also waits, ready, for a CPU, and those
waits are sampled too, at whatever call the kernel took the CPU away
(often a socket write, which wakes the process at the other end). So the
shares below are of the time the API was running or ready to run, not of
its CPU; the run prints both figures side by side, and `perf record -e
cpu-clock -p <pid>` gives the CPU alone. It then prints:

by layer
    the HTTP server and framework, validation, SQLAlchemy, asyncpg, the rail
    clients, metrics and logs, the outbox, the machine, the event loop: each
    sample in the layer of its innermost frame that belongs to one (LAYERS).
by package, self
    where the samples were when they were taken: the code that burned the
    CPU (a sample in asyncpg's protocol is asyncpg's cost, even when
    SQLAlchemy called it).
by package, anywhere on the stack
    how much of the CPU ran under each package (a sample counts once for
    every package on its stack): "SQLAlchemy was involved in 60% of it".
by file and by function, self
    the hot spots themselves.

The figures are for one run on one machine; compare them with a profile of
the other variant, or of the same code before a change, taken the same way.
The raw stacks are kept in bench/results/ for flame graphs (e.g. speedscope).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from collections import Counter
from datetime import UTC, datetime

import typer
from rich.table import Table

from bench.load import Load
from bench.system import (
    BIN, NAIVE, PHASED, RESULTS, UNWATCHED, apis, console, database_server, fakes, prepare_databases, running,
)
from bench.watching import cpu_seconds

_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")


RATE = 100  # py-spy's samples a second


def package_of(path: str) -> str:
    """A frame's file as a package: `sqlalchemy`, `asyncio`, `app.payments`, `threading`...

    py-spy names files relative to their sys.path entry (`asyncpg/protocol.py`,
    `app/payments/phases.py`), so the first component is the package; ours are
    split one level further.
    """
    parts = path.split("site-packages/")[-1].split("/")
    if parts[0] in ("app", "naive_twin", "fake_rails", "bench") and len(parts) > 2:
        return f"{parts[0]}.{parts[1]}"
    return parts[0].removesuffix(".py") or "?"


# The layers a request passes through, by the package its code is in. A
# sample is put in the layer of the innermost frame that belongs to one:
# json, re or hashlib at the leaf are the work of whichever layer called them.
HTTP_CLIENTS = ("aiohttp", "httpx", "httpcore", "yarl", "multidict")
LAYERS = (
    ("the rail clients (aiohttp)", (*HTTP_CLIENTS, "app.rails")),
    ("HTTP server and framework", ("uvicorn", "httptools", "h11", "starlette", "fastapi", "app.api", "anyio")),
    ("validation (pydantic)", ("pydantic", "pydantic_core")),
    ("SQLAlchemy", ("sqlalchemy",)),
    ("asyncpg", ("asyncpg",)),
    ("metrics and logs", ("prometheus_client", "logging", "pythonjsonlogger", "app.observability")),
    ("the outbox", ("app.outbox",)),
    ("the machine, the phases and the rest of ours", ("app.machine", "app.payments", "app.idempotency", "app.ledger",
                                                      "app.db", "app.fastpath", "app", "naive_twin.app")),
    ("the event loop", ("asyncio", "uvloop", "selectors")),
)
RAIL_CLIENTS, OUTBOX = LAYERS[0][0], "the outbox"


def layer_of(packages: list[str]) -> str:
    """The layer of one sample, from its frames' packages (outermost first).

    An HTTP client's frames under the outbox's code are the webhook
    dispatcher's, not a rail client's; h11 under an HTTP client is that
    client's, not the server's.
    """
    client = any(p.split(".")[0] in HTTP_CLIENTS for p in packages)
    outbox = any(p == "app.outbox" for p in packages)
    for package in reversed(packages):
        for layer, members in LAYERS:
            if package in members or package.split(".")[0] in members:
                if layer == RAIL_CLIENTS or (package == "h11" and client):
                    return OUTBOX if outbox else RAIL_CLIENTS
                return layer
    return "other"


def summarise(raw: str) -> dict[str, list[tuple[str, float]]]:
    """py-spy's raw (collapsed) stacks -> shares of all samples, by package and by hot spot."""
    self_package: Counter[str] = Counter()
    any_package: Counter[str] = Counter()
    self_file: Counter[str] = Counter()
    self_function: Counter[str] = Counter()
    by_layer: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_FRAME.match(f) for f in stack.split(";")]
        frames = [f for f in frames if f]
        if not frames:
            continue
        total += count
        leaf = frames[-1]
        package = package_of(leaf["file"])
        self_package[package] += count
        self_file[leaf["file"].split("site-packages/")[-1]] += count
        self_function[f"{leaf['function']} ({package})"] += count
        for name in {package_of(f["file"]) for f in frames}:
            any_package[name] += count
        by_layer[layer_of([package_of(f["file"]) for f in frames])] += count

    def shares(counter: Counter[str], n: int) -> list[tuple[str, float]]:
        return [(name, round(100 * c / total, 1)) for name, c in counter.most_common(n)] if total else []

    # Packages under every sample (the entry point, uvicorn's loop) say nothing.
    everywhere = {name for name, c in any_package.items() if c >= 0.6 * total and name not in self_package}
    for name in everywhere | {"payments", "naive-twin", "typer", "runpy", "<frozen runpy>"}:
        any_package.pop(name, None)

    return {
        "samples": [("total", float(total))],
        "self_by_layer": shares(by_layer, len(LAYERS) + 1),
        "self_by_package": shares(self_package, 15),
        "anywhere_by_package": shares(any_package, 15),
        "self_by_file": shares(self_file, 15),
        "self_by_function": shares(self_function, 15),
    }


def busy_and_cpu(samples: int, sampled: float, cpu: float, seconds: float) -> tuple[float, float]:
    """The share of its `sampled` seconds py-spy counted busy (`samples` at RATE), and the share of `seconds`
    (py-spy's run, start to exit) the sampled processes spent on a CPU (`cpu`, in seconds). The first above the
    second is time spent ready to run, waiting for a CPU."""
    return samples / (RATE * sampled), cpu / seconds


def print_summary(summary: dict[str, list[tuple[str, float]]], title: str) -> None:
    console.print(f"[bold]{title}[/]: {int(summary['samples'][0][1])} samples")
    if "cpu" in summary:
        sampled, seconds, cpu = (value for _, value in summary["cpu"])
        busy, on_cpu = busy_and_cpu(int(summary["samples"][0][1]), sampled, cpu, seconds)
        console.print(f"busy to py-spy {busy:.0%} of its {sampled:g} s; on a CPU {on_cpu:.0%} of py-spy's run "
                      f"({cpu:.2f} s of CPU in {seconds:.2f} s): the gap is time spent ready to run, waiting for a CPU")
    for key, heading in (("self_by_layer", "by layer (the innermost frame of a layer's own code)"),
                         ("self_by_package", "by package, self"),
                         ("anywhere_by_package", "by package, anywhere on the stack"),
                         ("self_by_file", "by file, self"),
                         ("self_by_function", "by function, self")):
        table = Table(title=heading, title_justify="left")
        table.add_column("where")
        table.add_column("% of samples", justify="right")
        for name, share in summary[key]:
            table.add_row(name, f"{share:.1f}")
        console.print(table)


def main(
    variant: str = typer.Option(PHASED, help="phased, unwatched (metrics and logs off) or naive."),
    replays: bool = typer.Option(False, "--replays", help="Profile replays of finished payments (phased only)."),
    duration: float = typer.Option(10.0, min=1, help="Seconds of sampling."),
    warmup: float = typer.Option(3.0, min=0, help="Seconds of load before sampling starts."),
    concurrency: int = typer.Option(32, min=1),
    workers: int = typer.Option(1, min=1, help="Worker processes (>1: every worker is sampled)."),
) -> None:
    """Profile one API under the bench's load with py-spy, and summarise where its CPU goes."""
    if variant not in (PHASED, UNWATCHED, NAIVE) or (replays and variant == NAIVE):
        raise typer.BadParameter("--variant is phased, unwatched or naive; --replays needs phased or unwatched")
    py_spy = shutil.which("py-spy") or str(BIN / "py-spy")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    output = RESULTS / f"profile-{variant}{'-replays' if replays else ''}-{stamp}.txt"
    RESULTS.mkdir(parents=True, exist_ok=True)
    with database_server() as server:
        dbs = prepare_databases(server)
        psp, rail = fakes(dbs.rails_url)
        api = apis(dbs.service_url, psp, rail, workers)[variant]
        with running([psp, rail, api]):

            async def go() -> tuple[int, int]:
                async with Load(api.url, dbs.api_key, concurrency) as load:
                    paid = (await load.new_payments(max(warmup, 2.0 if replays else 0.0))).paid[:1000]

                    def drive(seconds: float):
                        return load.replays(paid, seconds) if replays else load.new_payments(seconds)

                    argv = [py_spy, "record", "--format", "raw", "--rate", str(RATE), "--nonblocking",
                            "--duration", str(round(duration)), "--output", str(output), "--pid", str(api.pid)]
                    if workers > 1:
                        argv.append("--subprocesses")
                    cpu_before, started = cpu_seconds(api), time.monotonic()  # with uvicorn's workers
                    spy = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.DEVNULL,
                                                               stderr=subprocess.PIPE)
                    driving = asyncio.ensure_future(drive(duration + 2))  # on past py-spy's end
                    _, stderr = await spy.communicate()
                    window = (time.monotonic() - started, cpu_seconds(api) - cpu_before)
                    result = await driving
                    if spy.returncode != 0:
                        console.print(f"[red]py-spy failed[/]: {stderr.decode()[-500:]}")
                    return result.succeeded, spy.returncode or 0, window

            done, rc, (seconds, cpu) = asyncio.run(go())
    if rc != 0 or not output.exists():
        raise typer.Exit(1)
    summary = summarise(output.read_text()) | {
        "cpu": [("sampled", float(round(duration))), ("seconds", round(seconds, 3)), ("cpu_seconds", round(cpu, 3))]
    }
    what = f"{variant} API ({workers}w), {'replays' if replays else 'new payments'}"
    print_summary(summary, f"{what}: {done} answered in {duration + 2:g} s")
    output.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"raw stacks: {output}; summary: {output.with_suffix('.json')}")


if __name__ == "__main__":
    typer.run(main)
