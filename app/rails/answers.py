"""The answers the PSP and the rail document, and nothing else.

An answer is *applied* only if it parses into one of these models: an `id`,
and a `status` from the system's documented list of final statuses. Anything
else (a body that is not JSON, a missing field, a status we have never been
told about, such as a rail's "pending") fails to parse, and the client turns
that into Unknown. This is the allow-list that keeps a surprise from being
read as a decline or a rejection: a status we do not know might mean the
money moved, so it can never free a reference or trigger a refund.

Fields we do not use are ignored; fields we store are bounded, since they
come from outside.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

_Short = Field(default=None, max_length=100)


class Answer(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    # Always set in an answer from the system itself (the client checks);
    # None only where reconciliation concluded a payout is absent.
    id: str | None = Field(default=None, max_length=100)


class Charge(Answer):
    """The PSP's charge: final once succeeded (money captured) or declined (nothing captured)."""

    status: Literal["succeeded", "declined"]
    decline_code: str | None = _Short


class Refund(Answer):
    """The PSP's refund: the only final status it documents is succeeded."""

    status: Literal["succeeded"]


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


class Statement(BaseModel):
    """A day's statement: `final` once the day is closed and can no longer change."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    final: bool
    entries: list[StatementEntry]
