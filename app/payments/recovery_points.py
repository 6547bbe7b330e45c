"""The one list of recovery points: facts that are durable once a phase commits.

These strings are stored in `idempotency_key.recovery_point`; renaming one
needs a migration. Each names what is already true, never what is about to
happen, so a resumer knows exactly which work it must not repeat. The
payment (app/payments/payment.py), a returned payout's compensation
(app/payments/returns.py) and a client's refund (app/payments/refunds/refund.py)
are declared over them:

    EXT1_SENT  the payment exists with its fee; the PSP charge with K1 may have been sent
    EXT2_SENT  the charge is on the ledger; the rail transfer with K2 may have been sent
    EXT3_SENT  the rail rejected the transfer; the PSP refund with K3 may have been sent
    EXT4_SENT  the rail returned the payout, recorded; the PSP refund with K4 may have been sent
    EXT5_SENT  a client's refund is reserved on its payment; the PSP refund with K5 may have been sent
    finished   the final status is set and the response stored

docs/request-path.md#why-three-commits-are-enough explains why so few points
carry every fact that a commit after each step would.
"""

from __future__ import annotations

EXT1_SENT = "EXT1_SENT"
EXT2_SENT = "EXT2_SENT"
EXT3_SENT = "EXT3_SENT"
EXT4_SENT = "EXT4_SENT"
EXT5_SENT = "EXT5_SENT"
FINISHED = "finished"

ALL = (EXT1_SENT, EXT2_SENT, EXT3_SENT, EXT4_SENT, EXT5_SENT, FINISHED)

# The step names that derive each external call's idempotency key.
STEP_CHARGE = "ext1"
STEP_TRANSFER = "ext2"
STEP_REFUND = "ext3"
STEP_RETURN_REFUND = "ext4"
STEP_CLIENT_REFUND = "ext5"
