"""POST /v1/rail/notifications: the rail tells us a payout came back. Our inbox's front door.

The rail delivers each notification at least once, retrying until we answer
2xx, possibly several times and out of order. In the order it is decided:

    signature missing, bad or stale   -> 401 rail-unauthenticated, nothing recorded
    not a documented message, or an
    unknown reason code               -> 400 invalid-notification, nothing recorded
    transfer outcome not recorded yet -> 409 return-too-early + Retry-After, nothing recorded
    seen before (the inbox key exists) -> 200 duplicate: dropped (a stranded
                                          compensation is resumed)
    no payment / contradicts our record -> 200 unmatched / unexpected: a break
    otherwise                          -> 200 applied: returned, booked, the
                                          refund driven after the answer

The service (app/payments/returns.py) commits the effect together with the
inbox row, and only then is the rail answered: a crash between the two
leaves the effect recorded, so the rail's redelivery is a duplicate and is
dropped. The compensating refund runs after the answer is sent (the
service's `follow_up`, as a background task of the request), so the rail
never waits on the PSP; if this process dies first, the recovery worker
finishes it.

Authentication is the rail's Standard Webhooks signature, verified with the
same library our outbox signs with (`standardwebhooks`), under the shared
secret RAIL_NOTIFICATION_SECRET: the rail is the only caller, and it has no
API key of ours.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, BackgroundTasks, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from standardwebhooks import Webhook, WebhookVerificationError

from app.api.deps import ServicesDep
from app.payments import returns
from app.problems import INVALID_NOTIFICATION, RAIL_UNAUTHENTICATED, RETURN_TOO_EARLY, ProblemError
from app.rails.answers import ReturnNotification

router = APIRouter()


def _problem_doc(*problems) -> dict[str, Any]:
    return {
        "content": {"application/problem+json": {}},
        "description": " / ".join(p.title for p in problems),
    }


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
        400: _problem_doc(INVALID_NOTIFICATION),
        401: _problem_doc(RAIL_UNAUTHENTICATED),
        409: _problem_doc(RETURN_TOO_EARLY),
    },
)
async def rail_notification(request: Request, services: ServicesDep, background: BackgroundTasks) -> JSONResponse:
    settings = services.settings
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


def _verified(secret: str | None, body: bytes, request: Request) -> str:
    """The message id, once the signature proves the rail sent this body; else 401."""
    if secret is None:
        raise ProblemError(RAIL_UNAUTHENTICATED, "no RAIL_NOTIFICATION_SECRET is configured: nothing can be verified")
    headers = {name: request.headers.get(name, "") for name in ("webhook-id", "webhook-timestamp", "webhook-signature")}
    try:
        Webhook(secret).verify(body, headers, json_parse=False)
    except (WebhookVerificationError, ValueError) as exc:
        raise ProblemError(RAIL_UNAUTHENTICATED, f"signature not verified: {exc}") from None
    return headers["webhook-id"]


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(p) for p in error["loc"]) or "body"
    return f"{where}: {error['msg']}"
