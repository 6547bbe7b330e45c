"""The PSP and rail clients: External1, External2 and the compensating refund.

They run between phases, with no transaction and no pooled database connection
held (the runner calls them outside `app.db.transaction`). Every POST carries
a derived idempotency key, so sending it again after a crash, a timeout or a
429 is a replay at the external system, never a second charge or transfer.
"""

from __future__ import annotations

import asyncio
from datetime import date
from typing import Any

import httpx

from app.payments.models import Payment
from app.rails.outcomes import Applied, CallOutcome, NotFound, ProbeOutcome, Unknown

# Statuses that promise nothing was applied and a retry may succeed.
_TRANSIENT = {429, 503}
# However long Retry-After says, an inline retry waits at most this long; a
# longer wait belongs to the client's retry or the recovery worker.
_MAX_INLINE_WAIT = 1.0


class ExternalService:
    def __init__(self, http: httpx.AsyncClient, base_url: str, timeout: float, transient_retries: int) -> None:
        self._http = http
        self._base = base_url.rstrip("/")
        self._timeout = timeout
        self._retries = transient_retries

    async def _send(self, path: str, key: str, body: dict[str, Any], *, retries: int | None = None) -> CallOutcome:
        retries = self._retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                response = await self._http.post(
                    self._base + path, json=body, headers={"Idempotency-Key": key}, timeout=self._timeout
                )
            except httpx.ConnectError as exc:
                # The connection was never made, so nothing was sent: retryable.
                last, wait = Unknown(f"cannot connect to {self._base}: {exc}"), 0.1
            except httpx.HTTPError as exc:
                # A timeout or a connection lost after sending: it may have applied.
                return Unknown(f"{type(exc).__name__} calling {path}")
            else:
                if response.status_code in (200, 201):
                    return Applied(response.json())
                if response.status_code not in _TRANSIENT:
                    return Unknown(f"HTTP {response.status_code} from {path}: {response.text[:200]}")
                last = Unknown(f"HTTP {response.status_code} from {path} after {attempt + 1} tries")
                wait = _retry_after(response)
            if attempt < retries:
                await asyncio.sleep(wait)
        return last

    async def _probe(self, path: str, params: dict[str, str] | None = None) -> ProbeOutcome:
        try:
            response = await self._http.get(self._base + path, params=params, timeout=self._timeout)
        except httpx.HTTPError as exc:
            return Unknown(f"probe {path} failed: {type(exc).__name__}")
        if response.status_code == 200:
            return Applied(response.json())
        if response.status_code == 404:
            return NotFound()
        return Unknown(f"probe {path}: HTTP {response.status_code}")


class PSP(ExternalService):
    """External system 1: charges the payer's card, and refunds it if the payout fails."""

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
        )

    async def find_charge(self, key: str) -> ProbeOutcome:
        return await self._probe("/v1/charges", {"idempotency_key": key})

    async def refund(self, key: str, payment: Payment) -> CallOutcome:
        return await self._send(
            "/v1/refunds",
            key,
            {"charge_id": payment.psp_charge_id, "amount": payment.amount_minor, "reference": payment.reference},
        )

    async def find_refund(self, key: str) -> ProbeOutcome:
        return await self._probe("/v1/refunds", {"idempotency_key": key})


class Rail(ExternalService):
    """External system 2: pays the net amount out to the beneficiary's account."""

    def __init__(self, *args: Any, legacy: bool = False, legacy_accounts: frozenset[str] = frozenset()) -> None:
        super().__init__(*args)
        self._legacy = legacy
        self._legacy_accounts = legacy_accounts

    def deduplicates(self, payment: Payment) -> bool:
        """Whether sending this payout twice is safe (keys honoured, probes answered)."""
        return not (self._legacy or payment.beneficiary_iban in self._legacy_accounts)

    async def transfer(self, key: str, payment: Payment) -> CallOutcome:
        # A rail that cannot deduplicate gets exactly one try, even after a 429
        # or a 503: we cannot be sure those were not applied, and a second
        # POST there is a second payout.
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
            retries=None if self.deduplicates(payment) else 0,
        )

    async def find_transfer(self, end_to_end_reference: str) -> ProbeOutcome:
        # The rail is probed by our end-to-end reference, which every payout
        # instruction carries precisely so that this lookup is possible.
        return await self._probe(f"/v1/transfers/{end_to_end_reference}")

    async def statement(self, day: date) -> dict[str, Any] | Unknown:
        """The rail's statement of transfers booked on `day` (`final` once the day is closed)."""
        try:
            response = await self._http.get(f"{self._base}/v1/statements/{day.isoformat()}", timeout=self._timeout)
        except httpx.HTTPError as exc:
            return Unknown(f"statement {day}: {type(exc).__name__}")
        if response.status_code != 200:
            return Unknown(f"statement {day}: HTTP {response.status_code}")
        return response.json()


def _retry_after(response: httpx.Response) -> float:
    try:
        seconds = float(response.headers.get("Retry-After", "0.2"))
    except ValueError:
        seconds = 0.2
    return min(max(seconds, 0.05), _MAX_INLINE_WAIT)
