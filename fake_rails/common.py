"""What the fake PSP and the fake rail share: storage, idempotency, faults, errors.

Both fakes behave like the real systems they stand in for in the ways that
matter to a caller trying to move money exactly once:

* every POST carries an `Idempotency-Key`; the first request with a key is
  recorded together with the answer it got, and every later request with that
  key gets the same answer back (`Idempotent-Replayed: true`), or a 422 if its
  body differs (the rail's legacy mode is the deliberate exception: it
  ignores keys, as real legacy rails do);
* records live in PostgreSQL, so a restarted fake still knows every key;
* a fault plan, set over HTTP, makes the next matching calls fail the way real
  networks and providers fail (see docs/reference/fake-rails.md);
* every request to a business endpoint (`/v1/...`) is logged, in PostgreSQL
  too, so a test can assert what a caller asked and in which order ("probed,
  then sent nothing"): `GET /_admin/requests`.

Errors are RFC 9457 `application/problem+json` documents.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any, Literal, get_args

import asyncpg
import typer
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

PROBLEM_BASE = "https://fake-rails.example/problems/"


# --- Errors -------------------------------------------------------------------


class Problem(Exception):
    """An error answer; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        slug: str,
        title: str,
        detail: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(detail)
        self.status, self.slug, self.title, self.detail = status, slug, title, detail
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {
            "type": PROBLEM_BASE + self.slug,
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        return JSONResponse(
            body,
            status_code=self.status,
            headers=self.headers,
            media_type="application/problem+json",
        )


def install_problem_handlers(app: FastAPI) -> None:
    """Make every error, including FastAPI's own, a problem+json document."""

    async def on_problem(_: Request, exc: Problem) -> JSONResponse:
        return exc.response()

    # Real providers answer 400 to a malformed request; FastAPI's default is 422,
    # which we keep for its idempotency meaning (same key, different body).
    async def on_invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        return Problem(400, "invalid-request", "Invalid request", detail).response()

    async def on_http(_: Request, exc: HTTPException) -> JSONResponse:
        slug = "not-found" if exc.status_code == 404 else "http-error"
        return Problem(exc.status_code, slug, str(exc.detail), str(exc.detail)).response()

    app.add_exception_handler(Problem, on_problem)
    app.add_exception_handler(RequestValidationError, on_invalid)
    app.add_exception_handler(HTTPException, on_http)


def not_found(what: str) -> Problem:
    return Problem(404, "not-found", "Not found", f"no {what}")


# --- Storage ------------------------------------------------------------------


def asyncpg_dsn(url: str) -> str:
    """asyncpg wants the driver-free spelling of a SQLAlchemy-style URL."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


async def _init_connection(conn: asyncpg.Connection) -> None:
    # Hand stored responses to Python as dicts, not strings.
    await conn.set_type_codec("json", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")


def pool_lifespan(
    database_url: str, schema: str, ddl: str,
    background: Callable[[FastAPI], Awaitable[None]] | None = None,
):
    """An app lifespan that opens a pool and creates `schema` if it is missing.

    `background(app)`, if given, runs as a task while the app serves (the
    rail's notifier), cancelled when it stops.

    The DDL runs under a transaction-scoped advisory lock: two fakes starting
    at once against a fresh database would otherwise both try to create the
    schema and one would fail on a duplicate key in the catalog.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        pool = await asyncpg.create_pool(
            asyncpg_dsn(database_url),
            min_size=1,
            max_size=10,
            init=_init_connection,
            server_settings={"timezone": "UTC"},
        )
        try:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext($1))", schema)
                await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}; {ddl}")
            app.state.pool = pool
            task = asyncio.create_task(background(app)) if background else None
            try:
                yield
            finally:
                if task is not None:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
        finally:
            await pool.close()

    return lifespan


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def utcnow() -> datetime:
    return datetime.now(UTC)


def iso(ts: datetime) -> str:
    return ts.isoformat().replace("+00:00", "Z")


# Every record table starts with these columns; services add their own.
RECORD_COLUMNS = """
    id text PRIMARY KEY,
    idempotency_key text NOT NULL UNIQUE,
    request_hash text NOT NULL,
    status_code integer NOT NULL,
    response json NOT NULL,  -- json, not jsonb: a replay keeps the key order
    created_at timestamptz NOT NULL
"""


# --- Idempotency --------------------------------------------------------------


def request_hash(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of a request body: key order and spacing
    must not make two equal requests look different."""
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class Outcome:
    status_code: int
    body: dict[str, Any]
    replayed: bool


@dataclass
class Attempt:
    """One POST with its idempotency key, inside a transaction on `conn`.

    A handler calls `replay()` first, which returns the stored answer if the
    key was seen before (skipping business checks that may no longer pass,
    e.g. a refund's remaining balance), and otherwise `record()` the new
    resource. `record()` is what really guarantees one record per key: its
    INSERT ... ON CONFLICT DO NOTHING makes a request that raced past
    `replay()` wait for the first one to commit, insert nothing, and replay
    the first one's answer.

    `key` is None when the service does not honour keys for this request (the
    rail's legacy mode): then nothing is ever replayed, every `record()`
    inserts a new row with a NULL `idempotency_key` (NULLs never conflict),
    and `presented_key` still holds whatever key the caller sent.
    """

    conn: asyncpg.Connection
    table: str
    key: str | None
    request_hash: str
    fault: Fault | None
    presented_key: str | None = None

    async def replay(self) -> Outcome | None:
        if self.key is None:
            return None
        row = await self.conn.fetchrow(
            f"SELECT request_hash, status_code, response FROM {self.table} "
            "WHERE idempotency_key = $1",
            self.key,
        )
        if row is None:
            return None
        if row["request_hash"] != self.request_hash:
            raise Problem(
                422,
                "idempotency-key-reused",
                "Idempotency key reused",
                f"key {self.key!r} was first used with a different request body",
            )
        return Outcome(row["status_code"], row["response"], replayed=True)

    async def record(self, resource: dict[str, Any], **columns: Any) -> Outcome:
        """Store `resource` (its fields are columns too) and answer it with 201."""
        response = {k: _jsonable(v) for k, v in resource.items()}
        values = {k: v for k, v in resource.items() if k != "object"} | columns
        values |= {
            "idempotency_key": self.key,
            "request_hash": self.request_hash,
            "status_code": 201,
            "response": response,
        }
        params = ", ".join(f"${i}" for i in range(1, len(values) + 1))
        row = await self.conn.fetchrow(
            f"INSERT INTO {self.table} ({', '.join(values)}) VALUES ({params}) "
            "ON CONFLICT (idempotency_key) DO NOTHING RETURNING status_code, response",
            *values.values(),
        )
        if row is None:  # another request with this key committed first
            return await self.replay()
        return Outcome(row["status_code"], row["response"], replayed=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, date):
        return value.isoformat()
    return value


# --- Days ---------------------------------------------------------------------


def parse_day(day: str) -> date:
    """A `YYYY-MM-DD` path or body value, else a 400 problem."""
    # fromisoformat alone would also take "20250102" and week dates.
    try:
        if re.fullmatch(r"\d{4}-\d{2}-\d{2}", day):
            return date.fromisoformat(day)
    except ValueError:
        pass
    raise Problem(400, "invalid-date", "Invalid date", f"{day!r} is not a YYYY-MM-DD date")


class CloseDayRequest(BaseModel):
    """`POST /_admin/close-day`: `{"date": "YYYY-MM-DD"}` (or `"day"`)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    day: str = Field(alias="date")


# --- Fault plan ---------------------------------------------------------------

Action = Literal[
    "delay", "error_before", "error_after", "hang_after", "decline", "reject", "rate_limit",
    "duplicate", "pending", "allow_over_refund",
]
# `notification` is the one operation a fake makes rather than answers: the
# rail's notifier POSTing a return to the payment service. There `delay`
# holds a delivery back for `seconds` (so later notifications overtake it:
# out of order), and `duplicate` delivers it once more after a 2xx, per use.
Operation = Literal["charge", "refund", "transfer", "webhook", "notification"]

# A business outcome only exists for one operation.
ONLY_FOR: dict[str, str] = {
    "decline": "charge", "reject": "transfer", "duplicate": "notification",
    "pending": "refund", "allow_over_refund": "refund",
}
# Taken apart from the one fault a request meets (see FaultPlan.take): a
# switch on a business check, which must not use up, or be hidden by, the
# transport or business fault of the same request.
SEPARATE_ACTIONS = frozenset({"allow_over_refund"})
REQUEST_ACTIONS = frozenset(get_args(Action)) - SEPARATE_ACTIONS
DEFAULT_SECONDS = {"delay": 2.0, "hang_after": 3600.0, "pending": 2.0}
DEFAULT_STATUS = {"error_before": 503, "error_after": 500}


class Fault(BaseModel):
    model_config = ConfigDict(extra="forbid")

    action: Action
    operation: Operation | None = None
    reference: str | None = None
    # Counts down as the fault is used; 0 means spent. null means forever.
    times: int | None = Field(default=1, ge=1)
    seconds: float | None = Field(default=None, ge=0)
    status: int | None = Field(default=None, ge=400, le=599)
    # `pending` only: the final status the refund settles to, `seconds` later.
    settles_as: Literal["succeeded", "failed"] | None = None

    @model_validator(mode="after")
    def _defaults(self) -> Fault:
        only = ONLY_FOR.get(self.action)
        if only and self.operation not in (None, only):
            raise ValueError(f"{self.action} applies to {only} only")
        if self.action == "pending":
            self.settles_as = self.settles_as or "succeeded"
        elif self.settles_as is not None:
            raise ValueError("settles_as applies to pending only")
        if self.seconds is None:
            self.seconds = DEFAULT_SECONDS.get(self.action)
        if self.status is None:
            self.status = DEFAULT_STATUS.get(self.action)
        return self

    def matches(self, operation: str, reference: str) -> bool:
        return (
            self.times != 0
            and self.operation in (None, operation)
            and ONLY_FOR.get(self.action, operation) == operation
            and self.reference in (None, reference)
        )


class FaultPlanBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    faults: list[Fault]


class FaultPlan:
    """The faults to inject, held in this process's memory only: a restart or
    a second instance starts with an empty plan."""

    def __init__(self, operations: Iterable[str]) -> None:
        self.operations = set(operations)
        self.faults: list[Fault] = []
        # Concurrent requests must not both use the last `times` of a fault.
        self._lock = asyncio.Lock()

    def replace(self, faults: list[Fault]) -> None:
        for f in faults:
            wanted = f.operation or ONLY_FOR.get(f.action)
            if wanted and wanted not in self.operations:
                raise Problem(
                    400,
                    "invalid-fault",
                    "Invalid fault",
                    f"{f.action} on {wanted}: this service only does {sorted(self.operations)}",
                )
        self.faults = faults

    async def take(self, operation: str, reference: str, actions: Collection[str] | None = None) -> Fault | None:
        """Consume one use of the first matching fault (of one of `actions`, if given) and return it."""
        async with self._lock:
            for f in self.faults:
                if f.matches(operation, reference) and (actions is None or f.action in actions):
                    if f.times is not None:
                        f.times -= 1
                    return f
        return None

    def router(self) -> APIRouter:
        router = APIRouter(prefix="/_admin/faults", tags=["admin"])

        def show() -> dict[str, Any]:
            return {"faults": [f.model_dump() for f in self.faults]}

        @router.get("")
        async def get_faults() -> dict[str, Any]:
            return show()

        @router.put("")
        async def put_faults(body: FaultPlanBody) -> dict[str, Any]:
            self.replace(body.faults)
            return show()

        @router.delete("")
        async def delete_faults() -> dict[str, Any]:
            self.faults = []
            return show()

        return router


async def idempotent_post(
    request: Request,
    operation: str,
    table: str,
    body: BaseModel,
    handle: Callable[[Attempt], Awaitable[Outcome]],
    *,
    honour_key: bool = True,
) -> JSONResponse:
    """The shape of every POST: key check, fault, `handle`, fault, answer.

    `handle` runs in one transaction and applies the business faults
    (decline, reject, pending) itself; the transport faults are applied here.
    The separate actions (allow_over_refund) are not taken here: a handler
    takes them itself, so they coexist with this request's one fault.

    With `honour_key=False` (a legacy rail) the `Idempotency-Key` is optional
    and ignored: `handle` gets an Attempt whose `key` is None and whose
    `presented_key` is the header, if any, so every request creates a record.
    """
    presented = request.headers.get("Idempotency-Key")
    key = presented if honour_key else None
    if honour_key and not key:
        raise Problem(
            400, "idempotency-key-missing", "Idempotency-Key required",
            "every POST needs an Idempotency-Key header",
        )

    plan: FaultPlan = request.app.state.faults
    # One fault per request; the separate ones are the handler's to take.
    fault = await plan.take(operation, getattr(body, "reference", None), actions=REQUEST_ACTIONS)
    action = fault.action if fault else None
    if action == "delay":
        await asyncio.sleep(fault.seconds)
    elif action == "error_before":
        raise Problem(fault.status, "injected-error", "Injected error", "fault plan: error_before")
    elif action == "rate_limit":
        raise Problem(
            429, "rate-limited", "Too many requests", "fault plan: rate_limit",
            headers={"Retry-After": "1"},
        )

    # Hashing the validated body makes an omitted optional field equal to null.
    req_hash = request_hash(body.model_dump(mode="json"))
    async with request.app.state.pool.acquire() as conn, conn.transaction():
        attempt = Attempt(conn, table, key, req_hash, fault, presented_key=presented)
        outcome = await handle(attempt)

    # Committed by now: what follows loses or delays the answer, not the record.
    if not outcome.replayed and action == "error_after":
        raise Problem(fault.status, "injected-error", "Injected error", "fault plan: error_after")
    if not outcome.replayed and action == "hang_after":
        await asyncio.sleep(fault.seconds)
    headers = {"Idempotent-Replayed": "true"} if outcome.replayed else None
    return JSONResponse(outcome.body, status_code=outcome.status_code, headers=headers)


# --- Request log --------------------------------------------------------------

# One row per request to a business endpoint, written as it arrives (before
# any fault delays or refuses it), so the log shows what a caller asked, in
# order, whatever it was answered. `seq` orders it; `at` is the database's
# clock_timestamp(). Created with the service's own tables, in its schema.
REQUEST_LOG_DDL = """
CREATE TABLE IF NOT EXISTS {schema}.request (
    seq bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT clock_timestamp(),
    method text NOT NULL,
    path text NOT NULL,
    query text,
    -- The key the request names: its Idempotency-Key header (a POST), or the
    -- idempotency_key parameter it looks up (a PSP probe).
    idempotency_key text,
    reference text,
    end_to_end_reference text
);
CREATE INDEX IF NOT EXISTS request_reference_idx ON {schema}.request (reference);
CREATE INDEX IF NOT EXISTS request_idempotency_key_idx ON {schema}.request (idempotency_key);
CREATE INDEX IF NOT EXISTS request_end_to_end_reference_idx ON {schema}.request (end_to_end_reference);
"""

BUSINESS_PREFIX = "/v1/"


def request_logger(schema: str) -> Callable[[Request], Awaitable[None]]:
    """An app-wide dependency: one INSERT per request to a business endpoint.

    It runs before the handler (and before a fault plan's delay or error), in
    a statement of its own, so nothing the handler does, commits or rolls back
    changes the log, and the log changes no answer. The reference and the
    end-to-end reference are read from a JSON body's fields of those names,
    or from the path (`/v1/transfers/{end_to_end_reference}`).
    """
    insert = (
        f"INSERT INTO {schema}.request "
        "(method, path, query, idempotency_key, reference, end_to_end_reference) "
        "VALUES ($1, $2, $3, $4, $5, $6)"
    )

    async def log_request(request: Request) -> None:
        path = request.url.path
        if not path.startswith(BUSINESS_PREFIX):
            return
        fields: dict[str, Any] = {}
        if request.method == "POST":
            try:  # FastAPI has read the body already; this is its cached copy
                parsed = json.loads(await request.body())
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fields = parsed
        key = request.headers.get("Idempotency-Key") or request.query_params.get("idempotency_key")
        e2e = fields.get("end_to_end_reference") or request.path_params.get("end_to_end_reference")
        await request.app.state.pool.execute(
            insert,
            request.method,
            path,
            request.url.query or None,
            key,
            _text_or_none(fields.get("reference")),
            _text_or_none(e2e),
        )

    return log_request


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


async def list_requests(
    pool: asyncpg.Pool,
    schema: str,
    reference: str | None,
    idempotency_key: str | None,
    end_to_end_reference: str | None,
) -> dict[str, Any]:
    rows = await pool.fetch(
        f"SELECT seq, at, method, path, query, idempotency_key, reference, end_to_end_reference "
        f"FROM {schema}.request "
        "WHERE ($1::text IS NULL OR reference = $1) "
        "AND ($2::text IS NULL OR idempotency_key = $2) "
        "AND ($3::text IS NULL OR end_to_end_reference = $3) "
        "ORDER BY seq",
        reference, idempotency_key, end_to_end_reference,
    )
    return {"items": [{k: iso(v) if isinstance(v, datetime) else v for k, v in r.items()} for r in rows]}


# --- App and CLI --------------------------------------------------------------


def base_app(
    title: str, database_url: str, schema: str, ddl: str, operations: Iterable[str],
    background: Callable[[FastAPI], Awaitable[None]] | None = None,
) -> FastAPI:
    """An app with what both fakes have: pool, schema, fault plan, errors, health, request log."""
    # No OpenTelemetry here: spare the per-request look for its providers.
    app = FastAPI(
        title=title,
        lifespan=pool_lifespan(database_url, schema, ddl + REQUEST_LOG_DDL.format(schema=schema), background),
        telemetry={"tracing": False, "metrics": False, "logs": False},
        dependencies=[Depends(request_logger(schema))],
    )
    app.state.faults = FaultPlan(operations)
    install_problem_handlers(app)
    app.include_router(app.state.faults.router())

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/_admin/requests", tags=["admin"])
    async def admin_requests(
        reference: str | None = Query(None),
        idempotency_key: str | None = Query(None),
        end_to_end_reference: str | None = Query(None),
    ) -> dict[str, Any]:
        return await list_requests(app.state.pool, schema, reference, idempotency_key, end_to_end_reference)

    return app


async def list_items(pool: asyncpg.Pool, table: str, reference: str | None) -> dict[str, Any]:
    rows = await pool.fetch(
        f"SELECT response FROM {table} WHERE $1::text IS NULL OR reference = $1 "
        "ORDER BY created_at, id",
        reference,
    )
    return {"items": [r["response"] for r in rows]}


def database_url_or_exit(database_url: str | None) -> str:
    """The `--database-url` of a fake, else its environment default; exit 2 if none."""
    url = (
        database_url
        or os.environ.get("FAKE_RAILS_DATABASE_URL")
        or os.environ.get("DATABASE_URL")
    )
    if not url:
        typer.echo(
            "error: no database; pass --database-url or set "
            "FAKE_RAILS_DATABASE_URL or DATABASE_URL",
            err=True,
        )
        raise typer.Exit(2)
    return url


def serve_app(app: FastAPI, host: str, port: int) -> None:
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


DATABASE_URL_HELP = "PostgreSQL URL; default: env FAKE_RAILS_DATABASE_URL, else DATABASE_URL."


def run_cli(create_app: Callable[[str], FastAPI], default_port: int) -> None:
    """`main()` of a fake: serve `create_app(database_url)` with uvicorn."""

    def serve(
        port: int = typer.Option(default_port, help="Port to listen on."),
        host: str = typer.Option("127.0.0.1", help="Interface to bind."),
        database_url: str | None = typer.Option(None, help=DATABASE_URL_HELP),
    ) -> None:
        serve_app(create_app(database_url_or_exit(database_url)), host, port)

    typer.run(serve)
