"""The one list of recovery points: facts that are durable once a phase commits.

These strings are stored in `idempotency_key.recovery_point`; renaming one
needs a migration. Each names what is already true, never what is about to
happen, so a resumer reading it knows exactly which work it must not repeat.

Written out one fact per commit, the sequence would be H1_DONE, EXT1_SENT,
EXT1_DONE, H2_DONE, EXT2_SENT, EXT2_DONE, finished. Here a phase commits a call's outcome, the next handler's
work and the next call's intent in one transaction, because nothing external
happens between them. So H1_DONE is never observed without EXT1_SENT;
EXT1_DONE and H2_DONE arrive together with EXT2_SENT (or, for a decline, with
finished); and EXT2_DONE arrives together with finished (or, for a rejection,
with EXT3_SENT). Three commits carry the same facts those seven would, and
a crash between any two of them leaves one of the points below.

    EXT1_SENT  the payment row exists with its fee, and the PSP charge with
               derived key K1 may have been sent (Handler1 is done).
    EXT2_SENT  the charge succeeded and is on the ledger, and the rail transfer
               with derived key K2 and its end-to-end reference may have been
               sent (Handler2 is done).
    EXT3_SENT  the rail rejected the transfer, and the compensating PSP refund
               with derived key K3 may have been sent.
    finished   the payment has its final status and the response is stored.

A returned payout is compensated by an operation of its own (a key row of
its own, app/payments/returns.py), driven by the same engine:

    EXT4_SENT  the rail returned the payout and we recorded it (the payment
               is `returned`, the ledger has `payout_returned`), and the
               compensating PSP refund with derived key K4 may have been sent.
    finished   the refund is recorded: the payment is `refunded`.
"""

from __future__ import annotations

EXT1_SENT = "EXT1_SENT"
EXT2_SENT = "EXT2_SENT"
EXT3_SENT = "EXT3_SENT"
EXT4_SENT = "EXT4_SENT"
FINISHED = "finished"

ALL = (EXT1_SENT, EXT2_SENT, EXT3_SENT, EXT4_SENT, FINISHED)

# The step names that derive each external call's idempotency key.
STEP_CHARGE = "ext1"
STEP_TRANSFER = "ext2"
STEP_REFUND = "ext3"
STEP_RETURN_REFUND = "ext4"
