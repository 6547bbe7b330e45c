"""The catalogue of problem types (RFC 9457) that the API can answer with.

Each has a stable slug; its `type` URI is `/problems/<slug>` on this service,
which serves the description below, so a client (or a person) can look up any
`type` it receives. Domain code raises `ProblemError`; `app.api.errors` turns it
into an `application/problem+json` response.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ProblemType:
    slug: str
    status: int
    title: str
    description: str

    @property
    def uri(self) -> str:
        return f"/problems/{self.slug}"


def _t(slug: str, status: int, title: str, description: str) -> ProblemType:
    return ProblemType(slug, status, title, description)


IDEMPOTENCY_KEY_MISSING = _t(
    "idempotency-key-missing", 400, "Idempotency-Key header is required",
    "A POST that moves money (a payment, a refund) must carry an Idempotency-Key header: a value "
    "you generate once per operation (a UUID is ideal) and send again, unchanged, on every retry.",
)
IDEMPOTENCY_KEY_INVALID = _t(
    "idempotency-key-invalid", 400, "Idempotency-Key header is malformed",
    "A key is 1 to 255 characters from A-Z a-z 0-9 and _ . : ~ + / = -, sent bare or as a "
    "quoted structured-field string. Nothing was stored.",
)
INVALID_REQUEST = _t(
    "invalid-request", 400, "The request body is invalid",
    "The body is not valid JSON or does not match the schema; `errors` lists each problem "
    "with its location (the first 20; `errors_omitted` counts any more). Nothing was stored "
    "and the key was not used.",
)
INVALID_BATCH = _t(
    "invalid-batch", 400, "The batch file has bad rows",
    "Every row of a payment batch is checked before anything is stored; one bad row refuses the "
    "whole file. `errors` lists every bad row: its number (1 for the first row of data, 0 for the "
    "file itself), the field and what is wrong. Nothing was stored, nothing was published, and the "
    "key was not used: fix the rows and send the file again.",
)
UNAUTHENTICATED = _t(
    "unauthenticated", 401, "Missing or unknown API key",
    "Send `Authorization: Bearer <api key>`. Create a key with `payments clients create NAME`.",
)
NOT_FOUND = _t(
    "not-found", 404, "No such resource",
    "Nothing with this identifier exists for your client. Another client's payments and keys "
    "are reported the same way, so identifiers cannot be probed.",
)
REQUEST_IN_PROGRESS = _t(
    "request-in-progress", 409, "A request with this key is still in progress",
    "Another attempt with the same Idempotency-Key owns this payment right now. Nothing was "
    "done by this request. Retry after the number of seconds in Retry-After with the same key "
    "and body: you will get the final response (or a 202 if its outcome is still unknown).",
)
DUPLICATE_PAYMENT = _t(
    "duplicate-payment", 409, "A payment with this reference already exists",
    "Your client already has a payment with this `reference` (under another Idempotency-Key) "
    "that is in progress or succeeded. No new payment was made; `payment_id` names the existing "
    "one. A reference is freed only when its payment ends without moving money (declined, or "
    "failed and refunded).",
)
DUPLICATE_REFUND = _t(
    "duplicate-refund", 409, "A refund with this reference already exists",
    "This payment already has a refund with this `reference` (under another Idempotency-Key) "
    "that is pending or succeeded: the same refund asked for twice, a double click. Nothing more "
    "was refunded; `refund_id` names the existing one. A failed refund frees its reference.",
)
REFUND_EXCEEDS_PAYMENT = _t(
    "refund-exceeds-payment", 409, "The refund is larger than what is left to refund",
    "The payment's refunds, made or in flight, together with this one would exceed its charge; "
    "`amount_refundable` says what is left. Nothing was refunded. This answer is stored under "
    "your Idempotency-Key and replayed to a retry of it; a refund that fails gives its amount "
    "back, after which a new request, under a new key, may take it.",
)
PAYMENT_NOT_REFUNDABLE = _t(
    "payment-not-refundable", 409, "The payment cannot be refunded",
    "Only a payment that succeeded (charged, and paid out) can be refunded by its client: this "
    "one was declined or failed (nothing to refund), is still in flight (retry once it is final), "
    "or its payout was returned and the charge is being refunded in full already. `payment_status` "
    "names its status. Nothing was refunded.",
)
IDEMPOTENCY_KEY_REUSED = _t(
    "idempotency-key-reused", 422, "Idempotency-Key was already used for a different request",
    "This key was first used with a different method, path or body: another payment, another "
    "refund, or a payment's key sent to the refund endpoint (a key is scoped by its endpoint). "
    "A key identifies one operation; generate a new key for a new one. Nothing was done.",
)
PAYLOAD_TOO_LARGE = _t(
    "payload-too-large", 413, "The request body is too large",
    "A request body may be at most 16 KiB (a payment is well under 4 KiB). The request was "
    "refused before it was read or authenticated. Nothing was stored.",
)
REQUEST_HEADER_TOO_LARGE = _t(
    "request-header-too-large", 431, "Request Header Fields Too Large",
    "The request line and headers together may be at most 16 KiB. The request was refused "
    "before it reached the application and the connection closed. Nothing was stored.",
)
REQUEST_TIMEOUT = _t(
    "request-timeout", 408, "Request Timeout",
    "The request's headers did not arrive within 10 seconds, or its body within "
    "BODY_TIMEOUT_SECONDS (10 by default) of its headers. The connection was closed and "
    "nothing was stored; send the request again, all at once.",
)
TOO_MANY_CONNECTIONS = _t(
    "too-many-connections", 429, "Too many connections from your address",
    "Your address already holds MAX_CONNECTIONS_PER_PEER connections to this API process "
    "(100 by default; an IPv6 address counts with its /64). This one was closed at once, "
    "before anything was read. Reuse the connections you hold (HTTP keep-alive) instead of "
    "opening more; nothing was stored.",
)
METHOD_NOT_ALLOWED = _t(
    "method-not-allowed", 405, "Method not allowed", "This path does not accept this HTTP method."
)
INTERNAL_ERROR = _t(
    "internal-error", 500, "Internal error",
    "Something failed on our side. If the request carried an Idempotency-Key, retrying it with "
    "the same key is safe: it will either resume or replay, never pay twice.",
)
SERVICE_UNAVAILABLE = _t(
    "service-unavailable", 503, "The service cannot reach its database",
    "The database did not answer, so this request could not be carried through; nothing was "
    "done that a retry cannot finish, and nothing will be done twice. Retry after the number "
    "of seconds in Retry-After with the same Idempotency-Key and body: it resumes from what "
    "was recorded, or replays the final response.",
)
KEY_TABLE_UNAVAILABLE = _t(
    "key-table-unavailable", 503, "The key table cannot take this request right now",
    "Either the key table has no partition for today (its upkeep, `payments worker` or "
    "`payments migrate`, has not run for a week), or the key row was being moved between "
    "partitions at that instant. Nothing was done that a retry cannot finish, and nothing will be "
    "done twice. Retry after the number of seconds in Retry-After with the same Idempotency-Key "
    "and body.",
)

RAIL_UNAUTHENTICATED = _t(
    "rail-unauthenticated", 401, "Not signed by the rail",
    "POST /v1/rail/notifications accepts only messages signed by the rail: Standard Webhooks "
    "headers (webhook-id, webhook-timestamp within five minutes, webhook-signature) under the "
    "shared secret RAIL_NOTIFICATION_SECRET. Nothing was recorded.",
)
INVALID_NOTIFICATION = _t(
    "invalid-notification", 400, "The notification is not one the rail documents",
    "The body is not a `transfer.returned` message as the rail documents it, or it carries a "
    "return reason code that is not on the allow-list. It was not guessed at: nothing was recorded.",
)
RETURN_TOO_EARLY = _t(
    "return-too-early", 409, "The returned transfer's outcome is not recorded yet",
    "The payment this return names has not recorded its transfer's outcome yet (it is still "
    "processing, or indeterminate). Nothing was recorded; deliver the notification again after "
    "Retry-After seconds, and it will be applied once the outcome is recorded.",
)

CROSS_ORIGIN_REQUEST = _t(
    "cross-origin-request", 403, "A console form may be posted only from the console itself",
    "The operator console accepts a POST only from its own pages: this one came from another "
    "site or origin (its Sec-Fetch-Site or Origin header says so). Nothing was done. Open the "
    "console at its own address and use its form.",
)

CATALOGUE: dict[str, ProblemType] = {
    t.slug: t
    for t in (
        IDEMPOTENCY_KEY_MISSING, IDEMPOTENCY_KEY_INVALID, INVALID_REQUEST, INVALID_BATCH, UNAUTHENTICATED,
        NOT_FOUND, METHOD_NOT_ALLOWED, REQUEST_TIMEOUT, PAYLOAD_TOO_LARGE, REQUEST_HEADER_TOO_LARGE,
        TOO_MANY_CONNECTIONS,
        REQUEST_IN_PROGRESS, DUPLICATE_PAYMENT, DUPLICATE_REFUND, REFUND_EXCEEDS_PAYMENT, PAYMENT_NOT_REFUNDABLE,
        IDEMPOTENCY_KEY_REUSED, INTERNAL_ERROR, SERVICE_UNAVAILABLE, KEY_TABLE_UNAVAILABLE,
        RAIL_UNAUTHENTICATED, INVALID_NOTIFICATION, RETURN_TOO_EARLY, CROSS_ORIGIN_REQUEST,
    )
}


class ProblemError(Exception):
    """Raised anywhere to answer with a problem; extensions become members of the body."""

    def __init__(
        self,
        problem: ProblemType,
        detail: str,
        *,
        headers: dict[str, str] | None = None,
        **extensions: Any,
    ) -> None:
        super().__init__(detail)
        self.problem = problem
        self.detail = detail
        self.headers = headers or {}
        self.extensions = extensions

    def body(self, instance: str | None = None) -> dict[str, Any]:
        """The problem document (RFC 9457): what the API sends, and what a stored refusal replays."""
        return problem_body(self.problem, self.detail, instance=instance, **self.extensions)


# The members RFC 9457 defines: an extension of the same name would change
# what they mean to every client (a `status` that is not the HTTP status).
STANDARD_MEMBERS = frozenset({"type", "title", "status", "detail", "instance"})


def problem_body(problem: ProblemType, detail: str, *, instance: str | None = None, **extensions: Any) -> dict[str, Any]:
    clash = STANDARD_MEMBERS & extensions.keys()
    if clash:
        raise ValueError(f"a problem's extensions may not replace its standard members: {sorted(clash)}")
    body: dict[str, Any] = {"type": problem.uri, "title": problem.title, "status": problem.status, "detail": detail}
    if instance:
        body["instance"] = instance
    body.update(extensions)
    return body
