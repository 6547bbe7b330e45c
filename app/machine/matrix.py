"""The response matrix: what a request that names an Idempotency-Key means, decided from the stored row.

Called by each operation's service (app/payments/submission.py) with the
operation's machine; the engine (app/machine/engine.py) then drives what
this starts or takes over. In the order it is decided (docs/response-matrix.md):

    new key                            -> the machine's start phase, then drive
    key exists, different fingerprint,
    or another endpoint's key          -> 422 idempotency-key-reused
    key exists, finished               -> the stored response, byte for byte
    key exists, started, lease live    -> 409 request-in-progress + Retry-After
    key exists, started, lease expired -> take over, then drive
    key exists, parked                 -> 202, nothing driven
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy.exc import IntegrityError

from app.db.transaction import atomic, one_statement, read
from app.idempotency import key_table
from app.idempotency.key_table import KeyRow, LeaseLost
from app.machine.crash import reached
from app.machine.declare import Machine, Operation
from app.machine.engine import Finished, Pending, drive, take_over
from app.observability import logs, metrics
from app.problems import IDEMPOTENCY_KEY_REUSED, KEY_TABLE_UNAVAILABLE, REQUEST_IN_PROGRESS, ProblemError
from app.services import Services

log = logging.getLogger(__name__)

S = TypeVar("S")

# A missing partition of the key table is not fixed in a second: its upkeep must run.
KEY_TABLE_RETRY_AFTER_SECONDS = 30


@dataclass(frozen=True)
class Reply:
    """What the API sends: a final response (fresh or replayed) or a pending one."""

    outcome: Finished | Pending
    replayed: bool = False


def stored_response(machine: Machine[Any], row: KeyRow, request_hash: bytes) -> Finished | None:
    """The response to replay for a retry: only of the same request to the same endpoint, and only once finished."""
    if row.state != "finished" or row.endpoint != machine.endpoint or row.request_hash != request_hash:
        return None
    assert row.response_code is not None and row.response_body is not None
    return Finished(row.response_code, row.response_body)


async def submit(
    services: Services, machine: Machine[S], client_id: int, key: str, request_hash: bytes,
    *, row: KeyRow | None, **start_args: Any,
) -> Reply:
    """Decide what a request under `key` means, in the order of docs/response-matrix.md.

    `row` is what the client stored under `key`, read (with its
    authentication) just before: a retry of a finished operation, the
    common retry, is answered from that read alone. A new key runs the
    machine's start phase, as one statement, with `start_args`.
    """
    settings = services.settings
    logs.bind(client_id=client_id, key_hash=logs.key_hash(key))
    if row is None:
        op = await _start(services, machine, client_id=client_id, key=key, request_hash=request_hash, **start_args)
        if op is not None:
            metrics.counter(machine.started).inc()
            reached(settings.payments_crash_at, f"after-commit-{op.recovery_point}")
            return Reply(await _drive_for_client(services, op))
        # A concurrent first attempt claimed the key between our read and
        # our claim: the database let exactly one of us in. Read what it stored.
        row = await read(services.engine, key_table.load, client_id, key)
        if row is None:
            # Claimed and gone again (reaped): behave as in flight rather
            # than guess; the retry will find a clean slate.
            raise in_progress(settings.retry_after_seconds)

    # The key exists. Only the stored row decides what happens next. A key
    # is scoped by its endpoint: the same key sent to another operation is
    # a client's bug, surfaced, never replayed as the other operation.
    if row.endpoint != machine.endpoint or row.request_hash != request_hash:
        log.info("Idempotency-Key reused with a different request: 422")
        raise ProblemError(IDEMPOTENCY_KEY_REUSED, f"Idempotency-Key {key!r} was first used for a different request")
    replay = stored_response(machine, row, request_hash)
    if replay is not None:
        return Reply(replay, replayed=True)
    if row.parked:
        # A re-probe or reconciliation owns it now: say so (202), never
        # "failed", and never resume it blindly.
        subject = await read(services.engine, machine.load, row)
        return Reply(Pending(subject, row.last_error or "parked"))
    if row.lease_live:
        log.debug("in flight elsewhere: 409")
        raise in_progress(settings.retry_after_seconds)
    op = await take_over(services, {machine.endpoint: machine}, client_id, key)
    if op is None:
        raise in_progress(settings.retry_after_seconds)
    return Reply(await _drive_for_client(services, op))


async def _start(services: Services, machine: Machine[S], **args: Any) -> Operation[S] | None:
    try:
        run = atomic if machine.start.transaction else one_statement
        return await run(
            services.engine, machine.start.phase, machine, lease_seconds=services.settings.lease_seconds, **args
        )
    except IntegrityError as exc:
        if "no partition of relation" not in str(exc.orig):
            raise
        # Today's partition of the key table is missing: its upkeep has not
        # run for a week. Nothing was written; say so, never a 500.
        raise ProblemError(
            KEY_TABLE_UNAVAILABLE, "the key table has no partition for today; retry later with the same key",
            headers={"Retry-After": str(KEY_TABLE_RETRY_AFTER_SECONDS)},
        ) from None


async def _drive_for_client(services: Services, op: Operation[Any]) -> Finished | Pending:
    try:
        return await drive(services, op)
    except LeaseLost:
        # We stalled past our lease and another attempt owns the operation
        # now; our last phase was rolled back. It will answer the client.
        raise in_progress(services.settings.retry_after_seconds) from None


def in_progress(retry_after: int) -> ProblemError:
    return ProblemError(
        REQUEST_IN_PROGRESS,
        "another attempt with this Idempotency-Key is in progress; retry later with the same key",
        headers={"Retry-After": str(retry_after)},
    )
