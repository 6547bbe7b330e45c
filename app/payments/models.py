"""What a payment is: the request a client sends, the row we keep, the view we return.

The request model is also the fingerprint's input: two bodies that validate to
the same `PaymentRequest` are the same payment.
"""

from __future__ import annotations

import unicodedata
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Literal

from pydantic import (
    BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, field_validator, model_validator,
)

from app.iban import normalise as normalise_iban

# ISO 4217 codes we settle, with their minor-unit exponent (for people reading
# amounts; the service itself only ever handles integer minor units).
CURRENCIES = {"EUR": 2, "GBP": 2, "USD": 2, "CHF": 2, "SEK": 2, "DKK": 2, "NOK": 2, "PLN": 2, "JPY": 0}
MAX_AMOUNT_MINOR = 1_000_000_000  # ten million in a two-decimal currency

# Our fee: 1.4% rounded up, plus a fixed 25 minor units. Integers only: money
# is never a float here.
FEE_BASIS_POINTS = 140
FEE_FIXED_MINOR = 25

PaymentStatus = Literal["processing", "succeeded", "declined", "failed", "indeterminate", "returned", "refunded"]

# Free text (a name, a reference) is checked and normalised before anything
# else looks at it, so that what is stored, fingerprinted and sent to the rail
# is one spelling of what the client meant:
#
# * NFC: "é" may arrive as one code point (U+00E9) or as "e" plus a combining
#   accent (U+0065 U+0301), depending on the keyboard and the OS that typed
#   it. Both are the same name; without NFC a retry from another system would
#   be a different fingerprint, and the same key would answer 422.
# * Refused: control characters (category Cc: C0, DEL, C1), format characters
#   (Cf: the bidirectional overrides and isolates U+202A-U+202E and
#   U+2066-U+2069, the marks U+200E/U+200F, invisible separators, the BOM),
#   line and paragraph separators (Zl, Zp) and lone surrogates (Cs). They draw
#   nothing or reorder what is drawn, so a name could show one thing on a
#   statement and be another ("Ada" plus U+202E reversing the rest), and they
#   break log lines. Allowed among Cf: the zero-width joiner and non-joiner
#   (U+200D, U+200C), which Persian and the Indic scripts need to spell
#   names correctly and which cannot reorder text.
_REFUSED_CATEGORIES = {"Cc", "Cf", "Cs", "Zl", "Zp"}
_ALLOWED_FORMAT = {"\u200c", "\u200d"}


def plain_text(value: object) -> object:
    if not isinstance(value, str):
        return value  # not text at all: the str type refuses it, with its own message
    value = unicodedata.normalize("NFC", value)
    for char in value:
        if unicodedata.category(char) in _REFUSED_CATEGORIES and char not in _ALLOWED_FORMAT:
            name = f" ({unicodedata.name(char)})" if unicodedata.name(char, "") else ""
            raise ValueError(f"must not contain U+{ord(char):04X}{name}: control and formatting characters are refused")
    return value


# The validator runs first (it is the last Before), then the constraints see the NFC text.
Reference = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:/-]{1,64}$"), BeforeValidator(plain_text)]
CardToken = Annotated[str, StringConstraints(pattern=r"^tok_[A-Za-z0-9_]{1,64}$")]
Name = Annotated[str, StringConstraints(min_length=1, max_length=140), BeforeValidator(plain_text)]


def fee_for(amount_minor: int) -> int:
    return -(-amount_minor * FEE_BASIS_POINTS // 10_000) + FEE_FIXED_MINOR


class Beneficiary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Name = Field(description="Account holder's name, as the rail will show it.")
    iban: str = Field(
        description="The account's IBAN, electronic (`DE89370400440532013000`) or print form "
        "(`DE89 3704 0044 0532 0130 00`, any case). Stored, fingerprinted and returned in "
        "electronic form.",
        examples=["DE89370400440532013000"],
    )

    @field_validator("iban")
    @classmethod
    def _iban(cls, value: str) -> str:
        # Normalised here, before the fingerprint is taken: the same account
        # written with spaces is the same payment, not a 422 on a retry.
        return normalise_iban(value)


class PaymentRequest(BaseModel):
    """Charge `card_token` for `amount` and pay it out, less our fee, to `beneficiary`."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "amount": 1250,
                    "currency": "EUR",
                    "reference": "order-1001",
                    "card_token": "tok_visa",
                    "beneficiary": {"name": "Ada Lovelace", "iban": "DE89370400440532013000"},
                }
            ]
        },
    )

    amount: int = Field(strict=True, gt=0, le=MAX_AMOUNT_MINOR, description="Minor units (cents).")
    currency: str = Field(description="ISO 4217 code.", examples=["EUR"])
    reference: Reference = Field(
        description="Your identifier for what is being paid (an order, an invoice). "
        "A second payment with a reference that is in progress or paid is refused (409); "
        "after a decline or a refunded failure the reference may be tried again."
    )
    card_token: CardToken = Field(description="The payer's card, tokenised at the PSP.")
    beneficiary: Beneficiary

    @field_validator("currency")
    @classmethod
    def _currency(cls, value: str) -> str:
        if value not in CURRENCIES:
            raise ValueError(f"currency must be one of {', '.join(sorted(CURRENCIES))}")
        return value

    @model_validator(mode="after")
    def _covers_fee(self) -> PaymentRequest:
        if self.amount <= fee_for(self.amount):
            raise ValueError(f"amount {self.amount} does not cover the fee of {fee_for(self.amount)}")
        return self


@dataclass(frozen=True, kw_only=True)
class Payment:
    """A row of the `payment` table.

    The fields without a default are what Handler1 writes and the two
    timestamps the database sets then; every other field starts as the
    table's default says and is filled in by a later phase. So Handler1 can
    build the payment it created from what it wrote (app/payments/phases.py),
    and each later phase replaces only the columns it changed.
    """

    id: uuid.UUID
    client_id: int
    reference: str
    amount_minor: int
    currency: str
    fee_minor: int
    net_minor: int
    card_token: str
    beneficiary_name: str
    beneficiary_iban: str
    status: str
    end_to_end_reference: str | None
    psp_charge_key: str | None
    created_at: datetime
    updated_at: datetime
    psp_charge_id: str | None = None
    decline_code: str | None = None
    rail_transfer_key: str | None = None
    rail_transfer_id: str | None = None
    reject_reason: str | None = None
    psp_refund_key: str | None = None
    psp_refund_id: str | None = None
    payout_instructed_at: datetime | None = None
    return_id: str | None = None
    return_reason: str | None = None
    returned_at: datetime | None = None
    # Refunded, or reserved for a refund in flight: client refunds and our
    # compensations together (app/payments/refunds/). Never above amount_minor.
    refunded_minor: int = 0
    return_refund_minor: int | None = None  # what a returned payout's compensation refunds
    # False once the payment ended without moving money (declined, or failed):
    # the order's reference is free again (migration 0014 says why a column).
    holds_reference: bool = True

    @property
    def refundable_minor(self) -> int:
        """What a client refund may still take: the charge less every refund made or reserved, once paid out."""
        return self.amount_minor - self.refunded_minor if self.status == "succeeded" else 0


class Failure(BaseModel):
    stage: Literal["charge", "payout", "return"]
    code: str
    message: str


class BeneficiaryView(BaseModel):
    name: str
    iban: str


class PaymentView(BaseModel):
    """The payment as a client sees it, in a POST response and from GET."""

    id: uuid.UUID
    object: Literal["payment"] = "payment"
    status: PaymentStatus = Field(
        description="`processing` while the outcome is not yet known (never a failure); "
        "`indeterminate` when repeated attempts could not learn it and reconciliation will; "
        "`succeeded`, `declined` or `failed` once final. A succeeded payout the beneficiary's bank "
        "sends back later becomes `returned` (the refund of the card is under way) and then "
        "`refunded` (final). A POST replay still answers the response first stored."
    )
    reference: str
    amount: int
    currency: str
    fee: int
    net_amount: int
    beneficiary: BeneficiaryView
    end_to_end_reference: str | None
    failure: Failure | None
    created_at: datetime

    @classmethod
    def of(cls, payment: Payment) -> PaymentView:
        return cls(
            id=payment.id,
            status=payment.status,  # type: ignore[arg-type]
            reference=payment.reference,
            amount=payment.amount_minor,
            currency=payment.currency,
            fee=payment.fee_minor,
            net_amount=payment.net_minor,
            beneficiary=BeneficiaryView(name=payment.beneficiary_name, iban=payment.beneficiary_iban),
            # Written when the payment is created, but a client hears of it
            # only once the payout is instructed: a declined card's payment
            # never had one.
            end_to_end_reference=payment.end_to_end_reference if payment.payout_instructed_at else None,
            failure=_failure(payment),
            created_at=payment.created_at,
        )

    def body(self) -> str:
        """The exact text we send and store; a replay sends these bytes again."""
        return self.model_dump_json()


def _failure(payment: Payment) -> Failure | None:
    if payment.status == "declined":
        return Failure(
            stage="charge",
            code=payment.decline_code or "declined",
            message="The card was declined by the PSP; nothing was charged.",
        )
    if payment.status in ("returned", "refunded"):
        done = "was refunded in full" if payment.status == "refunded" else "is being refunded in full"
        return Failure(
            stage="return",
            code=payment.return_reason or "returned",
            message=f"The beneficiary's bank returned the payout; the charge {done}.",
        )
    if payment.status == "failed":
        return Failure(
            stage="payout",
            code=payment.reject_reason or "rejected",
            message="The payout did not reach the beneficiary; the charge was refunded in full.",
        )
    return None
