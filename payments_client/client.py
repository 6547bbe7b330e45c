"""`PaymentsClient.pay`: one logical payment, however many attempts it takes.

Each rule below prevents a failure that a crash test names:

1. **One key per logical operation, generated once (uuid4), before the first
   attempt.** A key minted inside the retry loop makes every retry a new
   payment to the server: it cannot recognise the retry of a charge whose
   response was lost, and unless a business rule catches it (here, the
   per-client `reference`) the card is charged twice (`buggy.py`).
2. **Persisted with the body before the first attempt** (`store.py`). The
   process can die between "sent" and "answered"; the restarted client must
   find and resend the same key, or it is rule 1's bug again one level up.
3. **Retry only what is safe and transient**: connection errors and timeouts
   (the request may or may not have been applied: only the same key makes
   resending safe), 409 request-in-progress (another attempt owns the
   operation, e.g. a dead API process whose lease has not run out yet), 429
   and 5xx. Honour `Retry-After` (the server knows when the lease ends), back
   off exponentially with jitter otherwise, and stop after a bounded number of
   attempts and seconds: an unbounded loop turns an outage into a stampede.
4. **Never retry a refusal.** Any other 4xx is final for this request and is
   raised at once as `ProblemError` with the problem+json: 409
   duplicate-payment (this reference is held by a payment in progress or paid; `payment_id` names the
   payment), 422 idempotency-key-reused (a bug: same key, different body).
5. **202 is not a failure**: the outcome is not yet known. Poll `Location`
   until the status is final (succeeded, declined, failed) or indeterminate
   (reconciliation will settle it), within a time limit.
6. **Mark the operation done** only with a final answer in hand (or
   refused, with the problem), so a restarted client knows what it still has
   to resume: `store.pending()`, each with the key it already used.

`PaymentsClient.create_refund` follows the same rules for a refund of a
payment, with one difference the API makes: a `202` (the PSP has not
settled the refund yet) is returned as a `Refund` whose status is `pending`,
not polled, because a PSP may take days to settle one. The refund stays
pending in the store; `create_refund` again resends the same key (the
service then asks the PSP again), or `get_refund` reads it. The operation
is named by what identifies a refund to the service, the payment and the
refund's `reference`, so a restarted client finds its key without being told.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import httpx

from payments_client.store import OperationStore

FINAL = {"succeeded", "declined", "failed", "indeterminate"}
REFUND_FINAL = {"succeeded", "failed"}
# How long after its first attempt an operation may still be resumed with its
# stored key (pay() again). The service keeps a key at least this long
# (KEY_RETENTION_HOURS refuses less); after the key is gone, the same key is a
# new request, and the service answers 409 duplicate-payment for an order it
# already paid: look the payment up by the `payment_id` it names instead.
RETRY_WINDOW_HOURS = 24
# An idle connection is given up a second before the service closes it
# (`payments api` closes a kept-alive connection after 5 s idle, uvicorn's
# default), so a request is never written on a connection the server is
# closing: that would cost an attempt, a transport error and a retry.
KEEP_ALIVE_SECONDS = 4.0


@dataclass(frozen=True)
class Event:
    """One thing the client did or saw, for `on_event` (logging, demos)."""

    kind: str  # key-created | key-reused | response | transport-error | wait | poll | pending | done | gave-up
    operation_id: str
    key: str
    attempt: int = 0
    status: int | None = None
    retry_after: float | None = None
    replayed: bool = False
    problem: str | None = None  # the problem type's last segment, e.g. "request-in-progress"
    detail: str | None = None
    seconds: float | None = None


class PaymentsError(Exception):
    """Base of everything `pay` raises."""


class ProblemError(PaymentsError):
    """A refusal (4xx) that retrying cannot change; `problem` is the problem+json body."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(f"{status} {problem.get('type')}: {problem.get('detail')}")
        self.status, self.problem = status, problem
        self.type = str(problem.get("type", "")).rsplit("/", 1)[-1]


class DuplicateRefund(ProblemError):
    """409 duplicate-refund: the payment has a refund with this reference under another key (pending or
    succeeded); `refund_id` names it. Nothing more was refunded: read that refund instead."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(status, problem)
        self.refund_id: str | None = problem.get("refund_id")


class RefundExceedsPayment(ProblemError):
    """409 refund-exceeds-payment: more than is left to refund; `amount_refundable` says what is left.
    Stored under the key: the same key replays it, so a smaller refund needs a new reference (and key)."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(status, problem)
        self.amount_refundable: int | None = problem.get("amount_refundable")


class PaymentNotRefundable(ProblemError):
    """409 payment-not-refundable: the payment did not succeed (declined, failed, still in flight, or
    refunded by a compensation); `payment_status` is its status. Nothing was stored."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        super().__init__(status, problem)
        # The problem names the payment's status in its `status` member.
        named = problem.get("payment_status")
        self.payment_status: str | None = named if isinstance(named, str) else None


# The refusals a caller is expected to handle one by one, by the problem type's last segment.
TYPED_PROBLEMS: dict[str, type[ProblemError]] = {
    "duplicate-refund": DuplicateRefund,
    "refund-exceeds-payment": RefundExceedsPayment,
    "payment-not-refundable": PaymentNotRefundable,
}


def problem_error(status: int, problem: dict[str, Any]) -> ProblemError:
    """The refusal as its own class where it has one (TYPED_PROBLEMS), else a plain ProblemError."""
    slug = str(problem.get("type", "")).rsplit("/", 1)[-1]
    return TYPED_PROBLEMS.get(slug, ProblemError)(status, problem)


@dataclass(frozen=True)
class RefundFailure:
    code: str
    message: str


@dataclass(frozen=True)
class Refund:
    """A refund as the API returns it (`object: "refund"`); `raw` is the JSON it was read from."""

    id: str
    payment_id: str
    status: str  # pending | succeeded | failed
    amount: int
    currency: str
    reference: str
    reason: str | None
    failure: RefundFailure | None
    created_at: str
    raw: dict[str, Any]

    @property
    def final(self) -> bool:
        """Succeeded (the card is credited) or failed (nothing refunded); pending is neither."""
        return self.status in REFUND_FINAL

    @classmethod
    def of(cls, body: dict[str, Any]) -> Refund:
        failure = body.get("failure")
        return cls(
            id=body["id"], payment_id=body["payment_id"], status=body["status"], amount=body["amount"],
            currency=body["currency"], reference=body["reference"], reason=body.get("reason"),
            failure=RefundFailure(failure["code"], failure["message"]) if failure else None,
            created_at=body["created_at"], raw=body,
        )


@dataclass(frozen=True)
class RefundPage:
    """One page of a payment's refunds, oldest first, and what is still refundable."""

    data: list[Refund]
    has_more: bool
    next_after: str | None  # pass as `after` for the next page
    amount_refundable: int


class RetriesExhausted(PaymentsError):
    """No final answer within the attempt/time budget; the operation stays pending with its key."""


class StillProcessing(PaymentsError):
    """A 202 whose outcome stayed unknown for the whole polling window; call `pay` again later."""

    def __init__(self, message: str, payment: dict[str, Any]) -> None:
        super().__init__(message)
        self.payment = payment


def describe(exc: httpx.TransportError) -> str:
    """A transport error in words: which side of "sent" it happened on matters."""
    if isinstance(exc, httpx.ConnectError):
        return "connection refused: nothing was sent"
    if isinstance(exc, httpx.TimeoutException):
        return f"timed out ({type(exc).__name__}): the request may or may not have been applied"
    return "connection dropped before any response: the request may or may not have been applied"


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:  # the HTTP-date form
            return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
        except (TypeError, ValueError):
            return None


def problem_of(response: httpx.Response) -> dict[str, Any] | None:
    if not response.headers.get("content-type", "").startswith("application/problem+json"):
        return None
    try:
        return response.json()
    except ValueError:
        return None


class PaymentsClient:
    def __init__(
        self, base_url: str, api_key: str, store: Path | str, *, max_attempts: int = 30,
        max_seconds: float = 120.0, poll_seconds: float = 60.0, backoff_base: float = 0.25,
        backoff_cap: float = 5.0, timeout: float = 30.0, on_event: Callable[[Event], None] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.store = OperationStore(store)
        self.max_attempts, self.max_seconds, self.poll_seconds = max_attempts, max_seconds, poll_seconds
        self.backoff_base, self.backoff_cap = backoff_base, backoff_cap
        self.on_event = on_event or (lambda event: None)
        self.http = httpx.Client(timeout=httpx.Timeout(timeout, connect=5.0),
                                 limits=httpx.Limits(max_connections=100, max_keepalive_connections=20,
                                                     keepalive_expiry=KEEP_ALIVE_SECONDS),
                                 headers={"Authorization": f"Bearer {api_key}"})

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> PaymentsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def key_for(self, operation_id: str) -> str | None:
        record = self.store.get(operation_id)
        return record and record["key"]

    def pay(self, operation_id: str, payment: dict[str, Any]) -> dict[str, Any]:
        """Make the payment `operation_id` exactly once; its final payment JSON."""
        record = self.store.get(operation_id)
        if record is None:  # rules 1 and 2: mint once, persist before the first attempt
            record = self.store.put(operation_id, key=str(uuid.uuid4()), payment=payment, state="pending")
            self._emit("key-created", operation_id, record["key"])
        elif record["payment"] != payment:
            raise ValueError(f"operation {operation_id!r} was stored with a different body: "
                             "a new payment needs a new operation id (and so a new key)")
        else:
            self._emit("key-reused", operation_id, record["key"], detail=record["state"])
            if record["state"] == "done":
                return record["result"]
        key = record["key"]
        response = self._post(operation_id, key, "/v1/payments", payment)
        result = response.json()
        if response.status_code == 202:
            result = self._poll(operation_id, key, response)
        self.store.put(operation_id, state="done", result=result, status_code=response.status_code,
                       response_text=response.text, replayed=response.headers.get("Idempotent-Replayed") == "true")
        self._emit("done", operation_id, key, detail=result.get("status"))
        return result

    def _post(self, operation_id: str, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST `body` to `path` under `key` until an answer that is not transient (rules 3 and 4)."""
        deadline = time.monotonic() + self.max_seconds
        last = "no attempt made"
        for attempt in range(1, self.max_attempts + 1):
            wait = self._backoff(attempt)
            try:
                response = self.http.post(f"{self.base_url}{path}", json=body, headers={"Idempotency-Key": key})
            except httpx.TransportError as exc:  # rule 3: same key, so resending is safe
                last = describe(exc)
                self._emit("transport-error", operation_id, key, attempt, detail=last)
            else:
                problem = problem_of(response) or {}
                slug = str(problem.get("type", "")).rsplit("/", 1)[-1] or None
                after = retry_after(response)
                self._emit("response", operation_id, key, attempt, status=response.status_code, retry_after=after,
                           replayed=response.headers.get("Idempotent-Replayed") == "true", problem=slug,
                           detail=problem.get("detail"))
                if response.status_code < 300:
                    return response
                transient = response.status_code in (429,) or response.status_code >= 500 or (
                    response.status_code == 409 and slug == "request-in-progress")
                if not transient:  # rule 4
                    problem = problem or {"status": response.status_code, "detail": response.text[:200]}
                    self.store.put(operation_id, state="refused", problem=problem)
                    raise problem_error(response.status_code, problem)
                last = f"HTTP {response.status_code} {slug or ''}".strip()
                wait = after if after is not None else wait
            if attempt == self.max_attempts or time.monotonic() + wait > deadline:
                break
            self._emit("wait", operation_id, key, attempt, seconds=wait)
            time.sleep(wait)
        self._emit("gave-up", operation_id, key, detail=last)
        raise RetriesExhausted(f"operation {operation_id!r} (key {key}): no final answer; last: {last}. "
                               "It stays pending in the store: call it again to resume it.")

    def _poll(self, operation_id: str, key: str, response: httpx.Response) -> dict[str, Any]:
        payment = response.json()
        location = self.base_url + response.headers["Location"]
        wait = retry_after(response) or 1.0
        deadline = time.monotonic() + self.poll_seconds
        while payment.get("status") not in FINAL:  # rule 5
            if time.monotonic() + wait > deadline:
                raise StillProcessing(f"payment {payment.get('id')} still {payment.get('status')}", payment)
            time.sleep(wait)
            try:
                polled = self.http.get(location)
            except httpx.TransportError as exc:
                self._emit("transport-error", operation_id, key, detail=describe(exc))
                continue
            if polled.status_code == 200:
                payment = polled.json()
            self._emit("poll", operation_id, key, status=polled.status_code, detail=payment.get("status"))
            if polled.status_code == 200:
                continue
            if polled.status_code != 429 and polled.status_code < 500:
                raise ProblemError(polled.status_code, problem_of(polled) or {"status": polled.status_code})
        return payment

    # -- refunds -------------------------------------------------------------------------------------

    @staticmethod
    def refund_operation(payment_id: str, reference: str) -> str:
        """The store's name for a refund: the service's own identity for it (a reference is unique per payment)."""
        return f"refund:{payment_id}:{reference}"

    def create_refund(
        self, payment_id: str, amount: int | None = None, *, reference: str, reason: str | None = None,
        idempotency_key: str | None = None,
    ) -> Refund:
        """Refund `amount` (None: everything still refundable) of a payment, exactly once.

        Returns the refund: succeeded or failed (final), or pending (the PSP
        has not settled it: call again later, with the same arguments, or
        `get_refund`). A refused one is raised: DuplicateRefund,
        RefundExceedsPayment, PaymentNotRefundable, or a ProblemError.
        A refund that failed refunded nothing and freed its reference:
        asked for again, it is a new refund, under a new key.
        """
        operation_id = self.refund_operation(payment_id, reference)
        body: dict[str, Any] = {"reference": reference}
        if amount is not None:
            body["amount"] = amount
        if reason is not None:
            body["reason"] = reason
        record = self.store.get(operation_id)
        again = record is not None and record["state"] == "done" and record["result"].get("status") == "failed"
        if record is None or again:  # rules 1 and 2, as for a payment
            record = self.store.put(operation_id, key=idempotency_key or str(uuid.uuid4()), payment=body,
                                    state="pending", result=None)
            self._emit("key-created", operation_id, record["key"], detail="a new key after a failed refund" if again else None)
        elif record["payment"] != body:
            raise ValueError(f"refund {reference!r} of payment {payment_id} was stored with a different body: "
                             "a different refund needs a different reference")
        elif idempotency_key is not None and idempotency_key != record["key"]:
            raise ValueError(f"refund {reference!r} of payment {payment_id} was already sent under key "
                             f"{record['key']}: a retry must carry that key")
        else:
            self._emit("key-reused", operation_id, record["key"], detail=record["state"])
            if record["state"] == "done":
                return Refund.of(record["result"])
        key = record["key"]
        response = self._post(operation_id, key, f"/v1/payments/{payment_id}/refunds", body)
        refund = Refund.of(response.json())
        # Rule 6: done only when final. A pending refund keeps its key for the next call.
        self.store.put(operation_id, state="done" if refund.final else "pending", result=refund.raw,
                       status_code=response.status_code, response_text=response.text,
                       replayed=response.headers.get("Idempotent-Replayed") == "true")
        self._emit("done" if refund.final else "pending", operation_id, key, status=response.status_code,
                   detail=refund.status)
        return refund

    def get_refund(self, refund_id: str) -> Refund:
        """A refund by id (its status now)."""
        return Refund.of(self._get(f"/v1/refunds/{refund_id}").json())

    def list_refunds(self, payment_id: str, after: str | None = None, limit: int = 20) -> RefundPage:
        """One page of a payment's refunds, oldest first (`limit` 1..100), after the refund id `after`."""
        params: dict[str, Any] = {"limit": limit}
        if after is not None:
            params["after"] = after
        body = self._get(f"/v1/payments/{payment_id}/refunds", params).json()
        return RefundPage([Refund.of(r) for r in body["data"]], body["has_more"], body["next_after"],
                          body["amount_refundable"])

    def iter_refunds(self, payment_id: str, limit: int = 100) -> Iterator[Refund]:
        """Every refund of a payment, oldest first, a page at a time."""
        after = None
        while True:
            page = self.list_refunds(payment_id, after=after, limit=limit)
            yield from page.data
            if not page.has_more:
                return
            after = page.next_after

    def _get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        """GET `path`, retrying what is transient (a read is always safe to repeat), bounded like a POST."""
        deadline = time.monotonic() + self.max_seconds
        last = "no attempt made"
        for attempt in range(1, self.max_attempts + 1):
            wait = self._backoff(attempt)
            try:
                response = self.http.get(f"{self.base_url}{path}", params=params)
            except httpx.TransportError as exc:
                last = describe(exc)
            else:
                if response.status_code < 300:
                    return response
                if response.status_code != 429 and response.status_code < 500:
                    raise problem_error(response.status_code,
                                        problem_of(response) or {"status": response.status_code})
                last = f"HTTP {response.status_code}"
                wait = retry_after(response) or wait
            if attempt == self.max_attempts or time.monotonic() + wait > deadline:
                break
            time.sleep(wait)
        raise RetriesExhausted(f"GET {path}: no answer; last: {last}")

    def _backoff(self, attempt: int) -> float:
        """About base * 2^(attempt-1), capped, with jitter so failed clients do not retry in step."""
        ceiling = min(self.backoff_cap, self.backoff_base * 2 ** (attempt - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def _emit(self, kind: str, operation_id: str, key: str, attempt: int = 0, **fields: Any) -> None:
        self.on_event(Event(kind, operation_id, key, attempt, **fields))
