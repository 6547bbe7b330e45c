"""Returned payouts: the rail's notifications through our inbox, and the compensation.

`payment.status` may now also be `returned` (the beneficiary's bank sent
the payout back; the compensating refund is under way) and `refunded` (the
payer's card was refunded after the return: final). A returned payment
keeps its reference (the partial unique index is unchanged): the money
moved and came back, and a new attempt is a new payment with a new
reference. `return_id`, `return_reason` and `returned_at` say which return,
why (an ISO 20022 reason code from the rail's allow-list,
app/rails/answers.py) and when we recorded it.

`rail_message`: our inbox for the rail's messages. One row per return,
keyed by `inbox_key` = `return:<the rail's return id>`: a notification
carries the return id, and so does the statement's return line, so the
statement (reconciliation's backstop) and every delivery of the
notification meet on the same key, and whichever comes second is a
duplicate. The row is inserted in the same transaction as the effect
(app/payments/returns.py); `message_id` is the rail's message id of the
notification that inserted it (NULL when the statement did), and
`duplicates` counts the deliveries dropped since.

`reconciliation_break.kind` gains `unmatched_return` (a return of a
transfer no payment of ours made) and `unexpected_return` (a return that
contradicts what we recorded: a transfer we never saw accepted, another
amount, a second return).

On a large table: the new payment columns are nullable with no default (a
catalogue change, no rewrite). Each widened CHECK is dropped and added NOT
VALID (instant: only new rows are checked), then validated, which reads
the table under a SHARE UPDATE EXCLUSIVE lock that lets reads and writes go
on. The inbox is a new table.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

OLD_STATUSES = "'processing', 'succeeded', 'declined', 'failed', 'indeterminate'"
NEW_STATUSES = OLD_STATUSES + ", 'returned', 'refunded'"
OLD_KINDS = "'amount_mismatch', 'unmatched_transfer', 'duplicate_booking', 'unexpected_booking'"
NEW_KINDS = OLD_KINDS + ", 'unmatched_return', 'unexpected_return'"


def _replace_check(table: str, name: str, condition: str) -> None:
    op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} CHECK ({condition}) NOT VALID")
    op.execute(f"ALTER TABLE {table} VALIDATE CONSTRAINT {name}")


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE payment
            ADD COLUMN return_id text,
            ADD COLUMN return_reason text,
            ADD COLUMN returned_at timestamptz
        """
    )
    _replace_check("payment", "payment_status_check", f"status IN ({NEW_STATUSES})")
    _replace_check("reconciliation_break", "reconciliation_break_kind_check", f"kind IN ({NEW_KINDS})")
    op.execute(
        """
        CREATE TABLE rail_message (
            inbox_key             text PRIMARY KEY,
            -- notification: the rail's POST; statement: a return line that
            -- reconciliation found before any notification arrived.
            source                text NOT NULL CHECK (source IN ('notification', 'statement')),
            message_id            text,
            return_id             text NOT NULL,
            end_to_end_reference  text NOT NULL,
            reason_code           text NOT NULL,
            -- applied: the payment is returned (and its refund intended);
            -- unmatched / unexpected: a reconciliation break, nothing applied.
            outcome               text NOT NULL CHECK (outcome IN ('applied', 'unmatched', 'unexpected')),
            payment_id            uuid REFERENCES payment (id),
            body                  jsonb NOT NULL,
            received_at           timestamptz NOT NULL DEFAULT now(),
            duplicates            integer NOT NULL DEFAULT 0,
            last_duplicate_at     timestamptz,
            CHECK ((source = 'notification') = (message_id IS NOT NULL)),
            CHECK ((outcome = 'applied') <= (payment_id IS NOT NULL))
        )
        """
    )
    op.execute("CREATE INDEX rail_message_payment_id ON rail_message (payment_id)")


def downgrade() -> None:
    op.execute("DROP TABLE rail_message")
    op.execute("DELETE FROM reconciliation_break WHERE kind IN ('unmatched_return', 'unexpected_return')")
    _replace_check("reconciliation_break", "reconciliation_break_kind_check", f"kind IN ({OLD_KINDS})")
    _replace_check("payment", "payment_status_check", f"status IN ({OLD_STATUSES})")
    op.execute("ALTER TABLE payment DROP COLUMN return_id, DROP COLUMN return_reason, DROP COLUMN returned_at")
