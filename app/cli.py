"""The `payments` command: run the API, migrate, manage clients, start the stack.

`payments run` is what `make run` calls: the whole system on one machine, on
an embedded PostgreSQL unless DATABASE_URL names a server. It is development
tooling (devtools/run.py), imported inside the command only.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import typer
from rich.console import Console

cli = typer.Typer(help="Exactly-once payments service.", no_args_is_help=True, add_completion=False)
clients_cli = typer.Typer(help="Manage API clients.", no_args_is_help=True)
cli.add_typer(clients_cli, name="clients")
console = Console()


def _database_url() -> str:
    from app.config import asyncpg_url

    url = os.environ.get("DATABASE_URL")
    if not url:
        console.print("[red]DATABASE_URL is not set.[/] Use `make run`, or point it at a PostgreSQL server.")
        raise typer.Exit(2)
    try:
        asyncpg_url(url)
    except ValueError as exc:  # the message never repeats the URL (it holds a password)
        console.print(f"DATABASE_URL is {exc}", style="red", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(2) from None
    return url


def _settings():
    """The settings from the environment, or a clear refusal to start (exit 2).

    A bad setting is named with pydantic's message but without the value it
    was given (a DATABASE_URL holds a password), and without a traceback.
    """
    from pydantic import ValidationError

    from app.config import Settings
    from app.payments import crash_points

    try:
        settings = Settings()
        # Checked here, where the payment path's names are known (the
        # settings sit below it and name no crash point themselves).
        crash_points.validate(settings.payments_crash_at or None)
        return settings
    except ValidationError as exc:
        for error in exc.errors(include_input=False, include_url=False):
            name = "_".join(str(part) for part in error["loc"]).upper()
            message = error["msg"].removeprefix("Value error, ")
            console.print(f"invalid setting {name}: {message}", style="red", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as exc:
        console.print(f"invalid setting PAYMENTS_CRASH_AT: {exc}", style="red", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(2) from None


def migrate_database(url: str) -> None:
    """Bring the schema to the newest Alembic revision."""
    from alembic import command
    from alembic.config import Config

    config = Config(str(Path(__file__).resolve().parent.parent / "alembic.ini"))
    config.attributes["database_url"] = url
    command.upgrade(config, "head")


def create_client(url: str, name: str, api_key: str | None = None) -> tuple[int, str]:
    from app import clients
    from app.config import asyncpg_url
    from app.db.transaction import atomic
    from sqlalchemy.ext.asyncio import create_async_engine

    api_key = api_key or clients.new_api_key()

    async def go() -> int:
        engine = create_async_engine(asyncpg_url(url), hide_parameters=True)
        try:
            return await atomic(engine, clients.create, name, api_key)
        finally:
            await engine.dispose()

    return asyncio.run(go()), api_key


@cli.command()
def api(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    workers: int = typer.Option(1, help="Worker processes (uvicorn)."),
) -> None:
    """Serve the payment API (settings from the environment; see README)."""
    _serve("app.main:create_app", host, port, workers)


# Server-level bounds on what a client can make a process hold (README.md#bounds-on-input):
# idle kept-alive connections are closed after TIMEOUT_KEEP_ALIVE seconds; past
# LIMIT_CONCURRENCY open connections (or requests in progress) a process answers
# 503 instead of taking more. The request head is bounded in size and time by
# app/api/http_protocol.py (httptools itself bounds neither; uvicorn's
# h11_max_incomplete_event_size would bound the size only under --http h11,
# which costs more CPU per request and is not used), the body by
# app/api/body_limit.py.
TIMEOUT_KEEP_ALIVE = 5
LIMIT_CONCURRENCY = 1000


def _serve(factory: str, host: str, port: int, workers: int, *, metered: bool = True) -> None:
    from app.observability import logs, multiproc

    _database_url()
    settings = _settings()  # refuse to start here, with a clear message, not in each worker
    # Before uvicorn (or anything) imports prometheus_client: every worker
    # process writes its metrics to files in this directory, and /metrics
    # adds them up (app/observability/multiproc.py).
    made_dir = None
    if metered and settings.metrics_enabled:
        path, made = multiproc.prepare()
        made_dir = path if made else None
    import uvicorn

    # Each worker process calls the factory, so each builds its own engine
    # and HTTP client after the fork: nothing pooled is shared across processes.
    # On SIGTERM uvicorn stops accepting and gives requests in flight this long
    # to finish; then it cancels them, and the app releases their leases
    # before it exits (app/api/in_flight.py).
    try:
        uvicorn.run(
            factory, factory=True, host=host, port=port, workers=workers, log_level="warning", access_log=False,
            timeout_graceful_shutdown=settings.shutdown_grace_seconds,
            # An import string, so each worker process imports it itself.
            http="app.api.http_protocol:BoundedHttpToolsProtocol",
            timeout_keep_alive=TIMEOUT_KEEP_ALIVE,
            limit_concurrency=LIMIT_CONCURRENCY,
            # Applied by uvicorn in every worker process: LOG_FORMAT, LOG_LEVEL.
            log_config=logs.dict_config(settings.log_format, settings.log_level),
        )
    finally:
        if made_dir is not None:
            multiproc.remove(made_dir)


@cli.command()
def worker() -> None:
    """Run the background worker: crash recovery, and reconciliation once per day."""
    # One process: its metrics live in memory and are served on a port of
    # its own (WORKER_METRICS_PORT), never in an API's directory of files.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from app.observability import logs
    from app.workers import process

    _database_url()
    settings = _settings()
    logs.configure(settings.log_format, settings.log_level)
    if not process.main(settings):
        raise typer.Exit(2)


@cli.command()
def reconcile(
    day: str = typer.Option(None, "--date", help="The statement day (YYYY-MM-DD, UTC); default yesterday."),
) -> None:
    """Settle indeterminate payouts against the rail's statement for one day, once."""
    from datetime import date

    from app.observability import logs
    from app.services import open_services
    from app.workers import reconciliation

    _database_url()
    settings = _settings()
    logs.configure(settings.log_format, settings.log_level)
    try:
        window = date.fromisoformat(day) if day else reconciliation.yesterday()
    except ValueError:
        console.print(f"[red]--date must be YYYY-MM-DD, not {day!r}[/]")
        raise typer.Exit(2) from None

    async def go() -> dict | None:
        async with open_services(settings) as services:
            return await reconciliation.run_window(services, window)

    try:
        counts = asyncio.run(go())
    except reconciliation.StatementUnavailable as exc:
        console.print(f"[red]the rail's statement is unavailable ({exc}); the window stays open, try again[/]")
        raise typer.Exit(1) from None
    if counts is None:
        console.print(f"window {window} is already reconciled, or a run for it is in progress (see scheduled_run)")
        return
    console.print(f"reconciled {window}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))


@cli.command()
def breaks() -> None:
    """List reconciliation breaks: what could not be settled safely, for a person to look at."""
    from app.config import asyncpg_url
    from app.db.transaction import read
    from app.workers import reconciliation
    from sqlalchemy.ext.asyncio import create_async_engine

    async def go() -> list[dict]:
        engine = create_async_engine(asyncpg_url(_database_url()), hide_parameters=True)
        try:
            return await read(engine, reconciliation.list_breaks)
        finally:
            await engine.dispose()

    rows = asyncio.run(go())
    if not rows:
        console.print("no breaks")
        return
    # One block per break rather than a table: the end-to-end reference and
    # the details must stay whole and greppable at any terminal width.
    for r in rows:
        console.print(
            f"[bold]{r['kind']}[/]  {r['end_to_end_reference']}  payment {r['payment_id'] or '(none of ours)'}"
            f"  window {r['window_start']}  detected {r['detected_at']:%Y-%m-%d %H:%M:%S}",
            soft_wrap=True,
        )
        console.print(f"    {r['details']}", soft_wrap=True, markup=False, highlight=False)


@cli.command("crash-points")
def crash_points_command(
    explain: bool = typer.Option(False, "--explain", help="Say what is durable at each point."),
) -> None:
    """List the named crash points, one per line (for PAYMENTS_CRASH_AT)."""
    from app.payments.crash_points import POINTS

    for point, meaning in POINTS.items():
        print(f"{point:26} {meaning}" if explain else point)


@cli.command("naive-api")
def naive_api(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8010, help="Port to listen on."),
    workers: int = typer.Option(1, help="Worker processes (uvicorn)."),
) -> None:
    """Serve THE NAIVE TWIN: the same flow with no protection. For benchmarks and demos only."""
    _serve("naive_twin.app:create_app", host, port, workers, metered=False)


@cli.command()
def migrate() -> None:
    """Apply database migrations (Alembic) to DATABASE_URL."""
    from sqlalchemy.exc import DBAPIError

    from app.config import redacted_url

    url = _database_url()
    try:
        migrate_database(url)
    except (OSError, DBAPIError) as exc:
        # The database is unreachable or refused us: say which one, without
        # its password, and why, without a page of traceback.
        console.print(f"cannot migrate {redacted_url(url)}: {exc}", style="red", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(1) from None
    console.print("schema is at the newest revision")


@clients_cli.command("create")
def clients_create(name: str) -> None:
    """Create a client and print its API key (shown once, stored hashed)."""
    client_id, api_key = create_client(_database_url(), name)
    console.print(f"client {client_id} ({name}) API key: [bold]{api_key}[/]")
    console.print("It is stored only as a hash: keep it now.")


@cli.command()
def run(
    api_port: int = typer.Option(8000, envvar="API_PORT"),
    psp_port: int = typer.Option(8101, envvar="PSP_PORT"),
    rail_port: int = typer.Option(8102, envvar="RAIL_PORT"),
) -> None:
    """Start everything: database, migrations, fake PSP, fake rail, API, worker. Ctrl-C stops it all."""
    # Development tooling (devtools/run.py), not the service: imported here
    # only, so nothing else the service runs depends on it.
    from devtools.run import run as run_system

    run_system(console, api_port, psp_port, rail_port)


def main() -> None:
    cli()
