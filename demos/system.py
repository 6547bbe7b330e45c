"""The whole system for a demo: PostgreSQL, a fresh database, the fakes, API processes.

Started the one way the tests, the bench and `make run` start it
(devtools/system.py): the embedded PostgreSQL unless DATABASE_URL names a
server (stopped at the end only if we started it), a database of our own
(`payments_demo`, dropped and re-created on every run, so nobody else's data
is touched), migrations, a client, and real processes on free ports (never
8000/8101/8102, so `make run` can keep running), each with an explicit
environment. Every process started here is stopped by `System.stop`, however
the demo ends.
"""

from __future__ import annotations

import asyncio
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import typer

from devtools import system as devtools_system
from devtools.bodies import payment_body
from devtools.processes import BIN, NotHealthy, free_port
from devtools.processes import Process as Proc

__all__ = ["BIN", "DOOMED_LEASE_SECONDS", "DemoError", "Proc", "System", "free_port", "payment_body", "session"]

DATABASE = "payments_demo"
# The doomed API's lease: short, so a takeover is possible seconds after the crash.
DOOMED_LEASE_SECONDS = "2"


class DemoError(Exception):
    """Something the demo needs did not happen (a process would not start, a wait ran out)."""


class Db:
    """asyncpg on a private event loop, so the (synchronous) demos can read durable facts."""

    def __init__(self, url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.conn: asyncpg.Connection = self.loop.run_until_complete(asyncpg.connect(url))

    def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        return self.loop.run_until_complete(self.conn.fetch(sql, *args))

    def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        return self.loop.run_until_complete(self.conn.fetchrow(sql, *args))

    def fetchval(self, sql: str, *args: Any) -> Any:
        return self.loop.run_until_complete(self.conn.fetchval(sql, *args))

    def execute(self, sql: str, *args: Any) -> None:
        self.loop.run_until_complete(self.conn.execute(sql, *args))

    def close(self) -> None:
        self.loop.run_until_complete(self.conn.close())
        self.loop.close()


class System(devtools_system.System):
    """devtools' System with what the demos add: their database, a client, a `Db`, crash-ready APIs."""

    def __init__(self) -> None:
        # Every API process a demo starts has the operator console on, so a
        # demo can show its payment there (docs/console.md).
        self.operator_token = secrets.token_urlsafe(32)
        super().__init__(Path(tempfile.mkdtemp(prefix="payments-demo-")),
                         settings={"OPERATOR_TOKEN": self.operator_token})
        self.api_key = ""
        self.client_id = 0
        self.db: Db | None = None

    # -- start and stop -------------------------------------------------------------------------------

    def start(self, rail_args: tuple[str, ...] = ()) -> System:
        """Everything but the API; `rail_args` go to fake-rail (e.g. --legacy-accounts, --cutoff)."""
        try:
            self.start_postgres()
            self.create_database(DATABASE)
            self.client_id, self.api_key = self.create_client("demo-merchant")
            self.db = Db(self.database_url)
            self.defer(self.db.close)
            self.start_fakes(rail_args=rail_args)
        except NotHealthy as exc:
            raise DemoError(str(exc)) from None
        return self

    @property
    def database_label(self) -> str:
        server = self.postgres.embedded if self.postgres else None
        where = "DATABASE_URL" if server is None else (
            f"embedded, 127.0.0.1:{server.port}" + ("" if self.postgres.started else ", already running"))
        return f"{DATABASE} ({where}; re-created fresh)"

    def api(self, *, crash_at: str | None = None, port: int | None = None, name: str = "api",
            env: dict[str, str] | None = None) -> Proc:
        """An API process; with `crash_at` it dies there (and holds only a short lease).

        `env`: extra settings for it (e.g. RAIL_LEGACY_ACCOUNTS, RAIL_TIMEOUT_SECONDS).
        """
        extra = {"PAYMENTS_CRASH_AT": crash_at, "LEASE_SECONDS": DOOMED_LEASE_SECONDS} if crash_at else {}
        return self._up(lambda: self.start_api(name, port=port, **{**(env or {}), **extra}))

    def naive_api(self, *, name: str = "naive", env: dict[str, str] | None = None) -> Proc:
        """THE NAIVE TWIN (naive_twin/), the unsafe counter-example, as a process."""
        return self._up(lambda: self.start_api(name, command="naive-twin", **(env or {})))

    def redis_twin_api(self, *, name: str = "redis-twin", env: dict[str, str] | None = None) -> Proc:
        """THE REDIS TWIN (redis_twin/), the second unsafe counter-example, as a process; `env` names its REDIS_URL."""
        return self._up(lambda: self.start_api(name, command="redis-twin", **(env or {})))

    def worker(self) -> Proc:
        return self._up(lambda: self.start_worker("worker", WORKER_MIN_AGE_SECONDS="0", WORKER_POLL_SECONDS="0.2"))

    @staticmethod
    def _up(start) -> Proc:
        try:
            return start()
        except NotHealthy as exc:
            raise DemoError(str(exc)) from None

    # -- state ----------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Empty every table but `client`, and both fault plans: the next story starts clean."""
        # CASCADE: whatever else refers to payments (in this demo database only) goes too.
        self.db.execute("TRUNCATE ledger_entry, idempotency_key, payment, "
                        "fake_psp.charge, fake_psp.refund, fake_rail.transfer CASCADE")
        for service in (self.psp, self.rail):
            httpx.delete(service.url + "/_admin/faults", timeout=5).raise_for_status()

    def reject_payouts(self, reference: str) -> None:
        """The rail's `reject` fault for this reference: the way to reach EXT3 (the refund)."""
        fault = {"action": "reject", "reference": reference, "times": None}
        httpx.put(self.rail.url + "/_admin/faults", json={"faults": [fault]}, timeout=5).raise_for_status()


@contextmanager
def session(console: Any, system: System, rail_args: tuple[str, ...] = ()) -> Iterator[System]:
    """Start the system, run a demo in it, and always stop every process it started.

    An expected failure (DemoError) or Ctrl-C ends the demo with a sentence
    and an exit code, never a stack trace.
    """
    try:
        with console.status("starting PostgreSQL, the payments_demo database, the fake PSP and the fake rail"):
            system.start(rail_args=rail_args)
        yield system
    except DemoError as exc:
        console.print(f"[red]the demo could not go on:[/] {exc}")
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        console.print("\ninterrupted")
        raise typer.Exit(130) from None
    finally:
        with console.status("stopping every process this demo started"):
            system.stop()
        console.print(f"[dim]process logs: {system.logs}[/]")


@dataclass
class Checks:
    """What a demo checked, row by row: what, expected, actual, and whether they agree."""

    rows: list[tuple[str, str, str, bool]] = field(default_factory=list)

    def check(self, what: str, expected: object, actual: object, ok: bool | None = None) -> bool:
        ok = expected == actual if ok is None else ok
        self.rows.append((what, str(expected), str(actual), ok))
        return ok

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(ok for *_, ok in self.rows)

    def table(self, title: str, since: int = 0) -> Any:
        from rich.table import Table

        table = Table(title=title, title_justify="left")
        for column in ("check", "expected", "actual", ""):
            table.add_column(column, overflow="fold")
        for what, expected, actual, ok in self.rows[since:]:
            table.add_row(what, expected, actual, "[green]ok[/]" if ok else "[red]FAIL[/]")
        return table


class CheckedDemo:
    """A demo `run_demo` drives: made once the system is up, with an HTTP client and checks of its own.

    `run` tells the story and records what it checks; `run_demo` closes the
    client and gives the verdict from the checks.
    """

    def __init__(self, system: System) -> None:
        self.system = system
        self.db = system.db
        self.http = httpx.Client(timeout=30)
        self.checks = Checks()

    def run(self) -> None:
        raise NotImplementedError


def wait_for(what: str, condition: Callable[[], Any], timeout: float = 30.0) -> None:
    """Poll `condition` (durable state) until it holds; DemoError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise DemoError(f"timed out waiting for {what}")
        time.sleep(0.1)  # polling durable state, bounded by the deadline


def run_demo(
    console: Any, system: System, make_demo: Callable[[System], CheckedDemo], *, name: str, starting: str, passed: str,
    start_args: tuple[str, ...] = (),
) -> None:
    """Start `system`, run `make_demo(system)`, always stop every process, then print PASS or FAIL (exit 1).

    The frame the demos with checks share (webhooks, returns, reconciliation,
    the refund race): whatever happens in the demo (a check failing, a peer
    not answering, Ctrl-C), nothing it started outlives it, and the verdict
    comes from its checks alone. `make_demo` builds the demo once the system
    is up: its class, or anything that calls it with more arguments.
    """
    from rich.panel import Panel

    demo = None
    error: str | None = None
    try:
        with console.status(starting):
            system.start(rail_args=start_args)
        demo = make_demo(system)
        demo.run()
    except (DemoError, httpx.HTTPError, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"
        console.print(Panel(error, title="the demo could not go on", border_style="red"))
    except KeyboardInterrupt:
        console.print("\ninterrupted")
        raise typer.Exit(130) from None
    finally:
        with console.status("stopping every process this demo started"):
            if demo is not None:
                demo.http.close()
            system.stop()
    console.print(f"[dim]process logs: {system.logs}[/]")
    if error is None and demo is not None and demo.checks.passed:
        console.print(f"[bold green]PASS[/] {name}: {len(demo.checks.rows)} checks; {passed}")
        return
    failed = [row for row in demo.checks.rows if not row[3]] if demo is not None else []
    for what, expected, actual, _ in failed:
        console.print(f"[red]FAIL[/] {what}: expected {expected}, got {actual}")
    why = error or (f"{len(failed)} check(s) failed" if failed else "no checks were made")
    console.print(f"[bold red]FAIL[/] {name}: {why}")
    raise typer.Exit(1)
