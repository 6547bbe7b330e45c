"""Submitting a payment: the key protocol's decision, then the runner.

This is the response matrix (docs/response-matrix.md), in the order it is decided:

    new key                            -> handler1, then drive    -> 201 (or 202)
    key exists, different fingerprint  -> 422 idempotency-key-reused
    key exists, finished               -> the stored response, byte for byte
    key exists, started, lease live    -> 409 request-in-progress + Retry-After
    key exists, started, lease expired -> take over, then drive   -> 201 (or 202)
    key exists, parked (indeterminate) -> 202, status indeterminate, nothing driven
    new key, reference already in use  -> 409 duplicate-payment (nothing stored)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from app.db.transaction import one_statement, read
from app.idempotency import store as keys
from app.idempotency.keys import request_fingerprint
from app.idempotency.store import KeyRow, LeaseLost
from app.payments import crash_points, phases
from app.payments import store as payments
from app.payments.models import PaymentRequest
from app.payments.phases import Operation
from app.payments.runner import Finished, Pending, drive, take_over
from app.observability import logs, metrics
from app.services import Services
from app.problems import IDEMPOTENCY_KEY_REUSED, REQUEST_IN_PROGRESS, ProblemError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Reply:
    """What the API sends: a final response (fresh or replayed) or a pending one."""

    outcome: Finished | Pending
    replayed: bool = False


def fingerprint(request: PaymentRequest) -> bytes:
    """What makes two POSTs "the same payment": the validated request, canonically encoded."""
    return request_fingerprint("POST", "/v1/payments", request.model_dump(mode="json"))


def stored_response(row: KeyRow, request_hash: bytes) -> Finished | None:
    """The response to replay for a retry: only of the same request, and only once finished.

    The replay shortcut (app/api/replay_shortcut.py) answers from this alone;
    for anything else it returns None and `submit_payment` decides.
    """
    if row.state != "finished" or row.endpoint != phases.ENDPOINT or row.request_hash != request_hash:
        return None
    assert row.response_code is not None and row.response_body is not None
    return Finished(row.response_code, row.response_body)


async def submit_payment(
    services: Services, client_id: int, key: str, request: PaymentRequest, *, row: KeyRow | None
) -> Reply:
    """`row` is what the client stored under `key`, read (with its authentication) just before.

    Looking first means a retry of a finished payment (the common retry) is
    answered from that one read, without touching the write path at all.
    """
    settings = services.settings
    request_hash = fingerprint(request)
    # Every line of this request names the client and the key (hashed);
    # the runner adds the payment, recovery point, attempt and lease.
    logs.bind(client_id=client_id, key_hash=logs.key_hash(key))
    if row is None:
        op = await one_statement(
            services.engine,
            phases.handler1,
            client_id=client_id,
            key=key,
            request_hash=request_hash,
            request=request,
            lease_seconds=settings.lease_seconds,
        )
        if op is not None:
            metrics.STARTED.inc()
            log.debug("claimed: payment %s created", op.payment.id)
            crash_points.reached(settings.payments_crash_at, f"after-commit-{op.recovery_point}")
            return Reply(await _drive(services, op))
        # A concurrent first attempt claimed the key between our read and our
        # INSERT: the database let exactly one of us in. Read what it stored.
        row = await read(services.engine, keys.load, client_id, key)
        if row is None:
            # Claimed and gone again (reaped): behave as in flight rather
            # than guess; the retry will find a clean slate.
            raise _in_progress(settings.retry_after_seconds)

    # The key exists. Only the stored row decides what happens next.
    if row.endpoint != phases.ENDPOINT or row.request_hash != request_hash:
        log.info("Idempotency-Key reused with a different request: 422")
        raise ProblemError(
            IDEMPOTENCY_KEY_REUSED,
            f"Idempotency-Key {key!r} was first used for a different request",
        )
    replay = stored_response(row, request_hash)
    if replay is not None:
        return Reply(replay, replayed=True)
    if row.parked:
        # Reconciliation owns it now: say so (202, status indeterminate),
        # never "failed", and never resume it blindly.
        payment = await read(services.engine, payments.get, client_id, row.payment_id)
        return Reply(Pending(payment, row.last_error or "parked"))
    if row.lease_live:
        log.debug("in flight elsewhere: 409")
        raise _in_progress(settings.retry_after_seconds)

    op = await take_over(services, client_id, key)
    if op is None:
        raise _in_progress(settings.retry_after_seconds)
    return Reply(await _drive(services, op))


async def _drive(services: Services, op: Operation) -> Finished | Pending:
    try:
        return await drive(services, op)
    except LeaseLost:
        # We stalled past our lease and another attempt owns the operation
        # now; our last phase was rolled back. It will answer the client.
        raise _in_progress(services.settings.retry_after_seconds) from None


def _in_progress(retry_after: int) -> ProblemError:
    return ProblemError(
        REQUEST_IN_PROGRESS,
        "another attempt with this Idempotency-Key is in progress; retry later with the same key",
        headers={"Retry-After": str(retry_after)},
    )
