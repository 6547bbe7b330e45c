"""The webhook dispatcher's instructions per first attempt: a figure the machine's noise does not move.

    .venv/bin/python -m bench.webhook_instructions [--webhooks 800] [--warmup 200] [--repeats 2] [--tolerance 0.03]
        [--statements/--no-statements] [--events-per-post 1]

Not on a request's path: a bench of its own, beside bench/webhook_cpu.py
(the dispatcher's CPU seconds per webhook, which move with whatever else the
machine runs) and bench/instructions.py (the API's instructions per payment).

The dispatcher (app/workers/webhooks.py::dispatch_loop, the code `payments
worker` runs) runs alone in a process under `valgrind --tool=callgrind`
(this module's `--drive`), against a real PostgreSQL, the fake merchant (a
process of its own, not counted) and the payments an API wrote. Callgrind
counts one window (bench/instructions.py's MARKERS): the first attempts of
`--webhooks` events, read behind the cursor in full batches, POSTed, and
their rows written. So the window holds exactly the work of those first
attempts, and no start-up, import or warm-up:

1. `--warmup` payments are written, and the dispatcher starts under
   callgrind and delivers their webhooks (connections, prepared statements,
   caches).
2. A writing transaction is held open, so that the cursor reads nothing new
   (it reads only behind every running writer: docs/outbox-inbox.md), and
   `--webhooks` more payments are written.
3. The window opens, the transaction ends, and the dispatcher delivers the
   batch as fast as it can; the window closes when every one of them has
   its `delivered` row. The figure is the window's instructions over the
   webhooks delivered in it.

What the window also holds, and is small beside a webhook: the dispatcher's
rest between batches (its `retries` loop's polls, a few a second) and the
marker files this process touches. Each repeat runs a new dispatcher on the
same system; a figure is given only if the repeats agree within
`--tolerance`. A run that cannot produce it (no valgrind, no window's dump,
repeats that disagree, webhooks not delivered, or a POST that failed, whose
retries the window would count) says NO FIGURE and why, and exits 1. Under
callgrind the dispatcher runs tens of times slower, so the cursor's
patience with a batch's POSTs is stretched (`CALLGRIND_PATIENCE_SECONDS`):
the window counts the path a dispatcher takes at full speed.

With `--statements` (the default) the run also gives the database's cost
per statement over the last window, per first attempt: PostgreSQL's
`pg_stat_statements` (preloaded on an embedded server of the bench's own,
as bench/instructions.py does) is reset as the window opens and read as it
closes, so it holds the dispatcher's statements in the window and this
process's own polls for the `delivered` rows, which are named as such.

For a before/after, run the same command with PYTHONPATH on another copy of
the tree (a `git worktree` of the commit before): every process of the run,
the dispatcher's included, then imports that copy's app/.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import typer

from app.outbox.endpoints import MAX_EVENTS_PER_POST
from bench.instructions import (
    MARKERS,
    NoFigure,
    agreed,
    bench_server,
    normalise,
    read_statements,
    require_statements,
    require_valgrind,
    reset_statements,
    show,
    window_total,
)
from bench.load import Load
from bench.system import LOGS, RESULTS, console
from devtools.system import System

SERVICE_DATABASE = "payments_webhook_instructions"
RAILS_DATABASE = "payments_webhook_instructions_rails"
OUT = RESULTS / "callgrind"
# How long the dispatcher, slowed down by callgrind, may take to start, or to deliver a window's webhooks.
PATIENCE_SECONDS = 300.0
# How often the dispatcher's process looks for the next marker file (its only work besides the dispatcher's).
MARKER_POLL_SECONDS = 0.05
# The cursor's patience with a batch's POSTs inside the process under callgrind (`drive`).
CALLGRIND_PATIENCE_SECONDS = 60.0
# This process's own poll for the window's end, which pg_stat_statements sees beside the dispatcher's statements.
DELIVERED_SQL = "SELECT count(*) FROM webhook_delivery WHERE state = 'delivered'"
# Attempts that were not delivered the first time: a window with any has no figure (`one_window`).
AGAIN_SQL = ("SELECT count(*), coalesce(error_class, outcome) FROM webhook_attempt "
             "WHERE attempt > 1 OR outcome IS DISTINCT FROM 'delivered' GROUP BY 2")


# --- The process under callgrind -----------------------------------------------


def drive(markers: Path) -> None:
    """Run the dispatcher until `markers`/stop exists, counting the window between `open` and `close`."""
    import uvloop

    from app.config import Settings
    from app.services import open_services
    from app.workers import webhooks
    from app.workers.webhooks import dispatch_loop

    # Under callgrind the dispatcher runs tens of times slower than at full
    # speed, and a batch's POSTs would outlast the second the cursor waits
    # for them, sending them down a slow endpoint's path (recorded one by one
    # after the cursor has moved); stretched, the window counts the path a
    # dispatcher takes at full speed.
    webhooks.CURSOR_PATIENCE_SECONDS = CALLGRIND_PATIENCE_SECONDS

    async def wait_for(name: str) -> None:
        while not (markers / name).exists():
            await asyncio.sleep(MARKER_POLL_SECONDS)

    async def run() -> None:
        async with open_services(Settings()) as services:
            stop = asyncio.Event()
            dispatcher = asyncio.create_task(dispatch_loop(services, stop))
            await wait_for("open")
            sys.getallocatedblocks()  # MARKERS: callgrind zeroes its counts here
            (markers / "opened").touch()
            await wait_for("close")
            gc.get_freeze_count()  # MARKERS: and writes what it counted since, here
            (markers / "closed").touch()
            stop.set()
            dispatcher.cancel()
            await asyncio.gather(dispatcher, return_exceptions=True)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(run())


# --- The run around it ---------------------------------------------------------


async def _until(check, what: str, limit: float = PATIENCE_SECONDS) -> None:
    deadline = time.monotonic() + limit
    while not await check():
        if time.monotonic() > deadline:
            raise NoFigure(f"{what}: not within {limit:.0f} s")
        await asyncio.sleep(0.2)  # polling the database, bounded by the deadline


async def _write(load: Load, conn: asyncpg.Connection, until: int) -> int:
    """New payments until the service holds `until` events; how many it holds then."""
    while (events := await conn.fetchval("SELECT count(*) FROM event")) < until:
        await load.new_payments(0.2)
    return events


def dispatcher_statements() -> dict[str, str]:
    """The dispatcher's statements by their normalised text (bench/instructions.py's `normalise`) → a name."""
    from sqlalchemy.sql.elements import TextClause

    from app.outbox import delivery

    found = {normalise(DELIVERED_SQL): "this bench's own poll for the window's end"}
    for name, value in vars(delivery).items():
        if isinstance(value, TextClause):  # sent by SQLAlchemy or, compiled to $n, by the driver: read alike
            found[normalise(value.text)] = f"delivery.{name}"
    return found


async def one_window(system: System, service_url: str, load: Load, webhooks: int, warmup: int, tag: str,
                     server_url: str | None = None) -> dict:
    """Start a dispatcher under callgrind, warm it up, count one window of `webhooks` first attempts.

    Given `server_url` (the server's maintenance database), pg_stat_statements
    is reset as the window opens and read as it closes (the window's `statements`).
    """
    out = OUT / f"webhooks-{tag}.out"
    markers = OUT / f"webhooks-{tag}.markers"
    markers.mkdir(parents=True, exist_ok=True)
    for old in [*OUT.glob(f"{out.name}*"), *markers.iterdir()]:
        old.unlink()
    conn = await asyncpg.connect(service_url)

    async def delivered() -> int:
        return await conn.fetchval(DELIVERED_SQL)

    log = (LOGS / f"webhook-instructions-{tag}.log").open("w")
    child = None
    try:
        written = await _write(load, conn, await conn.fetchval("SELECT count(*) FROM event") + warmup)
        child = subprocess.Popen(
            [require_valgrind(), "--tool=callgrind", f"--callgrind-out-file={out}", *MARKERS,
             sys.executable, "-m", "bench.webhook_instructions", "--drive", str(markers)],
            # The same hash seed every run: set and dict order, and so the work, do not vary.
            env={**os.environ, **system.service_env(), "PYTHONHASHSEED": "0"},
            stdout=log, stderr=subprocess.STDOUT,
        )
        await _until(lambda: _at_least(delivered, written), "the warm-up's webhooks delivered under callgrind")
        # Held open, this writer keeps the cursor where it is: the window's events wait until it ends.
        blocker = await asyncpg.connect(service_url)
        try:
            hold = blocker.transaction()
            await hold.start()
            await blocker.fetchval("SELECT pg_current_xact_id()")
            written = await _write(load, conn, written + webhooks)
            before = await delivered()
            if server_url:
                await reset_statements(server_url)
            (markers / "open").touch()
            await _until(lambda: _exists(markers / "opened"), "the window opened")
            await hold.rollback()
        finally:
            await blocker.close()
        await _until(lambda: _at_least(delivered, written), "the window's webhooks delivered under callgrind")
        counted = await delivered() - before
        # The figure is of first attempts that went through: a window in
        # which a POST failed (a timeout, an error) also counts its retries.
        if again := await conn.fetch(AGAIN_SQL):
            raise NoFigure(f"attempts not delivered the first time by the end of window {tag}, whose retries the "
                           f"window counts too: {', '.join(f'{r[0]} ({r[1]})' for r in again)}")
        statements = await read_statements(server_url, SERVICE_DATABASE) if server_url else []
        (markers / "close").touch()
        await _until(lambda: _exists(markers / "closed"), "the window closed")
        child.wait(PATIENCE_SECONDS)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        log.close()
        await conn.close()
    dumps = sorted(OUT.glob(f"{out.name}.*"))
    if len(dumps) != 1:
        raise NoFigure(f"callgrind wrote the dumps {[d.name for d in dumps]}, not one for the window: is "
                       f"{MARKERS} a function of this Python's (its symbols stripped)? see {log.name}")
    instructions = window_total(dumps[0].read_text(errors="replace"))
    return {"webhooks": counted, "instructions": instructions, "per_webhook": instructions / counted,
            "statements": [dict(r) for r in statements]}


async def _at_least(count, target: int) -> bool:
    return await count() >= target


async def _exists(path: Path) -> bool:
    return path.exists()


def main(
    webhooks: int = typer.Option(800, help="First attempts counted in each window."),
    warmup: int = typer.Option(200, help="Payments whose webhooks the dispatcher delivers before the window."),
    repeats: int = typer.Option(2, help="Windows, each in a new dispatcher; their figures must agree."),
    tolerance: float = typer.Option(0.03, help="How far the repeats may disagree (a fraction)."),
    port_base: int = typer.Option(55760, help="The first of four consecutive ports."),
    statements: bool = typer.Option(True, "--statements/--no-statements",
                                    help="Also the database's cost per statement in the last window."),
    events_per_post: int = typer.Option(1, "--events-per-post", min=1, max=MAX_EVENTS_PER_POST,
                                        help="At most this many events in one POST to the merchant's endpoint."),
    drive_markers: Path | None = typer.Option(None, "--drive", hidden=True),
) -> None:
    if drive_markers is not None:
        drive(drive_markers)
        return
    psp_port, rail_port, merchant_port, api_port = range(port_base, port_base + 4)
    try:
        require_valgrind()
        with System(LOGS / "webhook_instructions") as system, bench_server(system) as server_url:
            if statements:
                try:
                    asyncio.run(require_statements(server_url))
                except NoFigure as exc:
                    raise NoFigure(f"{exc} (--no-statements: the instructions alone)") from None
            rails_url = system.create_database(RAILS_DATABASE, migrate=False)
            service_url = system.create_database(SERVICE_DATABASE)
            client_id, api_key = system.create_client("bench-webhooks")
            system.start_fakes(records_url=rails_url, psp_port=psp_port, rail_port=rail_port)
            from app.outbox.endpoints import new_secret

            secret = new_secret()
            system.start_merchant(port=merchant_port, records_url=rails_url, secrets=[secret])
            api = system.start_api(port=api_port)

            async def run() -> list[dict]:
                conn = await asyncpg.connect(service_url)
                try:
                    await conn.execute(
                        "INSERT INTO webhook_endpoint (client_id, url, secret_sealed, events_per_post) "
                        "VALUES ($1, $2, $3, $4)",
                        client_id, system.merchant.url + "/webhooks", system.seal(secret), events_per_post)
                finally:
                    await conn.close()
                async with Load(api.url, api_key, 8) as load:
                    return [await one_window(system, service_url, load, webhooks, warmup, str(n),
                                             server_url if statements else None)
                            for n in range(1, repeats + 1)]

            windows = asyncio.run(run())
        figure = agreed("instructions per webhook", [w["per_webhook"] for w in windows], tolerance)
    except NoFigure as exc:
        console.print(f"[bold red]NO FIGURE[/]: {exc}")
        raise typer.Exit(1) from None
    for n, w in enumerate(windows, 1):
        console.print(f"window {n}: {w['webhooks']} first attempts, {w['instructions']:,} instructions, "
                      f"{w['per_webhook']:,.0f} a webhook")
    console.print(f"the dispatcher's instructions per first attempt: [bold]{figure:,.0f}[/] "
                  f"(the mean of {len(windows)} windows; at most {events_per_post} events a POST)")
    last = windows[-1]
    if statements:
        rows = [r for r in last.pop("statements") if r["toplevel"]]
        own = dispatcher_statements()
        show(rows, last["webhooks"], own, f"the database's cost per statement in window "
             f"{len(windows)} ({last['webhooks']} first attempts; pg_stat_statements)", False, unit="webhook")
        mine = [r for r in rows if own.get(normalise(r["query"]), "").startswith("delivery.")]
        console.print(f"the dispatcher's statements per first attempt: "
                      f"{sum(r['calls'] for r in mine) / last['webhooks']:.3f} calls, "
                      f"{sum(r['total_exec_time'] for r in mine) / last['webhooks']:.3f} ms, "
                      f"{sum(r['shared_blks_hit'] + r['shared_blks_read'] for r in mine) / last['webhooks']:.1f} "
                      f"shared blocks, {sum(float(r['wal_bytes']) for r in mine) / last['webhooks']:,.0f} WAL bytes")
    for w in windows:
        w.pop("statements", None)
    print(json.dumps({"instructions_per_webhook": round(figure), "events_per_post": events_per_post,
                      "windows": windows}), flush=True)


if __name__ == "__main__":
    typer.run(main)
