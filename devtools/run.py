"""Development tooling, not the payment path: what `payments run` (and so `make run`) does.

app/cli.py's `run` command imports this inside the command and calls `run`;
nothing else in app/ imports devtools. It starts the whole system with
devtools/system.py: the embedded PostgreSQL unless DATABASE_URL names a
server (its `payments` database, kept from run to run), migrations, a demo
client whose key is kept in .data/, the fake PSP, the fake rail, the API and
the recovery worker on the ports given, then prints how to pay once. Ctrl-C,
a closed terminal (SIGHUP) or a SIGTERM stops every process it started and
the embedded PostgreSQL if it started it.

Its children get the user's environment (plus where the database and the
fakes are), so the settings of README.md#settings apply to `make run`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from app.cli import create_client
from devtools.bodies import payment_body
from devtools.processes import NotHealthy
from devtools.system import System


def run(console: Console, api_port: int, psp_port: int, rail_port: int) -> None:
    """Start everything: database, migrations, fake PSP, fake rail, API, worker; until Ctrl-C."""
    # A person reads these processes' lines at the terminal: the readable
    # log format, unless LOG_FORMAT says otherwise (README.md#configuration).
    system = System(environ={"LOG_FORMAT": "console"} | dict(os.environ))
    metrics_port = os.environ.get("WORKER_METRICS_PORT", "8200")

    def start() -> None:
        api_key = demo_api_key(open_database(system, console))
        system.start_fakes(psp_port=psp_port, rail_port=rail_port)
        system.start_api("API", port=api_port)
        system.start_worker("recovery worker", WORKER_METRICS_PORT=metrics_port)
        _print_welcome(console, api_port, psp_port, rail_port, api_key, metrics_port=metrics_port)

    supervise(system, console, start)


def open_database(system: System, console: Console) -> str:
    """The `payments` database `make run` keeps from run to run (DATABASE_URL's, else embedded), migrated; its URL."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return system.use_database(url)
    with console.status("starting embedded PostgreSQL"):
        postgres = system.start_postgres()
    url = system.create_database("payments", fresh=False)
    console.print(f"PostgreSQL (embedded) at {url}" + ("" if postgres.started else " (already running)"))
    return url


def supervise(system: System, console: Console, start: Callable[[], None]) -> None:
    """`start` the system, then watch it until Ctrl-C, SIGTERM, SIGHUP or a process exits; always stop it all."""
    try:
        try:
            start()
        except NotHealthy as exc:
            raise SystemExit(str(exc)) from None
        # A closed terminal (SIGHUP) or a polite kill (SIGTERM) must clean up
        # like Ctrl-C does, or the children would outlive us.
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGHUP, _interrupt)
        while all(process.running for process in system.processes):
            time.sleep(0.5)
        console.print("[red]a process exited; stopping everything[/]")
    except KeyboardInterrupt:
        console.print("\nstopping")
    finally:
        # A second Ctrl-C (or SIGTERM) during the clean-up must not cut it
        # short: that would leave PostgreSQL or a child running. Any child
        # that does not stop within its grace is killed, so this ends.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        system.stop()
        if system.postgres is not None and system.postgres.started:
            console.print("embedded PostgreSQL stopped (data kept in .data/)")


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def demo_api_key(url: str) -> str:
    """The demo client's key: kept in .data/ so the next `make run` prints the same one."""
    from sqlalchemy.ext.asyncio import create_async_engine

    from app import clients
    from app.config import asyncpg_url
    from app.db.transaction import read

    # One file per database, so switching DATABASE_URL back and forth keeps both keys.
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    path = Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")) / f"demo-api-key-{digest}"
    if path.exists():
        api_key = path.read_text().strip()

        async def known() -> bool:
            engine = create_async_engine(asyncpg_url(url), hide_parameters=True)
            try:
                return await read(engine, clients.authenticate, api_key) is not None
            finally:
                await engine.dispose()

        if asyncio.run(known()):
            return api_key
    _, api_key = create_client(url, "demo")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(api_key + "\n")
    return api_key


def _print_welcome(console: Console, api_port: int, psp_port: int, rail_port: int, api_key: str, *,
                   metrics_port: str = "8200") -> None:
    console.rule("[bold green]exactly-once payments is running")
    console.print(f"API        http://127.0.0.1:{api_port}   (OpenAPI UI: http://127.0.0.1:{api_port}/docs)")
    console.print(f"fake PSP   http://127.0.0.1:{psp_port}   (records: /_admin/charges)")
    console.print(f"fake rail  http://127.0.0.1:{rail_port}   (records: /_admin/transfers)")
    console.print("worker     the recovery worker resumes any payment whose owner died")
    console.print(f"metrics    http://127.0.0.1:{api_port}/metrics (API), http://127.0.0.1:{metrics_port}/metrics "
                  "(worker): docs/operations.md")
    print_pay_once(console, f"http://127.0.0.1:{api_port}", api_key)


def print_pay_once(console: Console, api_url: str, api_key: str) -> None:
    """The demo client's key and a curl command that pays once through `api_url`; how to stop."""
    key = f"demo-{uuid.uuid4()}"
    body = json.dumps(payment_body(f"order-{uuid.uuid4().hex[:8]}"))
    console.print(f"API key    [bold]{api_key}[/]  (client 'demo')")
    console.print("\nPay once (paste it twice: the second answer is a replay, with Idempotent-Replayed: true):\n")
    console.print(
        f"curl -sS -i -X POST {api_url}/v1/payments \\\n"
        f"  -H 'Authorization: Bearer {api_key}' \\\n"
        f"  -H 'Idempotency-Key: {key}' \\\n"
        f"  -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'",
        soft_wrap=True, highlight=False, markup=False,
    )
    console.print("\nCtrl-C stops every process started here.")
