"""The routes: translate HTTP to calls on the payment's services (submission, lookups) and back; no SQL, no transaction."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Response

from app.api.deps import ClientId, PaymentCallerDep, ServicesDep
from app.api.errors import PROBLEM_JSON, problem_doc, problem_response
from app.api.schemas import EventList, EventView, KeyView, ProblemDoc
from app.db.errors import describe
from app.idempotency.keys import InvalidIdempotencyKey, end_to_end_reference, parse_idempotency_key
from app.machine.engine import Finished
from app.observability import metrics
from app.outbox import events
from app.payments import lookups, submission
from app.payments.models import Payment, PaymentRequest, PaymentView, fee_for
from app.payments.refunds import submission as refunds
from app.payments.refunds.models import Refund, RefundList, RefundRequest, RefundView
from app.services import database_answers
from app.problems import CATALOGUE, NOT_FOUND, SERVICE_UNAVAILABLE, ProblemError

log = logging.getLogger(__name__)
router = APIRouter()


def payment_examples() -> dict[str, dict[str, Any]]:
    """The bodies of a 201, one per final status, made the way the API makes them (PaymentView.of a payment row).

    Without them ReDoc and Swagger UI make up a sample from the schema, whose
    first status is `processing`: the one a 201 never carries.
    """
    at = datetime(2026, 1, 15, 9, 30, tzinfo=timezone.utc)
    fee = fee_for(1250)
    succeeded = Payment(
        id=uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e"), client_id=1, reference="order-1001",
        amount_minor=1250, currency="EUR", fee_minor=fee, net_minor=1250 - fee, card_token="tok_visa",
        beneficiary_name="Ada Lovelace", beneficiary_iban="DE89370400440532013000", status="succeeded",
        end_to_end_reference=end_to_end_reference(1, "8e03978e-40d5-43e8-bc93-6894a57f9324"), psp_charge_key=None, psp_charge_id=None,
        decline_code=None, rail_transfer_key=None, rail_transfer_id=None, reject_reason=None, psp_refund_key=None,
        psp_refund_id=None, created_at=at, updated_at=at, payout_instructed_at=at,
    )
    rows = {
        "succeeded": ("Charged, and paid out to the beneficiary", succeeded),
        "declined": ("The card was declined: nothing charged, nothing paid out",
                     dataclasses.replace(succeeded, status="declined", decline_code="card_declined",
                                         end_to_end_reference=None, payout_instructed_at=None)),
        "failed": ("The payout was rejected: the charge refunded in full",
                   dataclasses.replace(succeeded, status="failed", reject_reason="AC04")),
    }
    return {status: {"summary": summary, "value": json.loads(PaymentView.of(row).body())}
            for status, (summary, row) in rows.items()}


@router.post(
    "/v1/payments",
    status_code=201,
    response_model=PaymentView,
    summary="Create a payment, exactly once",
    tags=["payments"],
    description=(
        "Charges the card at the PSP and pays the net amount out over the rail. Safe to retry "
        "with the same `Idempotency-Key` and body: a finished payment is replayed byte for byte "
        "with `Idempotent-Replayed: true`; one still in flight answers 409 with `Retry-After`."
    ),
    responses={
        # Its examples (one per final status) are set in app/main.py, after
        # FastAPI, which would drop their nulls, has built the document.
        201: {"description": "Final outcome: `status` is succeeded, declined or failed (refunded)."},
        202: {
            "model": PaymentView,
            "description": "Outcome not yet known (an external call timed out). Poll `Location`, or "
            "retry with the same key. Never a failure.",
        },
        400: problem_doc("idempotency-key-missing", "idempotency-key-invalid", "invalid-request"),
        401: problem_doc("unauthenticated"),
        409: problem_doc("request-in-progress", "duplicate-payment"),
        413: problem_doc("payload-too-large"),
        422: problem_doc("idempotency-key-reused"),
        503: problem_doc("service-unavailable", "key-table-unavailable"),
    },
)
async def create_payment(services: ServicesDep, caller: PaymentCallerDep, body: PaymentRequest) -> Response:
    reply = await submission.submit_payment(services, caller.client_id, caller.key, body, row=caller.row)
    outcome = reply.outcome
    if isinstance(outcome, Finished):
        if reply.replayed:
            metrics.REPLAYED_BY_ROUTE.inc()
        return final_response(outcome, replayed=reply.replayed)
    payment = outcome.subject
    return Response(
        PaymentView.of(payment).body(),
        202,
        headers={
            "Location": f"/v1/payments/{payment.id}",
            "Retry-After": str(services.settings.retry_after_seconds),
        },
        media_type="application/json",
    )


def final_response(outcome: Finished, *, replayed: bool) -> Response:
    """An operation's final response; a replay is the stored body, byte for byte, plus one header.

    The replay shortcut (app/fastpath/replay_shortcut.py) sends replays through this
    too, so a replay is the same bytes whichever way it was answered. A
    stored refusal (a refund larger than what is left) is a problem document.
    """
    headers = {"Idempotent-Replayed": "true"} if replayed else None
    media_type = PROBLEM_JSON if outcome.status_code >= 400 else "application/json"
    return Response(outcome.body, outcome.status_code, headers=headers, media_type=media_type)


@router.get(
    "/v1/payments/{payment_id}",
    response_model=PaymentView,
    summary="A payment's current state",
    tags=["payments"],
    responses={401: problem_doc("unauthenticated"), 404: problem_doc("not-found")},
)
async def get_payment(services: ServicesDep, client_id: ClientId, payment_id: str) -> PaymentView:
    payment = await lookups.find_payment(services, client_id, id_in_path(payment_id, "payment"))
    if not payment:
        # Another client's payment is "not found" too, never "forbidden".
        raise ProblemError(NOT_FOUND, "no such payment")
    return PaymentView.of(payment)


def refund_examples() -> dict[str, dict[str, Any]]:
    """The bodies of a refund's 201 and 202, made the way the API makes them (RefundView.of a refund row)."""
    at = datetime(2026, 1, 16, 14, 5, tzinfo=timezone.utc)
    succeeded = Refund(
        id=uuid.UUID("01943c1e-5b7a-7c3e-9a41-2d6f0b8e4a11"), payment_id=uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e"),
        client_id=1, idempotency_key="c1d2e3f4", reference="rma-2001", reason="one item returned", amount_minor=500,
        currency="EUR", status="succeeded", psp_charge_id="ch_1", psp_refund_key="k5", psp_refund_id="re_1",
        failure_code=None, created_at=at, updated_at=at, finished_at=at,
    )
    rows = {
        "succeeded": ("Refunded to the payer's card", succeeded),
        "failed": ("The PSP could not refund: nothing refunded, the amount refundable again",
                   dataclasses.replace(succeeded, status="failed", failure_code="expired_or_canceled_card")),
        "pending": ("Taken by the PSP, not settled yet (a 202)",
                    dataclasses.replace(succeeded, status="pending", psp_refund_id=None, finished_at=None)),
    }
    return {status: {"summary": summary, "value": json.loads(RefundView.of(row).body())}
            for status, (summary, row) in rows.items()}


def id_in_path(raw: str, what: str) -> uuid.UUID:
    """The id a path names; one that is not even a UUID names nothing, so it is "not found" like any other."""
    try:
        return uuid.UUID(raw)
    except ValueError:
        raise ProblemError(NOT_FOUND, f"no such {what}") from None


@router.post(
    "/v1/payments/{payment_id}/refunds",
    status_code=201,
    response_model=RefundView,
    summary="Refund a payment, in full or in part, exactly once",
    tags=["refunds"],
    description=(
        "Refunds `amount` (absent: everything still refundable) of a succeeded payment's charge to "
        "the payer's card. Its own `Idempotency-Key`, with the payment's response matrix: a finished "
        "refund (or a stored refusal) is replayed byte for byte with `Idempotent-Replayed: true`; one "
        "in flight answers 409 with `Retry-After`; a key already used for anything else answers 422. "
        "`reference` is your identity for the refund, unique per payment. Refunds of a payment never "
        "add up to more than its charge, whatever the concurrency (docs/refunds.md)."
    ),
    responses={
        201: {"description": "Final outcome: `status` is succeeded or failed."},
        202: {"model": RefundView, "description": "The PSP has the refund pending. Poll `Location`, or retry "
              "with the same key. Never a failure."},
        400: problem_doc("idempotency-key-missing", "idempotency-key-invalid", "invalid-request"),
        401: problem_doc("unauthenticated"),
        404: problem_doc("not-found"),
        409: problem_doc("request-in-progress", "duplicate-refund", "refund-exceeds-payment",
                         "payment-not-refundable"),
        413: problem_doc("payload-too-large"),
        422: problem_doc("idempotency-key-reused"),
        503: problem_doc("service-unavailable", "key-table-unavailable"),
    },
)
async def create_refund(
    services: ServicesDep, caller: PaymentCallerDep, payment_id: str, body: RefundRequest
) -> Response:
    reply = await refunds.submit_refund(
        services, caller.client_id, caller.key, id_in_path(payment_id, "payment"), body, row=caller.row
    )
    outcome = reply.outcome
    if isinstance(outcome, Finished):
        return final_response(outcome, replayed=reply.replayed)
    refund = outcome.subject
    return Response(
        RefundView.of(refund).body(),
        202,
        headers={"Location": f"/v1/refunds/{refund.id}", "Retry-After": str(services.settings.retry_after_seconds)},
        media_type="application/json",
    )


@router.get(
    "/v1/payments/{payment_id}/refunds",
    response_model=RefundList,
    summary="A payment's refunds, oldest first, and what is still refundable",
    tags=["refunds"],
    responses={400: problem_doc("invalid-request"), 401: problem_doc("unauthenticated"),
               404: problem_doc("not-found")},
)
async def list_refunds(
    services: ServicesDep,
    client_id: ClientId,
    payment_id: str,
    after: uuid.UUID | None = Query(None, description="Only refunds after this refund id."),
    limit: int = Query(20, ge=1, le=refunds.MAX_PAGE),
) -> RefundList:
    payment, found = await refunds.refunds_of(services, client_id, id_in_path(payment_id, "payment"), after, limit + 1)
    page = found[:limit]
    return RefundList(
        data=[RefundView.of(r) for r in page], has_more=len(found) > limit,
        next_after=page[-1].id if page else after, amount_refundable=payment.refundable_minor,
    )


@router.get(
    "/v1/refunds/{refund_id}",
    response_model=RefundView,
    summary="A refund's current state",
    tags=["refunds"],
    responses={401: problem_doc("unauthenticated"), 404: problem_doc("not-found")},
)
async def get_refund(services: ServicesDep, client_id: ClientId, refund_id: str) -> RefundView:
    refund = await refunds.find_refund(services, client_id, id_in_path(refund_id, "refund"))
    if not refund:
        raise ProblemError(NOT_FOUND, "no such refund")
    return RefundView.of(refund)


@router.get(
    "/v1/idempotency-keys/{key:path}",
    response_model=KeyView,
    summary="An operation's state machine row and timeline",
    tags=["idempotency keys"],
    responses={401: problem_doc("unauthenticated"), 404: problem_doc("not-found")},
)
async def get_idempotency_key(services: ServicesDep, client_id: ClientId, key: str) -> KeyView:
    try:
        row = await lookups.find_key(services, client_id, parse_idempotency_key(key))
    except InvalidIdempotencyKey:
        row = None
    if row is None:
        raise ProblemError(NOT_FOUND, "no such idempotency key")
    return KeyView.of(row)


@router.get(
    "/v1/events",
    response_model=EventList,
    summary="Your events, oldest first",
    tags=["events"],
    description=(
        "Every decision about your payments a webhook would carry (`payment.succeeded`, "
        "`payment.declined`, `payment.failed`, `payment.indeterminate`, and for a payout returned "
        "later `payment.returned` then `payment.refunded`), in id order. Page with "
        "`after` = the last id you have. Events of the last second are not listed yet, so that an "
        "event still committing can never fall behind your cursor (docs/outbox-inbox.md)."
    ),
    responses={400: problem_doc("invalid-request"), 401: problem_doc("unauthenticated")},
)
async def list_events(
    services: ServicesDep,
    client_id: ClientId,
    after: uuid.UUID | None = Query(None, description="Only events after this event id."),
    limit: int = Query(50, ge=1, le=events.MAX_PAGE),
) -> EventList:
    found = await lookups.events_after(services, client_id, after, limit + 1)
    page = found[:limit]
    return EventList(
        data=[EventView.of(e) for e in page],
        has_more=len(found) > limit,
        next_after=page[-1].id if page else after,
    )


@router.get("/problems/{slug}", response_model=ProblemDoc, summary="What a problem `type` means", tags=["meta"])
async def get_problem(slug: str) -> ProblemDoc:
    problem = CATALOGUE.get(slug)
    if problem is None:
        raise ProblemError(NOT_FOUND, "no such problem type")
    return ProblemDoc(type=problem.uri, title=problem.title, status=problem.status, description=problem.description)


# A health check must answer quickly even when the database does not: a
# load balancer (or `make run`, or the test harness) polling it should
# learn "down" in a couple of seconds, not after a connect or pool timeout.
HEALTH_TIMEOUT_SECONDS = 2.0


@router.get(
    "/healthz",
    summary="Liveness and database reachability",
    tags=["meta"],
    responses={503: problem_doc("service-unavailable")},
)
async def healthz(services: ServicesDep) -> Response:
    """200 when the database answers one `SELECT 1`; 503 naming what is down otherwise.

    Only the database is checked: the PSP and the rail are other people's
    systems, and a payment whose call to them fails is already answered 202
    and resumed later, so this process is still healthy when they are not.
    """
    try:
        async with asyncio.timeout(HEALTH_TIMEOUT_SECONDS):
            await database_answers(services)
    except Exception as exc:  # any failure to get an answer means "down" to whoever polls this
        log.warning("health check: database down: %s", describe(exc))
        return problem_response(
            SERVICE_UNAVAILABLE, "the database did not answer", instance="/healthz",
            headers={"Retry-After": str(services.settings.retry_after_seconds)},
            checks={"database": "down"},
        )
    return Response(json.dumps({"status": "ok", "database": "ok"}), media_type="application/json")
