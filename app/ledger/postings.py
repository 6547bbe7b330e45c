"""Ledger postings, written by the phase that learns the money moved.

Each posting is a set of entries whose debits equal their credits, so every
payment's entries balance after every phase. The accounts:

    psp_receivable       what the PSP owes us for captured charges (asset)
    beneficiary_payable  what we owe beneficiaries until the rail pays them (liability)
    fee_revenue          our fees (income)
    rail_settlement      money sent out over the rail (asset, decreasing)
    client_receivable    what a client owes us for the refunds we made for it after
                         its payout was sent (asset)

The table's UNIQUE (payment_id, posting, account) means a posting can land
only once per payment, even if a bug upstream tried to run a phase twice.
"""

from __future__ import annotations

from typing import Protocol


class Payment(Protocol):
    """The amounts a posting needs: any object with these fields (the payment row) will do."""

    amount_minor: int
    net_minor: int
    fee_minor: int
    return_refund_minor: int | None


def charge_captured(p: Payment) -> list[tuple[str, int, int]]:
    """Handler2: the PSP captured the amount; the net is owed on, the fee is ours."""
    return [
        ("psp_receivable", p.amount_minor, 0),
        ("beneficiary_payable", 0, p.net_minor),
        ("fee_revenue", 0, p.fee_minor),
    ]


def payout_sent(p: Payment) -> list[tuple[str, int, int]]:
    """Handler3: the rail accepted the payout; we no longer owe the beneficiary."""
    return [("beneficiary_payable", p.net_minor, 0), ("rail_settlement", 0, p.net_minor)]


def payout_returned(p: Payment) -> list[tuple[str, int, int]]:
    """The rail returned an accepted payout: the money is back, and owed on again (to the payer now)."""
    return [("rail_settlement", p.net_minor, 0), ("beneficiary_payable", 0, p.net_minor)]


def charge_refunded(p: Payment) -> list[tuple[str, int, int]]:
    """Compensation: the payout was rejected (or returned) and the charge refunded, fee included.

    A returned payout's compensation refunds only what the client's refunds
    had not already taken (`return_refund_minor`); those the client funded,
    and with the payout back the client owes them no longer.
    """
    refunded = p.amount_minor if p.return_refund_minor is None else p.return_refund_minor
    return [
        ("beneficiary_payable", p.net_minor, 0),
        ("fee_revenue", p.fee_minor, 0),
        ("psp_receivable", 0, refunded),
        ("client_receivable", 0, p.amount_minor - refunded),
    ]


def refund_succeeded(amount_minor: int) -> list[tuple[str, int, int]]:
    """A client's refund, after its payout was sent: the client funds it, and our fee stays ours."""
    return [("client_receivable", amount_minor, 0), ("psp_receivable", 0, amount_minor)]


def refund_posting(refund_id: object) -> str:
    """A client refund's posting name: one per refund, so a payment may have many, each landing once."""
    return f"refund:{refund_id}"


def posted(payment: str = "updated.id") -> str:
    """The legs of a posting, as one CTE of a phase's statement (app/machine/statements.py).

    Inserted FROM `updated`, the row the phase's fenced UPDATE returned (a
    payment; a refund names its payment in `payment`), so a stale owner's
    statement posts nothing. The parameters come from `legs`.
    """
    return f"""
    INSERT INTO ledger_entry (payment_id, posting, account, debit_minor, credit_minor, currency)
    SELECT {payment}, CAST(:posting AS text), leg.account, leg.debit, leg.credit, updated.currency
      FROM updated,
           unnest(CAST(:accounts AS text[]), CAST(:debits AS bigint[]), CAST(:credits AS bigint[]))
             AS leg(account, debit, credit)
"""


POSTED = posted()  # the payment's own phases


def legs(posting: str, entries: list[tuple[str, int, int]]) -> dict[str, object]:
    """The posting as statement parameters, checked to balance before it is written."""
    # Zero-amount legs (a zero fee) carry no information and would break the
    # one-sided CHECK, so they are left out.
    entries = [e for e in entries if e[1] or e[2]]
    if sum(e[1] for e in entries) != sum(e[2] for e in entries):
        raise AssertionError(f"unbalanced posting {posting}: {entries}")
    accounts, debits, credits = zip(*entries)
    return dict(posting=posting, accounts=list(accounts), debits=list(debits), credits=list(credits))
