"""POST /v1/rail/notifications: the rail tells us a payout came back. Our inbox's front door.

Where it sits: a route that, like every route, opens no transaction: it
verifies the rail's Standard Webhooks signature (RAIL_NOTIFICATION_SECRET),
parses the message by the allow-list, and hands it to the service
(app/payments/returns.py), which commits the effect with its inbox row
before the rail is answered; the compensating refund runs after the answer
(`follow_up`, a background task). In the order it is decided:

    signature headers missing            -> 401 rail-unauthenticated at once, the body not read
    signature bad or stale               -> 401 rail-unauthenticated, nothing recorded
    not a documented message or reason   -> 400 invalid-notification, nothing recorded
    transfer outcome not recorded yet    -> 409 return-too-early + Retry-After, nothing recorded
    seen before (the inbox key exists)   -> 200 duplicate (a stranded compensation is resumed)
    no payment / contradicts our record  -> 200 unmatched / unexpected: a break
    otherwise                            -> 200 applied: returned, booked, refund after the answer

docs/outbox-inbox.md#7-our-inbox-returned-payouts explains each answer.
"""

from __future__ import annotations

import json

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from standardwebhooks import Webhook, WebhookVerificationError

from app.api.deps import ServicesDep
from app.api.errors import problem_doc
from app.payments import returns
from app.problems import INVALID_NOTIFICATION, RAIL_UNAUTHENTICATED, RETURN_TOO_EARLY, ProblemError
from app.rails.answers import ReturnNotification

router = APIRouter()


@router.post(
    "/v1/rail/notifications",
    summary="The rail's notification of a returned payout (for the rail only)",
    tags=["rail"],
    description=(
        "Signed by the rail with Standard Webhooks headers under RAIL_NOTIFICATION_SECRET. Each "
        "return is applied once, through an inbox keyed by the return's id: a redelivery is "
        "answered 200 and dropped. See docs/outbox-inbox.md."
    ),
    responses={
        200: {"description": "Recorded: `outcome` is applied, duplicate, unmatched or unexpected."},
        400: problem_doc(INVALID_NOTIFICATION.slug),
        401: problem_doc(RAIL_UNAUTHENTICATED.slug),
        409: problem_doc(RETURN_TOO_EARLY.slug),
    },
)
async def rail_notification(request: Request, services: ServicesDep, background: BackgroundTasks) -> JSONResponse:
    settings = services.settings
    _signed_at_all(settings.rail_notification_secret, request)
    body = await request.body()
    message_id = _verified(settings.rail_notification_secret, body, request)
    try:
        notification = ReturnNotification.model_validate_json(body)
    except ValidationError as exc:
        raise ProblemError(INVALID_NOTIFICATION, _first_error(exc)) from None
    if notification.id != message_id:
        raise ProblemError(INVALID_NOTIFICATION, "the body's id is not the signed webhook-id")
    recorded = await returns.receive_notification(
        services, notification.data, message_id=message_id, body=json.loads(body)
    )
    background.add_task(returns.follow_up, services, recorded)
    payment = recorded.payment
    return JSONResponse(
        {
            "outcome": recorded.outcome,
            "message_id": message_id,
            "return_id": notification.data.return_id,
            "payment_id": None if payment is None or recorded.outcome == "unmatched" else str(payment.id),
        }
    )


SIGNATURE_HEADERS = ("webhook-id", "webhook-timestamp", "webhook-signature")


def _signed_at_all(secret: str | None, request: Request) -> None:
    """401 before the body is read, when nothing could verify it: this path is open to anyone, and
    reading up to 16 KiB sent a byte at a time would hold the connection until the body deadline."""
    if secret is None:
        raise ProblemError(RAIL_UNAUTHENTICATED, "no RAIL_NOTIFICATION_SECRET is configured: nothing can be verified")
    missing = [name for name in SIGNATURE_HEADERS if not request.headers.get(name)]
    if missing:
        raise ProblemError(RAIL_UNAUTHENTICATED, f"signature not verified: missing {', '.join(missing)}")


def _verified(secret: str | None, body: bytes, request: Request) -> str:
    """The message id, once the signature proves the rail sent this body; else 401."""
    if secret is None:
        raise ProblemError(RAIL_UNAUTHENTICATED, "no RAIL_NOTIFICATION_SECRET is configured: nothing can be verified")
    headers = {name: request.headers.get(name, "") for name in SIGNATURE_HEADERS}
    try:
        Webhook(secret).verify(body, headers, json_parse=False)
    except (WebhookVerificationError, ValueError) as exc:
        raise ProblemError(RAIL_UNAUTHENTICATED, f"signature not verified: {exc}") from None
    return headers["webhook-id"]


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
