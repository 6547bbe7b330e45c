"""Client refunds: a refund table, and each payment's refunded amount as a balance the database guards.

`payment.refunded_minor`: how much of the charge is refunded or reserved
for a refund in flight, by the client's refunds and by our own compensation
of a rejected or returned payout together. What can still be refunded is
`amount_minor - refunded_minor`; the CHECK `payment_refunded_within_amount`
is the last line of defence under the conditional write that reserves a
refund (app/payments/refunds/phases.py): no bug and no race can make the
refunds of a payment add up to more than its charge.

`payment.return_refund_minor`: what the compensation of a returned payout
refunds: whatever client refunds had not already taken when the return
was recorded (app/payments/returns.py). NULL until a payout is returned.

`refund`: one row per client refund. Its `reference` is the client's
business identity for it, unique per payment among refunds that have not
failed (`refund_reference`, the refund's twin of the payment's partial
unique reference index): a second key with the same reference is refused,
and a failed refund's reference may be tried again. `idempotency_key` is
the key it was created under; the key row may be reaped after its retention
while the refund stays, and a key reused after that belongs to a later
refund (the newest row with that key is the one the live key row names).
`psp_refund_key` is the derived key K5 the PSP deduplicates the refund by.

Existing payments: a payment that ended `failed` or `refunded`, or is
`returned` (its compensation under way), had its whole charge refunded by
our compensation, so its refunded amount is its amount (and a returned one's
compensation refunds all of it). Every other payment has refunded nothing.

On a large table: both payment columns are added with a constant default or
none, a catalogue change that rewrites nothing. The backfill is one UPDATE
of the failed, refunded and returned payments only (a small share of the
rows; it reads the table once and takes row locks on rows no phase writes
any more, a returned payment's compensation apart, which waits for it). The
CHECK is added NOT VALID (instant) and then validated, which reads the table
under a SHARE UPDATE EXCLUSIVE lock that lets reads and writes go on. The
refund table and its indexes are new. docs/reference/performance.md has it
measured on a million payments.

Revision ID: 0011
Revises: 0010
"""

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE payment ADD COLUMN refunded_minor bigint NOT NULL DEFAULT 0")
    op.execute("ALTER TABLE payment ADD COLUMN return_refund_minor bigint")
    op.execute(
        """
        UPDATE payment
           SET refunded_minor = amount_minor,
               return_refund_minor = CASE WHEN status IN ('returned', 'refunded') THEN amount_minor END
         WHERE status IN ('failed', 'refunded', 'returned')
        """
    )
    op.execute(
        "ALTER TABLE payment ADD CONSTRAINT payment_refunded_within_amount "
        "CHECK (refunded_minor >= 0 AND refunded_minor <= amount_minor) NOT VALID"
    )
    op.execute("ALTER TABLE payment VALIDATE CONSTRAINT payment_refunded_within_amount")
    op.execute(
        """
        CREATE TABLE refund (
            id               uuid PRIMARY KEY,
            payment_id       uuid NOT NULL REFERENCES payment (id),
            client_id        integer NOT NULL REFERENCES client (id),
            idempotency_key  text NOT NULL,
            reference        text NOT NULL,
            reason           text,
            amount_minor     bigint NOT NULL CHECK (amount_minor > 0),
            currency         char(3) NOT NULL,
            status           text NOT NULL CHECK (status IN ('pending', 'succeeded', 'failed')),
            psp_charge_id    text NOT NULL,
            psp_refund_key   text NOT NULL,
            psp_refund_id    text,
            failure_code     text,
            created_at       timestamptz NOT NULL DEFAULT now(),
            updated_at       timestamptz NOT NULL DEFAULT now(),
            finished_at      timestamptz,
            CHECK ((status = 'pending') = (finished_at IS NULL))
        )
        """
    )
    op.execute("CREATE UNIQUE INDEX refund_reference ON refund (payment_id, reference) WHERE status <> 'failed'")
    op.execute("CREATE INDEX refund_payment ON refund (payment_id, id)")
    op.execute("CREATE INDEX refund_idempotency_key ON refund (client_id, idempotency_key)")


def downgrade() -> None:
    op.execute("DROP TABLE refund")
    op.execute("ALTER TABLE payment DROP CONSTRAINT payment_refunded_within_amount")
    op.execute("ALTER TABLE payment DROP COLUMN return_refund_minor")
    op.execute("ALTER TABLE payment DROP COLUMN refunded_minor")
