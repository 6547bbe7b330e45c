"""The PSP and rail clients: External1, External2, the compensating refund, and clients' refunds.

They run between phases, with no transaction and no pooled database connection
held (the engine calls them outside `app.db.transaction`). Every POST carries
a derived idempotency key, so sending it again after a crash, a timeout or a
429 is a replay at the external system, never a second charge or transfer.

Every exchange ends as one of the outcomes of app/rails/outcomes.py, decided
here and only here, by an allow-list:

    2xx whose body parses as a documented answer   Applied
    2xx with a documented not-final status, an id  Settling (a client refund's "pending")
    2xx with anything else in it                   Unknown (never a decline)
    connection refused: nothing was sent           NotApplied
    429, or a 400/404/409 refusal                  NotApplied (documented as storing nothing)
    timeout, reset, not HTTP, 5xx, anything else   Unknown
  probes:
    200 with a documented answer                   Applied
    200 with a documented not-final status, an id  Settling
    404 with the documented not-found problem      NotFound
    anything else                                  Unknown
  daily reports (the rail's statement, the PSP's settlement report):
    200 with a body that parses                    the parsed report
    anything else                                  Unknown (statement), ReportUnavailable (settlement report)
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from datetime import date
from typing import Any, Protocol, TypeVar
from uuid import UUID

import httpx
from pydantic import ValidationError

from app.observability import metrics
from app.rails.answers import Answer, Charge, ClientRefund, Refund, SettlementReport, Statement, Transfer
from app.rails.outcomes import (
    Applied,
    CallOutcome,
    NotApplied,
    NotFound,
    ProbeOutcome,
    Settling,
    Unknown,
    outcome_class,
)

log = logging.getLogger(__name__)

A = TypeVar("A", bound=Answer)


class Payment(Protocol):
    """What the clients read of a payment: any object with these fields will do.

    The engine passes its own payment rows; this layer does not import them,
    so dependencies point one way (payments -> rails, never back).
    """

    id: UUID
    amount_minor: int
    net_minor: int
    currency: str
    card_token: str
    reference: str
    psp_charge_id: str | None
    end_to_end_reference: str | None
    beneficiary_iban: str
    beneficiary_name: str


class RefundRequest(Protocol):
    """What the PSP client reads of a client's refund: any object with these fields.

    `amount_minor` is this refund's amount, which may be part of the charge;
    `reference` is the refund's own, the one its answers and reports carry.
    """

    psp_charge_id: str
    amount_minor: int
    reference: str


class ReportUnavailable(Exception):
    """The PSP gave no usable settlement report: unreachable, not a 200, or a body that does not parse.

    Nothing is known about the day then; the caller asks again later.
    """

# Refusals both fakes document as "nothing was recorded" (docs/reference/fake-rails.md):
# rate limited, an invalid request, a refund of an unknown charge, a refund
# the charge cannot cover. A 422 is deliberately not here: it says our key is
# already stored, with another body.
_REFUSED = {400, 404, 409, 429}
# Worth an inline retry with the same key, a moment later: rate limiting, an
# overloaded server, a connection that could not be made.
_TRANSIENT = {429, 503}
# However long Retry-After says, an inline retry waits at most this long; a
# longer wait belongs to the client's retry or the recovery worker.
_MAX_INLINE_WAIT = 1.0
_RECONNECT_WAIT = 0.1


class ExternalService:
    def __init__(
        self, name: str, http: httpx.AsyncClient, base_url: str, timeout: float, transient_retries: int
    ) -> None:
        self.name = name
        self._http = http
        self._base = base_url.rstrip("/")
        self._timeout = timeout
        self._retries = transient_retries

    async def _send(
        self, path: str, key: str, body: dict[str, Any], answer: type[A], *, repeatable: bool = True
    ) -> CallOutcome:
        """POST with the derived key; transient refusals are retried inline, with the same key.

        On a system that cannot deduplicate (`repeatable=False`) only a
        NotApplied outcome is retried: after anything else the first POST
        may have been applied, and a second one could pay twice.
        """
        for attempt in range(self._retries + 1):
            outcome, wait = await self._post(path, key, body, answer)
            retry = wait is not None and (repeatable or isinstance(outcome, NotApplied))
            if not retry or attempt == self._retries:
                return outcome
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def _post(
        self, path: str, key: str, body: dict[str, Any], answer: type[A]
    ) -> tuple[CallOutcome, float | None]:
        """One POST: its outcome, and how long to wait before an inline retry (None: do not)."""
        started = time.perf_counter()
        outcome, wait = await self._exchange(path, key, body, answer)
        self._observe("send", outcome, started)
        return outcome, wait

    async def _exchange(
        self, path: str, key: str, body: dict[str, Any], answer: type[A]
    ) -> tuple[CallOutcome, float | None]:
        try:
            response = await self._http.post(
                self._base + path, json=body, headers={"Idempotency-Key": key}, timeout=self._timeout
            )
        except httpx.ConnectError:
            return NotApplied(f"{self.name}: cannot connect"), _RECONNECT_WAIT
        except Exception as exc:  # noqa: BLE001 - whatever broke, the call may have been applied
            return Unknown(self._broken(exc)), None
        if response.is_success:
            return self._answer(response, answer), None
        wait = _retry_after(response) if response.status_code in _TRANSIENT else None
        if response.status_code in _REFUSED:
            return NotApplied(f"{self.name}: refused (HTTP {response.status_code})"), wait
        return Unknown(f"{self.name}: HTTP {response.status_code}"), wait

    async def _probe(self, path: str, answer: type[A], params: dict[str, str] | None = None) -> ProbeOutcome:
        started = time.perf_counter()
        outcome = await self._ask(path, answer, params)
        self._observe("probe", outcome, started)
        return outcome

    async def _ask(self, path: str, answer: type[A], params: dict[str, str] | None) -> ProbeOutcome:
        try:
            response = await self._http.get(self._base + path, params=params, timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001 - a probe that breaks learns nothing
            return Unknown(self._broken(exc))
        if response.status_code == 200:
            return self._answer(response, answer)
        if response.status_code == 404 and _is_documented_not_found(response):
            return NotFound()
        return Unknown(f"{self.name}: probe answered HTTP {response.status_code}")

    def _answer(self, response: httpx.Response, answer: type[A]) -> Applied | Settling | Unknown:
        """Applied only if the body is a documented answer with an id (app/rails/answers.py);
        Settling if it is a record with an id in one of the answer's documented not-final statuses."""
        try:
            record = answer.model_validate_json(response.content)
        except ValidationError as exc:
            status = _status_field(response)
            if status in answer.settling and _has_id(response):
                return Settling(f"{self.name}: {answer.settling[status]}")
            if status is not None:
                log.warning("%s answered an undocumented %s status", self.name, answer.__name__.lower())
                return Unknown(f"{self.name}: undocumented status {status[:40]!r}")
            log.warning("%s answered a malformed %s: %s", self.name, answer.__name__.lower(), exc.error_count())
            return Unknown(f"{self.name}: malformed answer")
        if not record.id:
            return Unknown(f"{self.name}: answer without an id")
        return Applied(record)

    def _observe(self, call: str, outcome: CallOutcome | ProbeOutcome, started: float) -> None:
        """One exchange, in the latency histogram by system, call and outcome class (and a DEBUG line)."""
        seconds = time.perf_counter() - started
        kind = outcome_class(outcome)
        metrics.histogram(metrics.EXTERNAL_CALLS, self.name, call, kind).observe(seconds)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("%s %s: %s in %.1f ms", self.name, call, kind, seconds * 1000)

    def _broken(self, exc: Exception) -> str:
        """A short, classified reason for a broken exchange: no URL, no exception text."""
        if isinstance(exc, httpx.TimeoutException):
            return f"{self.name}: timed out"
        if isinstance(exc, httpx.RemoteProtocolError):
            return f"{self.name}: no valid HTTP answer"
        if isinstance(exc, httpx.TransportError):
            return f"{self.name}: connection lost"
        log.warning("%s exchange failed unexpectedly: %s", self.name, type(exc).__name__)
        return f"{self.name}: unexpected transport error"


class PSP(ExternalService):
    """External system 1: charges the payer's card, refunds it if the payout fails or a client asks,
    and reports the refunds it settled each day."""

    def __init__(self, http: httpx.AsyncClient, base_url: str, timeout: float, transient_retries: int) -> None:
        super().__init__("psp", http, base_url, timeout, transient_retries)

    async def charge(self, key: str, payment: Payment) -> CallOutcome:
        return await self._send(
            "/v1/charges",
            key,
            {
                "amount": payment.amount_minor,
                "currency": payment.currency,
                "card_token": payment.card_token,
                "reference": payment.reference,
                "description": f"payment {payment.id}",
            },
            Charge,
        )

    async def find_charge(self, key: str) -> ProbeOutcome:
        return await self._probe("/v1/charges", Charge, {"idempotency_key": key})

    async def refund(self, key: str, payment: Payment, *, amount: int) -> CallOutcome:
        """Refund `amount` (minor units) of the payment's charge: a compensation, read as Refund."""
        return await self._send(
            "/v1/refunds",
            key,
            {"charge_id": payment.psp_charge_id, "amount": amount, "reference": payment.reference},
            Refund,
        )

    async def find_refund(self, key: str) -> ProbeOutcome:
        return await self._probe("/v1/refunds", Refund, {"idempotency_key": key})

    # A client's refund is the same PSP call as our compensation, read by a
    # wider allow-list: it may fail at the PSP (failed, its amount given
    # back to the charge) or be held before it settles (pending: Settling,
    # probed again, never sent again).

    async def client_refund(self, key: str, refund: RefundRequest) -> CallOutcome:
        return await self._send(
            "/v1/refunds",
            key,
            {"charge_id": refund.psp_charge_id, "amount": refund.amount_minor, "reference": refund.reference},
            ClientRefund,
        )

    async def find_client_refund(self, key: str) -> ProbeOutcome:
        return await self._probe("/v1/refunds", ClientRefund, {"idempotency_key": key})

    async def settlement_report(self, day: date) -> SettlementReport:
        """The PSP's report of the refunds settled on `day` (UTC), `final` once the day is closed.

        Raises ReportUnavailable on a broken exchange, a status other than
        200 or a body that does not parse: never a partial or guessed report.
        """
        started = time.perf_counter()
        outcome = "unknown"
        try:
            report = await self._settlement_report(day)
            outcome = "applied"
            return report
        finally:
            metrics.histogram(metrics.EXTERNAL_CALLS, self.name, "statement", outcome).observe(
                time.perf_counter() - started
            )

    async def _settlement_report(self, day: date) -> SettlementReport:
        try:
            response = await self._http.get(f"{self._base}/v1/settlements/{day.isoformat()}", timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001 - whatever broke, there is no report
            raise ReportUnavailable(self._broken(exc)) from exc
        if response.status_code != 200:
            raise ReportUnavailable(f"psp: settlement report answered HTTP {response.status_code}")
        try:
            report = SettlementReport.model_validate_json(response.content)
        except ValidationError:
            raise ReportUnavailable("psp: malformed settlement report") from None
        if report.date != day:
            raise ReportUnavailable(f"psp: settlement report for {report.date}, not {day}")
        return report


class Rail(ExternalService):
    """External system 2: pays the net amount out to the beneficiary's account."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        base_url: str,
        timeout: float,
        transient_retries: int,
        *,
        legacy: bool = False,
        legacy_accounts: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__("rail", http, base_url, timeout, transient_retries)
        self._legacy = legacy
        self._legacy_accounts = legacy_accounts

    def deduplicates(self, payment: Payment) -> bool:
        """Whether sending this payout twice is safe (keys honoured, probes answered)."""
        return not (self._legacy or payment.beneficiary_iban in self._legacy_accounts)

    async def transfer(self, key: str, payment: Payment) -> CallOutcome:
        # A rail that cannot deduplicate is sent a payout again only when the
        # first POST was certainly not applied (see _send).
        return await self._send(
            "/v1/transfers",
            key,
            {
                "end_to_end_reference": payment.end_to_end_reference,
                "amount": payment.net_minor,
                "currency": payment.currency,
                "beneficiary_iban": payment.beneficiary_iban,
                "beneficiary_name": payment.beneficiary_name,
                "reference": payment.reference,
            },
            Transfer,
            repeatable=self.deduplicates(payment),
        )

    async def find_transfer(self, end_to_end_reference: str) -> ProbeOutcome:
        # The rail is probed by our end-to-end reference, which every payout
        # instruction carries precisely so that this lookup is possible.
        return await self._probe(f"/v1/transfers/{end_to_end_reference}", Transfer)

    async def statement(self, day: date) -> dict[str, Any] | Unknown:
        """The rail's statement of transfers booked on `day` (`final` once the day is closed)."""
        started = time.perf_counter()
        statement = await self._statement(day)
        metrics.histogram(metrics.EXTERNAL_CALLS, self.name, "statement",
                          "unknown" if isinstance(statement, Unknown) else "applied").observe(time.perf_counter() - started)
        return statement

    async def _statement(self, day: date) -> dict[str, Any] | Unknown:
        try:
            response = await self._http.get(f"{self._base}/v1/statements/{day.isoformat()}", timeout=self._timeout)
        except Exception as exc:  # noqa: BLE001
            return Unknown(self._broken(exc))
        if response.status_code != 200:
            return Unknown(f"rail: statement answered HTTP {response.status_code}")
        try:
            return Statement.model_validate_json(response.content).model_dump()
        except ValidationError:
            return Unknown("rail: malformed statement")


def _is_documented_not_found(response: httpx.Response) -> bool:
    """The fakes' documented "no such record": a problem+json of type .../not-found.

    A bare 404 (a proxy's page, a mistyped URL) says nothing about our record.
    """
    if response.headers.get("content-type", "").split(";")[0].strip() != "application/problem+json":
        return False
    try:
        problem = response.json()
    except ValueError:
        return False
    return isinstance(problem, dict) and str(problem.get("type", "")).endswith("/not-found")


def _has_id(response: httpx.Response) -> bool:
    """Whether the body names its record: a non-empty, bounded `id` (as Answer bounds it)."""
    try:
        body = response.json()
    except ValueError:
        return False
    record_id = body.get("id") if isinstance(body, dict) else None
    return isinstance(record_id, str) and 0 < len(record_id) <= 100


def _status_field(response: httpx.Response) -> str | None:
    try:
        body = response.json()
    except ValueError:
        return None
    status = body.get("status") if isinstance(body, dict) else None
    return status if isinstance(status, str) else None


def _retry_after(response: httpx.Response) -> float:
    try:
        seconds = float(response.headers.get("Retry-After", "0.2"))
    except ValueError:
        seconds = 0.2
    if not math.isfinite(seconds):
        seconds = 0.2
    return min(max(seconds, 0.05), _MAX_INLINE_WAIT)
