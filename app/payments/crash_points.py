"""The named points where a process can be made to die, for crash tests and demos.

A process started with `PAYMENTS_CRASH_AT=<point>` dies the first time it
reaches that point (app/machine/crash.py); `validate` refuses a name not in
POINTS at start-up, and `payments crash-points` lists them. Two kinds cover
every gap between durable facts on an operation's path: `after-commit-<point>`
(a phase committed; its call not made, or its response not sent) and
`after-call-EXTn` (call n applied; its outcome not committed). Reconciliation
and the webhook dispatcher have points of their own.
docs/crash-matrix.md#crash-points says where each is checked.
"""

from __future__ import annotations

from app.payments.recovery_points import EXT1_SENT, EXT2_SENT, EXT3_SENT, EXT4_SENT, EXT5_SENT, FINISHED

POINTS: dict[str, str] = {
    f"after-commit-{EXT1_SENT}": "Handler1 committed (payment row, K1); the PSP has not been called.",
    "after-call-EXT1": "The PSP charged the card; the charge is not recorded yet.",
    f"after-commit-{EXT2_SENT}": "The charge is recorded and the payout instruction built; the rail has not been called.",
    "after-call-EXT2": "The rail accepted (or rejected) the transfer; its outcome is not recorded yet.",
    f"after-commit-{EXT3_SENT}": "The rejection is recorded and the refund intended; the PSP has not been asked to refund.",
    "after-call-EXT3": "The PSP refunded the charge; the refund is not recorded yet.",
    f"after-commit-{EXT4_SENT}": "A return is recorded (inbox, returned, ledger, event, refund intended); "
    "the rail has not been acknowledged and the PSP not asked to refund.",
    "after-call-EXT4": "The PSP refunded the returned payment's charge; the refund is not recorded yet.",
    f"after-commit-{EXT5_SENT}": "A client's refund is claimed and its amount reserved on the payment; "
    "the PSP has not been asked to refund.",
    "after-call-EXT5": "The PSP answered the client's refund (succeeded or failed); its outcome is not recorded yet.",
    f"after-commit-{FINISHED}": "The final response is stored; the client has not received it.",
    "reconcile-after-settlement": "A reconciliation run settled one payment; the rest of its window is not done.",
    "webhook-after-claim": "The dispatcher leased the webhook cursor and read its batch, or claimed due retries; nothing is POSTed yet.",
    "webhook-after-delivery": "The merchant answered a webhook POST; the attempt is not recorded yet.",
}


def validate(point: str | None) -> str | None:
    if point is not None and point not in POINTS:
        raise ValueError(f"unknown crash point {point!r}; `payments crash-points` lists them")
    return point
