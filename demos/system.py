"""The whole system for a demo: PostgreSQL, a fresh database, the fakes, API processes.

The same recipe as `payments run` and tests/conftest.py: the embedded
PostgreSQL unless DATABASE_URL names a server (stopped at the end only if we
started it), a database of our own (`payments_demo`, dropped and re-created on
every run, so nobody else's data is touched), migrations, a client, and real
processes on free ports (never 8000/8101/8102, so `make run` can keep running).
Every process started here is stopped by `System.stop`, however the demo ends.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import typer

from app import embedded_db
from app.cli import create_client, migrate_database
from app.config import libpq_url
from app.processes import NotHealthy, free_port, stop_processes, wait_healthy

DATABASE = "payments_demo"
BIN = Path(sys.executable).parent
IBAN = "DE89370400440532013000"
# The doomed API's lease: short, so a takeover is possible seconds after the crash.
DOOMED_LEASE_SECONDS = "2"


class DemoError(Exception):
    """Something the demo needs did not happen (a process would not start, a wait ran out)."""


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    port: int | None = None
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Proc:
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        if self.port is None:
            return self  # the worker has no HTTP face: it is up once spawned
        try:
            wait_healthy(self.name, self.url, self.popen)
        except NotHealthy as exc:
            raise DemoError(f"{exc}: {self.tail(5)}") from None
        return self

    def wait(self, timeout: float = 10) -> int | None:
        try:
            return self.popen.wait(timeout) if self.popen else None
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.popen:
            stop_processes(self.popen)

    def tail(self, lines: int = 3) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except FileNotFoundError:
            return ""


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


@dataclass
class System:
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="payments-demo-")))
    server: embedded_db.EmbeddedServer | None = None
    started_db: bool = False
    database_url: str = ""
    api_key: str = ""
    client_id: int = 0
    db: Db | None = None
    psp: Proc | None = None
    rail: Proc | None = None
    procs: list[Proc] = field(default_factory=list)

    # -- start and stop -------------------------------------------------------------------------------

    def start(self, rail_args: tuple[str, ...] = ()) -> System:
        """Everything but the API; `rail_args` go to fake-rail (e.g. --legacy-accounts, --cutoff)."""
        url = os.environ.get("DATABASE_URL")
        if url:
            maintenance = libpq_url(url).rsplit("/", 1)[0] + "/postgres"
        else:
            self.server = embedded_db.default_server()
            self.started_db = embedded_db.start(self.server)
            maintenance = self.server.url()
        embedded_db.create_database(maintenance, DATABASE, recreate=True)
        self.database_url = maintenance.rsplit("/", 1)[0] + "/" + DATABASE
        migrate_database(self.database_url)
        self.client_id, self.api_key = create_client(self.database_url, "demo-merchant")
        self.db = Db(self.database_url)
        env = {**os.environ, "FAKE_RAILS_DATABASE_URL": self.database_url}
        self.psp = self._spawn("fake-psp", [str(BIN / "fake-psp")], env, free_port())
        self.rail = self._spawn("fake-rail", [str(BIN / "fake-rail"), *rail_args], env, free_port())
        return self

    @property
    def database_label(self) -> str:
        where = "DATABASE_URL" if self.server is None else (
            f"embedded, 127.0.0.1:{self.server.port}" + ("" if self.started_db else ", already running"))
        return f"{DATABASE} ({where}; re-created fresh)"

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if self.db is not None:
            self.db.close()
            self.db = None
        if self.server is not None and self.started_db:
            embedded_db.stop(self.server)

    def __enter__(self) -> System:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, name: str, argv: list[str], env: dict[str, str], port: int | None) -> Proc:
        if port is not None:
            argv = [*argv, "--port", str(port)]
        proc = Proc(name, argv, env, self.logs / f"{name}-{len(self.procs)}.log", port)
        self.procs.append(proc)
        return proc.start()

    def service_env(self, **overrides: str) -> dict[str, str]:
        env = {**os.environ, "DATABASE_URL": self.database_url, "PSP_URL": self.psp.url,
               "RAIL_URL": self.rail.url, **overrides}
        if not overrides.get("PAYMENTS_CRASH_AT"):
            env.pop("PAYMENTS_CRASH_AT", None)
        return env

    def api(self, *, crash_at: str | None = None, port: int | None = None, name: str = "api",
            env: dict[str, str] | None = None) -> Proc:
        """An API process; with `crash_at` it dies there (and holds only a short lease).

        `env`: extra settings for it (e.g. RAIL_LEGACY_ACCOUNTS, RAIL_TIMEOUT_SECONDS).
        """
        extra = {"PAYMENTS_CRASH_AT": crash_at, "LEASE_SECONDS": DOOMED_LEASE_SECONDS} if crash_at else {}
        extra = {**(env or {}), **extra}
        argv = [str(BIN / "payments"), "api"]
        return self._spawn(name, argv, self.service_env(**extra), port or free_port())

    def naive_api(self, *, name: str = "naive", env: dict[str, str] | None = None) -> Proc:
        """THE NAIVE TWIN (naive_twin/), the unsafe counter-example, as a process."""
        return self._spawn(name, [str(BIN / "payments"), "naive-api"], self.service_env(**(env or {})), free_port())

    def worker(self) -> Proc:
        env = self.service_env(WORKER_MIN_AGE_SECONDS="0", WORKER_POLL_SECONDS="0.2")
        return self._spawn("worker", [str(BIN / "payments"), "worker"], env, None)

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


def payment_body(reference: str) -> dict[str, Any]:
    return {"amount": 1250, "currency": "EUR", "reference": reference, "card_token": "tok_visa",
            "beneficiary": {"name": "Ada Lovelace", "iban": IBAN}}
