"""What the PSP and the rail hold for a payment, asked the way a resumer asks them.

The console uses the rails clients' own probes (app/rails/gateways.py): the
charge and the refund by their derived keys K1 and K3, the transfer by its
end-to-end reference, and each of the client's refunds by its K5. So it shows exactly what the service itself would learn
if it resumed the payment now, from the real PSP or rail as from the fakes,
and never anything a fake alone could tell.

Called after the console's database reads have returned their connection:
no connection is held while the PSP or the rail answers (or does not). Each
ask is bounded by ASK_TIMEOUT_SECONDS; one that fails, times out or answers
something undocumented shows as "unavailable", and the page renders anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from app.rails.gateways import PSP, Rail
from app.rails.outcomes import Applied, NotFound, ProbeOutcome, Settling, Unknown

# A console page should not wait on a slow rail for the rail's full call timeout.
ASK_TIMEOUT_SECONDS = 3.0


@dataclass(frozen=True)
class Record:
    system: str  # "PSP" or "rail"
    what: str  # "charge", "transfer", "refund"
    asked_by: str  # "K1 ab12…", "end-to-end reference …"
    found: str  # "found" | "settling" | "no record" | "unavailable" | "not asked"
    id: str | None = None
    status: str | None = None
    reason: str | None = None  # decline code, reject reason; or why unavailable / not asked
    ours: str | None = None  # the id our payment row recorded for it

    @property
    def matches(self) -> bool | None:
        """Whether the external record is the one our payment row names (None: nothing to compare)."""
        if self.found != "found" or self.ours is None:
            return None
        return self.id == self.ours


async def records(psp: PSP, rail: Rail, payment: dict[str, Any], *, rail_deduplicates: bool,
                  refunds: Sequence[dict[str, Any]] = ()) -> list[Record]:
    """The charge, the transfer, the refund (where the payment has a key for them) and each client refund
    in `refunds` (rows with their K5), asked at once."""
    asks: list[tuple[Record, Awaitable[ProbeOutcome] | None]] = []
    charge_key = payment.get("psp_charge_key")
    if charge_key:
        asks.append((Record("PSP", "charge", f"K1 {charge_key}", "", ours=payment.get("psp_charge_id")),
                     psp.find_charge(charge_key)))
    e2e = payment.get("end_to_end_reference")
    if e2e:
        base = Record("rail", "transfer", f"end-to-end reference {e2e}", "", ours=payment.get("rail_transfer_id"))
        if rail_deduplicates:
            asks.append((base, rail.find_transfer(e2e)))
        else:
            # A legacy rail answers no probes: its statements (reconciliation) are the only record we get.
            asks.append((_replace(base, found="not asked", reason="a legacy rail answers no probes; see reconciliation"),
                         None))
    refund_key = payment.get("psp_refund_key")
    if refund_key:
        asks.append((Record("PSP", "refund", f"K3 {refund_key}", "", ours=payment.get("psp_refund_id")),
                     psp.find_refund(refund_key)))
    for refund in refunds:
        # One the PSP holds as pending answers Settling: shown as "settling", never as an error.
        asks.append((Record("PSP", "client refund", f"K5 {refund['psp_refund_key']}", "",
                            ours=refund.get("psp_refund_id")), psp.find_client_refund(refund["psp_refund_key"])))
    answers = await asyncio.gather(*(_bounded(ask) for _, ask in asks))
    return [_record(base, answer) for (base, _), answer in zip(asks, answers)]


async def _bounded(ask: Awaitable[ProbeOutcome] | None) -> ProbeOutcome | None:
    if ask is None:
        return None
    try:
        async with asyncio.timeout(ASK_TIMEOUT_SECONDS):
            return await ask
    except TimeoutError:
        return Unknown(f"no answer within {ASK_TIMEOUT_SECONDS:g} s")
    except Exception as exc:  # noqa: BLE001 - whatever broke, the page shows "unavailable", never a 500
        return Unknown(f"the ask failed ({type(exc).__name__})")


def _record(base: Record, answer: ProbeOutcome | None) -> Record:
    if answer is None:
        return base
    if isinstance(answer, Applied):
        r = answer.record
        reason = getattr(r, "decline_code", None) or getattr(r, "reject_reason", None) or getattr(r, "failure_code", None)
        return _replace(base, found="found", id=r.id, status=r.status, reason=reason)
    if isinstance(answer, NotFound):
        return _replace(base, found="no record")
    if isinstance(answer, Settling):
        return _replace(base, found="settling", reason=answer.reason)
    return _replace(base, found="unavailable", reason=answer.reason if isinstance(answer, Unknown) else None)


def _replace(base: Record, **changes: Any) -> Record:
    return replace(base, **changes)
