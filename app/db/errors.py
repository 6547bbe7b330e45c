"""Is this exception the database going away, or a bug in what we asked it?

Where it sits: beside the engine, consulted wherever an exception from the
database ends a unit of work: the API's exception handlers and the replay
shortcut (a 503 `service-unavailable`, never a 500), `/healthz`, and the
worker's loops (back off and carry on, never exit). An outage goes away by
itself and the caller should try again; a bad statement fails the same way
every time and must stay loud. docs/crash-matrix.md#telling-an-outage-from-a-bug
lists the exception types an outage raises, found by experiment. The
`payments` commands and the API's start-up ask `database_problem` why a
database cannot be used at all (down, not there, not migrated), to say so in
one line.
"""

from __future__ import annotations

import traceback
from collections.abc import Iterator
from types import TracebackType

import asyncpg
from sqlalchemy import exc as sa

# Errors the server sends when it will not, or can no longer, serve this
# connection: all mean "try again later", never "your statement is wrong".
_SERVER_GONE = (
    asyncpg.PostgresConnectionError,  # ConnectionDoesNotExistError, ConnectionFailureError, ...
    asyncpg.AdminShutdownError,  # pg_ctl stop -m fast, pg_terminate_backend
    asyncpg.CrashShutdownError,  # another backend crashed; the server is restarting
    asyncpg.CannotConnectNowError,  # "the database system is starting up / shutting down"
    asyncpg.TooManyConnectionsError,  # refused at connect: every slot taken (often just after a restart)
    # 25006: a write reached a read-only node, a standby or a primary being
    # demoted in a failover (docs/failover.md). Nothing was written; the
    # primary is elsewhere now, and the next connection finds it.
    asyncpg.ReadOnlySQLTransactionError,
)


def database_unavailable(exc: BaseException) -> bool:
    """True if `exc` (or what caused it) says the database could not be reached or the connection was lost."""
    return any(_says_unavailable(e) for e in _chain(exc))


def row_moved(exc: BaseException) -> bool:
    """True if a write met a key row that the reaper moved to another partition meanwhile.

    PostgreSQL cannot follow a row across partitions: an UPDATE that waited
    for the row lock of a row being moved fails with a serialization failure
    (40001) instead of updating it in its new place. Nothing was written;
    the same request a moment later finds the row where it now is. Rare: the
    reaper moves only rows that nobody holds a live lease on.
    """
    return any(
        isinstance(e, asyncpg.SerializationError) and "moved to another partition" in str(e) for e in _chain(exc)
    )


def describe(exc: BaseException) -> str:
    """One line for a log: the driver's own error, never SQLAlchemy's text.

    SQLAlchemy's message carries the statement and its parameters (`[SQL: ...]`
    `[parameters: ...]`): customer data has no place in an outage's log lines.
    The innermost error of the chain is the driver's or the socket's, whose
    message names only what failed (and the host and port).
    """
    innermost = list(_chain(exc))[-1]
    message = str(innermost).splitlines()[0][:200] if str(innermost) else ""
    return f"{type(innermost).__name__}: {message}" if message else type(innermost).__name__


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _says_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, sa.DBAPIError) and exc.connection_invalidated:
        return True  # SQLAlchemy's own verdict: the dialect saw a disconnect
    if isinstance(exc, sa.TimeoutError):
        return True  # QueuePool: no connection could be had in time
    if isinstance(exc, _SERVER_GONE):
        return True
    if isinstance(exc, asyncpg.SerializationError) and "conflict with recovery" in str(exc):
        # A standby cancelled a page's read because the WAL it replays removes
        # rows the read could still see (DATABASE_READ_URL): try again later.
        return True
    if isinstance(exc, asyncpg.InternalClientError):
        return "another operation (2) is in progress" in str(exc)  # an unsolicited FATAL (docs/crash-matrix.md#telling-an-outage-from-a-bug)
    if isinstance(exc, asyncpg.InterfaceError):
        # asyncpg's client-side errors are mostly misuse (a bug); only these
        # two say the connection, not the statement, is the problem.
        text = str(exc)
        return "connection is closed" in text or "connection was closed" in text
    if isinstance(exc, OSError):  # ConnectionRefusedError, ConnectionResetError, TimeoutError, ...
        # A socket error is the database's only if the driver raised it while
        # talking to the server: a refused connect to the PSP or a missing
        # file is not an outage of ours.
        return _raised_in_driver(exc.__traceback__)
    return False


def _raised_in_driver(tb: TracebackType | None) -> bool:
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if module == "asyncpg" or module.startswith("asyncpg."):
            return True
        tb = tb.tb_next
    return False


def loggable(exc: BaseException) -> str:
    """The exception's traceback, every chained exception included, without PostgreSQL's DETAILs.

    The statement's parameters are kept out of SQLAlchemy's errors by
    `hide_parameters` (app/db/engine.py), but PostgreSQL itself quotes the
    row in the DETAIL of a constraint violation ("Key (api_key_hash)=(...)
    already exists", "Failing row contains (...)"), and asyncpg appends that
    DETAIL to the error's text, so it would be logged with the traceback.
    Each DETAIL is found on the exception that carries it and cut out of the
    text, whatever it contains. (A value PostgreSQL quotes in the message
    itself, such as `invalid input syntax for type integer: "..."`, is not:
    only our own code passes values of the wrong type, and that is a bug to
    fix where it happens.)
    """
    text = "".join(traceback.format_exception(exc))
    for detail in _details(exc):
        text = text.replace(detail, "(withheld: it may quote the row's values)")
    return text


def _details(exc: BaseException | None, seen: set[int] | None = None) -> set[str]:
    """The `detail` of every exception chained to `exc` (asyncpg's PostgresError has one)."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return set()
    seen.add(id(exc))
    detail = getattr(exc, "detail", None)
    found = {detail} if isinstance(detail, str) and detail else set()
    for linked in (exc.__cause__, exc.__context__, getattr(exc, "orig", None)):
        if isinstance(linked, BaseException):
            found |= _details(linked, seen)
    return found


# PostgreSQL's SQLSTATEs for what a first hour meets: a database that is
# not there, a login refused, a schema that is not (or not wholly) migrated.
_NO_DATABASE = "3D000"
_LOGIN_REFUSED = ("28000", "28P01")
_NOT_MIGRATED = ("42P01", "42703", "42883", "42704")  # undefined table, column, function, type


def database_problem(exc: BaseException, url: str) -> str | None:
    """One line saying why `url`'s database could not be used, naming it without its password; None if `exc` is
    not such a problem (a bug, or an error of something else, which keeps its traceback).

    Looks through the chain of causes, where SQLAlchemy keeps the driver's
    error: a connection that failed (OSError, a timeout), or PostgreSQL's
    refusal by its SQLSTATE.
    """
    from app.config import redacted_url

    where = redacted_url(url)
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        state = getattr(current, "sqlstate", None)
        if state == _NO_DATABASE:
            return f"the database at {where} does not exist: create it, or fix DATABASE_URL"
        if state in _LOGIN_REFUSED:
            return f"the database at {where} refused the login: check DATABASE_URL's user and password"
        if state in _NOT_MIGRATED:
            return f"the database at {where} is not migrated: run `payments migrate`"
        if isinstance(current, OSError):  # refused, unresolvable host, timed out (TimeoutError is an OSError)
            reason = current.strerror or str(current) or type(current).__name__
            return f"cannot reach the database at {where}: {reason}"
        current = current.__cause__ or getattr(current, "orig", None)
    return None
