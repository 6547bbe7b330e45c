"""The `payments` command: the service's processes (API, worker) and its operators' commands.

The command-line surface only: each command reads its options and the
settings from the environment, refuses a bad one with a clear message, calls
the service (the admin operations are in app/admin.py) and prints the
answer. Each imports what it needs inside itself, so a command starts
without loading the others' dependencies. Starting the whole system for
development (`make run`) is not a command of the service: it is devtools/run.py.
"""

from __future__ import annotations

import asyncio
import functools
import os
import sys
from collections.abc import Callable
from typing import TypeVar

import typer
import typer.rich_utils
from rich.console import Console
from typer.core import TyperOption

# Help and output read through a pipe (a log, `less`, a test) are not cut at
# rich's default of 80 columns: without a terminal, and unless COLUMNS or
# TERMINAL_WIDTH says otherwise, lines are this wide.
PIPE_WIDTH = 120
_piped = not sys.stdout.isatty() and not (os.environ.get("COLUMNS") or os.environ.get("TERMINAL_WIDTH"))
if _piped:
    typer.rich_utils.MAX_WIDTH = PIPE_WIDTH
_type_of = TyperOption.display_type_rich


def _flags_show_no_type(self: TyperOption, ctx) -> str | None:
    # A flag takes no value: typer would show `--help <bool>` beside each one.
    return None if self.is_flag else _type_of(self, ctx)


TyperOption.display_type_rich = _flags_show_no_type  # type: ignore[method-assign]

cli = typer.Typer(help="Exactly-once payments service.", no_args_is_help=True, add_completion=False)
clients_cli = typer.Typer(help="Manage API clients.", no_args_is_help=True)
cli.add_typer(clients_cli, name="clients")
keys_cli = typer.Typer(help="Operate the idempotency key table.", no_args_is_help=True)
cli.add_typer(keys_cli, name="keys")
events_cli = typer.Typer(help="Events and their webhook deliveries (docs/outbox-inbox.md).", no_args_is_help=True)
cli.add_typer(events_cli, name="events")
batches_cli = typer.Typer(help="Payment batches: files of rows paid over the broker (docs/batches.md).",
                          no_args_is_help=True)
cli.add_typer(batches_cli, name="batches")
console = Console(width=PIPE_WIDTH if _piped else None)
# Refusals and errors: one line each, on stderr, so a script that reads a
# command's answer on stdout never mistakes one for it.
errors = Console(stderr=True, width=PIPE_WIDTH if _piped else None)
F = TypeVar("F", bound=Callable[..., None])


def _refuse(line: str, code: int = 2) -> typer.Exit:
    errors.print(line, style="red", soft_wrap=True, markup=False, highlight=False)
    return typer.Exit(code)


def _database_url() -> str:
    from app.config import asyncpg_url

    url = os.environ.get("DATABASE_URL")
    if not url:
        raise _refuse("DATABASE_URL is not set. Use `make run`, or point it at a PostgreSQL server.")
    try:
        asyncpg_url(url)
    except ValueError as exc:  # the message never repeats the URL (it holds a password)
        raise _refuse(f"DATABASE_URL is {exc}") from None
    return url


def _uses_database(command: F) -> F:
    """A command that works on DATABASE_URL: a database it cannot use stops it with one line (exit 2), not a traceback.

    The line names the URL without its password, and says what to do where
    there is something to do (`payments migrate` on an unmigrated one).
    Any other error keeps its traceback: it is a bug to report.
    """

    @functools.wraps(command)
    def checked(*args, **kwargs) -> None:
        from app.db.errors import database_problem

        try:
            command(*args, **kwargs)
        except Exception as exc:
            line = database_problem(exc, os.environ.get("DATABASE_URL", ""))
            if line is None:
                raise
            raise _refuse(line) from None

    return checked  # type: ignore[return-value]


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
            # A check across settings has no one name; its message names them.
            line = f"invalid setting {name}: {message}" if name else f"invalid settings: {message}"
            errors.print(line, style="red", soft_wrap=True, markup=False, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as exc:
        raise _refuse(f"invalid setting PAYMENTS_CRASH_AT: {exc}") from None


def _secrets_key(settings) -> str:
    """WEBHOOK_SECRETS_KEY, or a clear refusal (exit 2): webhook secrets are sealed with it."""
    if settings.webhook_secrets_key is None:
        raise _refuse("WEBHOOK_SECRETS_KEY is not set: webhook signing secrets are sealed with it "
                      "(generate one: openssl rand -base64 32 | tr '+/' '-_')")
    return settings.webhook_secrets_key.get_secret_value()


@cli.command()
def api(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    workers: int = typer.Option(1, help="Worker processes (uvicorn), sharing the connections evenly (on Linux)."),
) -> None:
    """Serve the payment API (settings from the environment; see README)."""
    serve("app.main:create_app", host, port, workers)


# Server-level bounds on what a client can make a process hold (README.md#bounds-on-input):
# idle kept-alive connections are closed after TIMEOUT_KEEP_ALIVE seconds; past
# LIMIT_CONCURRENCY open connections (or requests in progress; a setting) a
# process answers 503 instead of taking more. uvicorn has these two; what it
# has not, app/api/http_protocol.py adds: the head bounded in size and time
# (httptools bounds neither; uvicorn's h11_max_incomplete_event_size would
# bound the size only under --http h11, which costs more CPU per request and
# is not used), the body in time (BODY_TIMEOUT_SECONDS), the connections of
# one peer (MAX_CONNECTIONS_PER_PEER). The body's size: app/api/body_limit.py.
TIMEOUT_KEEP_ALIVE = 5

# uvicorn's factory in every process `serve` starts (app/fastpath/frozen_start.py).
FROZEN_START = "app.fastpath.frozen_start:build"


def serve(factory: str, host: str, port: int, workers: int, *, metered: bool = True) -> None:
    """Serve the app that `factory` ("module:function") builds, with the settings and bounds of `payments api`.

    Refuses to start (exit 2) on a missing DATABASE_URL, a bad setting or a
    taken API_METRICS_PORT. `metered`: count in every worker process (the
    multiprocess directory is prepared here) and serve /metrics, from this
    process, on API_METRICS_HOST:API_METRICS_PORT, never on the public port.
    The naive twin (naive_twin/cli.py) is
    served through this too, so the bench compares the two flows and not
    two servers.
    """
    from app.observability import logs, multiproc

    _database_url()
    settings = _settings()  # refuse to start here, with a clear message, not in each worker
    # Before uvicorn (or anything) imports prometheus_client: every worker
    # process writes its metrics to files in this directory, and /metrics
    # adds them up (app/observability/multiproc.py).
    made_dir = None
    stop_metrics = None
    if metered and settings.metrics_enabled:
        path, made = multiproc.prepare()
        made_dir = path if made else None
        try:
            stop_metrics = multiproc.serve(settings.api_metrics_host, settings.api_metrics_port)
        except OSError as exc:
            if made_dir is not None:
                multiproc.remove(made_dir)
            raise _refuse(f"cannot serve metrics on API_METRICS_HOST:API_METRICS_PORT "
                          f"({settings.api_metrics_host}:{settings.api_metrics_port}): {exc.strerror or exc}") from None
    import logging

    import uvicorn

    from app.fastpath import frozen_start, reuse_port
    from app.api.http_protocol import Bounds, BoundedHttpToolsProtocol

    # Said before anything can stall, so a person sees at once that it started
    # and where; each worker process then says whether the database answers (app/main.py).
    logs.configure(settings.log_format, settings.log_level)
    logging.getLogger("app.cli").info("serving %s on http://%s:%d with %d worker process(es)", factory, host, port, workers)
    bounds = Bounds(settings.body_timeout_seconds, settings.max_connections_per_peer, tuple(settings.trusted_proxies))
    # uvicorn is handed frozen_start.build, which builds the app of `factory`
    # and then freezes what start-up made out of the garbage collector. uvicorn
    # imports its factory by name in each worker process, so `factory` reaches
    # build through the environment, which the workers inherit.
    os.environ[frozen_start.FACTORY] = factory
    # Each worker process builds the app itself, so each builds its own engine
    # and HTTP client after the fork: nothing pooled is shared across processes.
    # On SIGTERM uvicorn stops accepting and gives requests in flight this long
    # to finish; then it cancels them, and the app releases their leases
    # before it exits (app/api/in_flight.py).
    # N workers, each on a socket of its own, keeping their shares of the
    # connections even (app/fastpath/reuse_port.py); else uvicorn's one socket.
    spread = workers > 1 and reuse_port.available()
    options = dict(
        log_level="warning", access_log=False,
        timeout_graceful_shutdown=settings.shutdown_grace_seconds,
        # Pickled into each worker process (uvicorn spawns them): the
        # class by its import path, the bounds by value.
        http=functools.partial(reuse_port.BalancedHttpToolsProtocol if spread else BoundedHttpToolsProtocol,
                               bounds=bounds),
        timeout_keep_alive=TIMEOUT_KEEP_ALIVE,
        limit_concurrency=settings.limit_concurrency,
        # Whose X-Forwarded-For is believed; the same proxies are not
        # counted as one peer (app/api/http_protocol.py).
        forwarded_allow_ips=settings.trusted_proxies,
        # Applied by uvicorn in every worker process: LOG_FORMAT, LOG_LEVEL.
        log_config=logs.dict_config(settings.log_format, settings.log_level),
    )
    try:
        if spread:
            _serve_port_per_process(FROZEN_START, host, port, workers, options)
        else:
            uvicorn.run(FROZEN_START, factory=True, host=host, port=port, workers=workers, **options)
    finally:
        if stop_metrics is not None:
            stop_metrics()
        if made_dir is not None:
            multiproc.remove(made_dir)


def _serve_port_per_process(factory: str, host: str, port: int, workers: int, options: dict) -> None:
    """uvicorn's supervisor and its N workers, each worker listening on a socket of its own (app/fastpath/reuse_port.py).

    What uvicorn.run does for N workers, but for the socket: the supervisor
    claims the port (refusing a taken one, as uvicorn does, with its exit
    code 3) and hands each worker the port to bind, not a socket to share.
    Signals, restarts and the stop on a worker that cannot start are
    uvicorn's own (uvicorn.supervisors.Multiprocess).
    """
    import logging

    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import Multiprocess

    from app.fastpath import reuse_port

    try:
        port = reuse_port.claim(host, port)
    except OSError as exc:
        logging.getLogger("uvicorn.error").error(exc)
        sys.exit(STARTUP_FAILURE)
    config = uvicorn.Config(factory, factory=True, host=host, port=port, workers=workers, **options)
    Multiprocess(config, sockets=[reuse_port.PortPerProcess(host, port)]).run()  # type: ignore[list-item]


@cli.command()
def worker() -> None:
    """Run the worker's four loops: crash recovery, daily reconciliation, webhooks, key table upkeep.

    Recovery resumes any payment whose owner died; reconciliation settles
    the day's indeterminate payouts against the rail's statement; the
    dispatcher delivers webhooks; the upkeep creates the key table's
    partitions ahead and drops the days past KEY_RETENTION_HOURS.
    """
    # One process: its metrics live in memory and are served on a port of
    # its own (WORKER_METRICS_PORT), never in an API's directory of files.
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from app.observability import logs
    from app.workers import process

    _database_url()
    settings = _settings()
    _secrets_key(settings)  # the dispatcher opens the sealed secrets to sign with
    logs.configure(settings.log_format, settings.log_level)
    if not process.main(settings):
        raise typer.Exit(2)


@cli.command()
@_uses_database
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
        raise _refuse(f"--date must be YYYY-MM-DD, not {day!r}") from None

    async def go() -> dict | None:
        async with open_services(settings) as services:
            return await reconciliation.run_window(services, window)

    try:
        counts = asyncio.run(go())
    except reconciliation.StatementUnavailable as exc:
        raise _refuse(f"the rail's statement is unavailable ({exc}); the window stays open, try again", 1) from None
    if counts is None:
        console.print(f"window {window} is already reconciled, or a run for it is in progress (see scheduled_run)")
        return
    console.print(f"reconciled {window}: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))


@cli.command("settle-refunds")
@_uses_database
def settle_refunds() -> None:
    """Settle parked refunds (still pending at the PSP after the last poll) against its settlement reports, once."""
    from app.observability import logs
    from app.rails.gateways import ReportUnavailable
    from app.services import open_services
    from app.workers import refund_settlement

    _database_url()
    settings = _settings()
    logs.configure(settings.log_format, settings.log_level)

    async def go() -> dict:
        async with open_services(settings) as services:
            return await refund_settlement.settle_parked_refunds(services)

    try:
        counts = asyncio.run(go())
    except ReportUnavailable as exc:
        raise _refuse(f"the PSP's settlement report is unavailable ({exc}); nothing more was settled, try again",
                      code=1) from None
    console.print("refund settlement: " + ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))


@cli.command()
@_uses_database
def breaks() -> None:
    """List reconciliation breaks: what could not be settled safely, for a person to look at."""
    from app.admin import on_database
    from app.db.transaction import read
    from app.workers import reconciliation

    rows = on_database(_database_url(), lambda engine: read(engine, reconciliation.list_breaks))
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


@cli.command()
def migrate() -> None:
    """Apply database migrations (Alembic) to DATABASE_URL."""
    from app.admin import MigrationRefused, migrate_database
    from app.config import redacted_url
    from app.db.errors import database_problem

    url = _database_url()
    key = os.environ.get("WEBHOOK_SECRETS_KEY") or None
    try:
        created = migrate_database(url, key)
    except MigrationRefused as exc:  # it needs something from the operator first (WEBHOOK_SECRETS_KEY)
        raise _refuse(f"cannot migrate {redacted_url(url)}: {exc}") from None
    except Exception as exc:
        # Unreachable, not there, or refused us: say which one, without its
        # password, and why, without a page of traceback (README.md#configuration: exit 2).
        line = database_problem(exc, url)
        if line is None:
            raise
        raise _refuse(f"cannot migrate: {line}") from None
    console.print("schema is at the newest revision")
    if created:
        console.print("key table partitions created: " + ", ".join(created))


@keys_cli.command("reap")
@_uses_database
def keys_reap(
    dry_run: bool = typer.Option(False, "--dry-run", help="Say what would be created, moved and dropped; change nothing."),
) -> None:
    """Create the key table's partitions ahead, and drop the days past KEY_RETENTION_HOURS (live rows moved out first)."""
    from datetime import timedelta

    from app.admin import on_database
    from app.workers import retention

    url = _database_url()
    settings = _settings()
    retention_period = timedelta(hours=settings.key_retention_hours)
    report = on_database(url, lambda engine: retention.reap(engine, retention_period, dry_run=dry_run))
    would = "would " if dry_run else ""
    print(f"retention: {settings.key_retention_hours:g} h")
    for name in report.created:
        print(f"{would}create {name}")
    for plan in report.plans:
        name = plan.partition.name
        moved = plan.live if dry_run else report.moved.get(name, 0)
        if plan.live:
            print(f"{would}move {moved} live rows out of {name} (started, parked, or finished within retention)")
        if plan.held:
            print(f"  {plan.held} of them held by a live owner: {name} is kept for another day")
        if name in report.dropped or (dry_run and not plan.held):
            print(f"{would}drop {name} ({plan.rows - plan.live} finished keys past retention)")
        elif name in report.kept and not plan.held:
            print(f"kept {name}: a live row could not be moved yet")
    if not report.created and not report.plans:
        print("nothing to do: every partition is within retention and the coming days exist")
    if not dry_run:
        print(", ".join(f"{k}={v}" for k, v in report.counts().items()))


@clients_cli.command("create")
@_uses_database
def clients_create(
    name: str,
    webhook_url: str = typer.Option(None, "--webhook-url", help="POST this client's events here (Standard Webhooks)."),
    allow_duplicate_name: bool = typer.Option(
        False, "--allow-duplicate-name", help="Create it even if a client has this name (then address them by id)."),
    events_per_post: int = typer.Option(
        None, "--events-per-post",
        help="At most this many of the client's events in one POST, for an endpoint that reads the list form "
             "(docs/outbox-inbox.md#several-events-in-one-post); 1: one event a POST. Default 1."),
) -> None:
    """Create a client and print its id and API key (shown once, stored hashed), and its webhook secret."""
    from app.admin import NameTaken, create_client, set_webhook
    from app.outbox.egress import EgressPolicy
    from app.outbox.endpoints import InvalidWebhookUrl, checked_url

    url = _database_url()
    if name.isdigit():
        raise _refuse(f"a client's name cannot be digits only ({name!r}): the commands would read it as a client id")
    if events_per_post is not None:
        if webhook_url is None:
            raise _refuse("--events-per-post is a setting of the webhook endpoint: give --webhook-url too")
        _check_events_per_post(events_per_post)
    if webhook_url is not None:
        settings = _settings()
        key, policy = _secrets_key(settings), EgressPolicy.from_settings(settings)
        try:
            checked_url(webhook_url, policy)
        except InvalidWebhookUrl as exc:
            raise _refuse(str(exc)) from None
    try:
        client_id, api_key = create_client(url, name, unique_name=not allow_duplicate_name)
    except NameTaken as exc:
        raise _refuse(f"{exc}; choose another name (or --allow-duplicate-name, then address each by id)") from None
    console.print(f"client {client_id} ({name}) API key: [bold]{api_key}[/]", soft_wrap=True)
    console.print("It is stored only as a hash: keep it now.")
    if webhook_url is not None:
        _, secret = set_webhook(url, client_id, webhook_url, policy=policy, secrets_key=key,
                                events_per_post=events_per_post)
        _print_secret(webhook_url, secret, events_per_post)


def _check_events_per_post(events_per_post: int | None) -> None:
    """A clear refusal (exit 2) of an --events-per-post the endpoint cannot have."""
    from app.outbox.endpoints import MAX_EVENTS_PER_POST

    if events_per_post is not None and not 1 <= events_per_post <= MAX_EVENTS_PER_POST:
        raise _refuse(f"--events-per-post must be 1 to {MAX_EVENTS_PER_POST}, not {events_per_post}")


def _client(client: str) -> int | str:
    """A CLIENT argument: digits only are a client id, anything else a name."""
    return int(client) if client.isdigit() else client


def _refuse_unless_found(client: str, status: str, found) -> None:
    if status == "no-client":
        raise _refuse(f"no client {client}" if client.isdigit() else f"no client named {client!r}", 1)
    if status == "ambiguous":
        raise _refuse(f"{len(found)} clients are named {client!r} (ids {', '.join(map(str, found))}): "
                      "give the id instead of the name")


def _print_secret(webhook_url: str, secret: str | None, events_per_post: int | None = None) -> None:
    console.print(f"webhook endpoint: {webhook_url}", soft_wrap=True, markup=False, highlight=False)
    if events_per_post is not None:
        console.print(f"events per POST: at most {events_per_post} (a retry carries one)")
    if secret is not None:
        console.print(f"webhook signing secret: [bold]{secret}[/]", soft_wrap=True, highlight=False)
        console.print("It is shown once: give it to the endpoint, which verifies every webhook with it.")


@clients_cli.command("set-webhook")
@_uses_database
def clients_set_webhook(
    client: str = typer.Argument(..., metavar="CLIENT", help="The client's id, or a name only one client has."),
    webhook_url: str = typer.Argument(..., metavar="WEBHOOK_URL"),
    rotate_secret: bool = typer.Option(False, "--rotate-secret", help="Generate a new signing secret (shown once)."),
    overlap_hours: float = typer.Option(
        None, "--overlap-hours", min=0,
        help="With --rotate-secret: hours the old secret is still sent beside the new one "
             "(default WEBHOOK_SECRET_OVERLAP_HOURS)."),
    events_per_post: int = typer.Option(
        None, "--events-per-post",
        help="At most this many of the client's events in one POST, for an endpoint that reads the list form "
             "(docs/outbox-inbox.md#several-events-in-one-post); 1: one event a POST. Default: the endpoint's as it is (1 for a new one)."),
) -> None:
    """Set or change the client's webhook URL; pending deliveries go to the new one."""
    from app.admin import set_webhook
    from app.outbox.egress import EgressPolicy
    from app.outbox.endpoints import InvalidWebhookUrl

    _check_events_per_post(events_per_post)
    url = _database_url()
    settings = _settings()
    key = _secrets_key(settings)
    overlap = settings.webhook_secret_overlap_hours if overlap_hours is None else overlap_hours
    try:
        status, secret = set_webhook(url, _client(client), webhook_url, policy=EgressPolicy.from_settings(settings),
                                     secrets_key=key, rotate_secret=rotate_secret, overlap_hours=overlap,
                                     events_per_post=events_per_post)
    except InvalidWebhookUrl as exc:
        raise _refuse(str(exc)) from None
    _refuse_unless_found(client, status, secret)
    _print_secret(webhook_url, secret, events_per_post)
    if secret is None:
        console.print("the signing secret is unchanged")
    elif rotate_secret:
        console.print(f"the old secret is still sent beside it for {overlap:g} h (both signatures), then dropped")


@clients_cli.command("remove-webhook")
@_uses_database
def clients_remove_webhook(
    client: str = typer.Argument(..., metavar="CLIENT", help="The client's id, or a name only one client has."),
) -> None:
    """Remove the client's webhook endpoint; its pending deliveries are cancelled (events stay in GET /v1/events)."""
    from app.admin import remove_webhook

    status, cancelled = remove_webhook(_database_url(), _client(client))
    _refuse_unless_found(client, status, cancelled)
    if cancelled is None:
        console.print(f"client {client!r} has no webhook endpoint", markup=False, highlight=False)
        return
    console.print(f"webhook endpoint removed; {cancelled} pending deliveries cancelled", markup=False, highlight=False)


@clients_cli.command("reseal-webhook-secrets")
@_uses_database
def clients_reseal_webhook_secrets() -> None:
    """Seal every webhook signing secret again under the first key of WEBHOOK_SECRETS_KEY (a key rotation's step)."""
    from cryptography.fernet import InvalidToken

    from app.admin import reseal_webhook_secrets

    url = _database_url()
    key = _secrets_key(_settings())
    try:
        count = reseal_webhook_secrets(url, key)
    except InvalidToken:
        raise _refuse("a webhook secret is sealed with none of the keys in WEBHOOK_SECRETS_KEY: nothing changed "
                      "(keep the old key after the new one until every secret is resealed)") from None
    console.print(f"{count} webhook endpoints resealed under the first key; the others can now be dropped")


@events_cli.command("redeliver")
@_uses_database
def events_redeliver(event_id: str) -> None:
    """Deliver an event's webhook again, with a fresh retry schedule (a dead one, or any finished one)."""
    import uuid

    from app.admin import redeliver_event

    try:
        eid = uuid.UUID(event_id)
    except ValueError:
        raise _refuse(f"not an event id: {event_id!r}") from None
    status, found = redeliver_event(_database_url(), eid)
    if status == "no-event":
        raise _refuse(f"no event {eid}", 1)
    if status == "no-endpoint":
        raise _refuse(f"event {eid}'s client has no webhook endpoint (payments clients set-webhook)", 1)
    if status == "pending":
        console.print(f"event {eid} is already pending delivery (next attempt at {found['next_attempt_at']:%Y-%m-%d %H:%M:%S})")
        return
    console.print(f"event {eid} ({found['type']}) queued for delivery to {found['endpoint_url']}",
                  soft_wrap=True, markup=False, highlight=False)


@events_cli.command("list")
@_uses_database
def events_list(
    state: str = typer.Option(None, "--state", help="pending, delivered, dead or cancelled (default: all)."),
    limit: int = typer.Option(20, "--limit", min=1, max=1000),
) -> None:
    """The newest webhook deliveries, with their state and last error (`--state dead`: those waiting for a person)."""
    from app.admin import on_database
    from app.db.transaction import read
    from app.outbox import delivery

    if state not in (None, "pending", "delivered", "dead", "cancelled"):
        raise _refuse("--state is pending, delivered, dead or cancelled")
    rows = on_database(_database_url(), lambda engine: read(engine, delivery.deliveries, state, limit))
    if not rows:
        console.print("no deliveries" + (f" in state {state}" if state else ""))
        return
    for r in rows:
        last = f"HTTP {r['last_status']}" if r["last_status"] else (r["last_error"] or "-")
        console.print(
            f"{r['event_id']}  {r['type']:22} {r['state']:9} attempts {r['attempts']:<3} last {last}"
            f"  client {r['client']}  updated {r['updated_at']:%Y-%m-%d %H:%M:%S}",
            soft_wrap=True, markup=False, highlight=False,
        )


@events_cli.command("attempts")
@_uses_database
def events_attempts(event_id: str) -> None:
    """Every delivery attempt of one event: when, where, status, latency, error class."""
    import uuid

    from app.admin import on_database
    from app.db.transaction import read
    from app.outbox import delivery

    try:
        eid = uuid.UUID(event_id)
    except ValueError:
        raise _refuse(f"not an event id: {event_id!r}") from None
    rows = on_database(_database_url(), lambda engine: read(engine, delivery.attempts, eid))
    if not rows:
        console.print(f"no delivery attempts of event {eid}")
        return
    for r in rows:
        outcome = r["outcome"] or "no outcome recorded (the dispatcher died mid-flight)"
        latency = f"{r['latency_ms']:.0f} ms" if r["latency_ms"] is not None else "-"
        console.print(
            f"#{r['attempt']:<3} {r['started_at']:%Y-%m-%d %H:%M:%S}  {outcome:9} status {r['status_code'] or '-'}"
            f"  {latency}  {r['error_class'] or ''} {r['error'] or ''}  {r['url'] or ''}",
            soft_wrap=True, markup=False, highlight=False,
        )


@cli.command()
def consume() -> None:
    """Pay batch rows from NATS JetStream (NATS_URL), publish the batch outbox, complete finished batches.

    Acknowledges a row only once its payment is durable; several may run.
    """
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    from app.observability import logs
    from app.workers import batch_consumer

    _database_url()
    settings = _settings()
    logs.configure(settings.log_format, settings.log_level)
    batch_consumer.main(settings)


@batches_cli.command("submit")
@_uses_database
def batches_submit(
    file: str = typer.Argument(..., help="A CSV file (with a header) or JSON lines (.jsonl, .ndjson)."),
    client: int = typer.Option(..., "--client", help="The client id the rows are paid for."),
    reference: str = typer.Option(None, "--reference", help="The batch's reference; default: the file's name without its suffix."),
    key: str = typer.Option(None, "--key", help="The upload's Idempotency-Key; default: derived from the reference and the file's bytes."),
) -> None:
    """Submit a payment batch as POST /v1/payment-batches does; print the batch, or every bad row."""
    import hashlib
    import json
    from pathlib import Path

    from app.machine.engine import Finished
    from app.payments.batches.submission import submit_batch
    from app.problems import ProblemError
    from app.services import open_services

    path = Path(file)
    try:
        body = path.read_bytes()
    except OSError as exc:
        raise _refuse(f"cannot read {file}: {exc.strerror}") from None
    reference = reference or path.stem
    media_type = "text/csv" if path.suffix.lower() == ".csv" else "application/x-ndjson"
    key = key or "batch-" + hashlib.sha256(reference.encode() + b"\x1f" + body).hexdigest()[:40]
    settings = _settings()

    async def go():
        async with open_services(settings) as services:
            return await submit_batch(services, client, key, reference, body, media_type, row=None)

    try:
        reply = asyncio.run(go())
    except ProblemError as problem:
        errors.print(f"{problem.problem.title}: {problem.detail}", markup=False, highlight=False)
        for bad in problem.extensions.get("errors", []):
            errors.print(f"  row {bad['row']}: {bad['field']}: {bad['message']}", markup=False, highlight=False)
        raise typer.Exit(1) from None
    assert isinstance(reply.outcome, Finished)
    batch = json.loads(reply.outcome.body)
    again = " (this upload was accepted before: replayed)" if reply.replayed else ""
    console.print(f"batch {batch['id']} ({batch['reference']}): {batch['rows']} rows accepted{again}; key {key}",
                  soft_wrap=True, markup=False, highlight=False)


@batches_cli.command("show")
@_uses_database
def batches_show(
    batch_id: str,
    client: int = typer.Option(..., "--client", help="The batch's client id."),
) -> None:
    """A batch's rows counted by state, its failed and dead-lettered rows (as GET /v1/payment-batches/{id})."""
    import json
    import uuid

    from app.payments.batches.submission import find_batch
    from app.services import open_services

    try:
        bid = uuid.UUID(batch_id)
    except ValueError:
        raise _refuse(f"not a batch id: {batch_id!r}") from None
    settings = _settings()

    async def go():
        async with open_services(settings) as services:
            return await find_batch(services, client, bid)

    found = asyncio.run(go())
    if found is None:
        raise _refuse(f"no batch {batch_id} of client {client}", 1)
    console.print_json(json.dumps(found.view()))


def main() -> None:
    cli()
