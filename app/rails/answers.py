"""The answers the PSP and the rail document, and nothing else.

An answer is *applied* only if it parses into one of these models: an `id`,
and a `status` from the system's documented list of final statuses. Anything
else (a body that is not JSON, a missing field, a status we have never been
told about, such as a rail's "pending") fails to parse, and the client turns
that into Unknown. This is the allow-list that keeps a surprise from being
read as a decline or a rejection: a status we do not know might mean the
money moved, so it can never free a reference or trigger a refund.

A status the system documents as not final yet (a client refund's
"pending") is not an answer either: it fails to parse like any other, and
the model names it in `settling`, so that the client reads it as Settling
(held, decided later) rather than Unknown.

    Charge        PSP charge            succeeded | declined
    Refund        PSP refund, ours      succeeded              (a compensation)
    ClientRefund  PSP refund, a client  succeeded | failed     pending: Settling
    Transfer      rail transfer         accepted | rejected
    Statement, SettlementReport         the rail's and the PSP's daily reports

Fields we do not use are ignored; fields we store are bounded, since they
come from outside.
"""

from __future__ import annotations

from datetime import date, datetime
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

_Short = Field(default=None, max_length=100)


class Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # Always set in an answer from the system itself (the client checks);
    # None only where reconciliation concluded a payout is absent.
    id: str | None = Field(default=None, max_length=100)

    # Documented statuses that are not final yet, each with the reason a
    # Settling outcome gives: held by the system, decided later.
    settling: ClassVar[dict[str, str]] = {}


class Charge(Answer):
    """The PSP's charge: final once succeeded (money captured) or declined (nothing captured)."""

    status: Literal["succeeded", "declined"]
    decline_code: str | None = _Short


class Refund(Answer):
    """The PSP's refund: the only final status it documents is succeeded."""

    status: Literal["succeeded"]


class ClientRefund(Answer):
    """The PSP's refund of a client's payment (several per charge, partial or full).

    Final once succeeded (the money goes back to the card) or failed (it does
    not, and the amount is the charge's to refund again). A refund the PSP
    holds as `pending` is neither: it does not parse, and reads as Settling.
    """

    status: Literal["succeeded", "failed"]
    failure_code: str | None = _Short
    amount: int = Field(gt=0)

    settling: ClassVar[dict[str, str]] = {"pending": "refund pending"}


class Transfer(Answer):
    """The rail's transfer: final once accepted (it will pay out) or rejected (it never will)."""

    status: Literal["accepted", "rejected"]
    reject_reason: str | None = _Short


class StatementEntry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    transfer_id: str = Field(max_length=100)
    end_to_end_reference: str = Field(max_length=35)
    amount: int
    currency: str = Field(max_length=3)


# The return reasons the rail documents (ISO 20022 codes). A return with any
# other code is refused, not guessed at: we cannot know what it means for
# the money (app/api/rail_notifications.py answers it with a problem).
RETURN_REASONS: dict[str, str] = {
    "AC01": "incorrect account number",
    "AC04": "account closed",
    "AC06": "account blocked",
    "AG01": "transaction forbidden on this account",
    "AM05": "duplication",
    "BE04": "missing creditor address",
    "MD07": "beneficiary deceased",
    "MS02": "not specified, reason by customer",
    "MS03": "not specified, reason by agent",
    "RR04": "regulatory reason",
}
ReturnReason = Literal[
    "AC01", "AC04", "AC06", "AG01", "AM05", "BE04", "MD07", "MS02", "MS03", "RR04",
]


class ReturnLine(BaseModel):
    """A returned transfer, as the statement's return line and the notification both carry it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    return_id: str = Field(min_length=1, max_length=100)
    transfer_id: str = Field(min_length=1, max_length=100)
    end_to_end_reference: str = Field(min_length=1, max_length=35)
    amount: int = Field(gt=0)
    currency: str = Field(min_length=3, max_length=3)
    reason_code: ReturnReason


class ReturnNotification(BaseModel):
    """The rail's notification of a return (POST /v1/rail/notifications), allow-listed.

    The only message type the rail documents is `transfer.returned`; a body
    that is anything else, or carries an unknown reason code, fails to parse
    and is refused.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    id: str = Field(min_length=1, max_length=100)
    type: Literal["transfer.returned"]
    data: ReturnLine


class Statement(BaseModel):
    """A day's statement: `final` once the day is closed and can no longer change."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    final: bool
    entries: list[StatementEntry]
    # Transfers returned and booked on this day (a rail that never returns
    # anything may leave the field out). Each line is checked against
    # ReturnLine by reconciliation, one by one: a line with a reason we do
    # not know is refused alone, not the whole statement with it.
    returns: list[dict[str, Any]] = []


class SettledRefund(BaseModel):
    """One line of the PSP's settlement report: a refund that became final that day."""

    # strict: an amount is a JSON number, never "40", and `final` a boolean,
    # never "yes"; a report that bends its types is refused, not read.
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    refund_id: str = Field(min_length=1, max_length=100)
    idempotency_key: str = Field(min_length=1, max_length=200)
    charge_id: str = Field(min_length=1, max_length=100)
    amount: int = Field(gt=0)
    currency: str = Field(min_length=3, max_length=3)
    # Only final refunds are reported; a line with any other status (a
    # pending one) refuses the whole report rather than being guessed at.
    status: Literal["succeeded", "failed"]
    failure_code: str | None = _Short
    settled_at: datetime


class SettlementReport(BaseModel):
    """The PSP's refunds settled on one UTC day: `final` once the day is closed and can no longer change."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    date: date
    final: bool
    refunds: list[SettledRefund]
