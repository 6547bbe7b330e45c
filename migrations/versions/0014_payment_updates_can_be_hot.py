"""A payment's updates on the way to `succeeded` change no column an index names, so they can be HOT.

PostgreSQL can update a row in place on its page, without a new entry in
every index of the table (a heap-only tuple, HOT), only when no column that
any index names changes: not a key column, not a column in an index's WHERE.
A new payment is updated twice (the charge recorded, the payout recorded),
and before this revision each update changed such a column, so every one
wrote a new entry into all four of `payment`'s indexes:

- recording the charge set `end_to_end_reference` (its unique index) and
  `payout_instructed_at` (the key of `payment_indeterminate`);
- recording the payout set `status`, which the WHERE of both
  `payment_reference_in_force` and `payment_indeterminate` reads.

After it:

- `end_to_end_reference` is written when the payment is created (it is
  derived from the client and the key, so it is known then); the API shows
  it only once the payout is instructed, as before.
- `holds_reference`: whether the payment holds its client's reference (it
  is in progress, parked, or moved money), the one fact about `status` the
  reference index needs. It changes only when a payment ends without moving
  money (declined, or failed and refunded), never on the way to
  `succeeded`. A CHECK ties it to `status`, so no statement can change one
  without the other: a writer that forgot it fails loudly and writes nothing.
  `payment_reference_in_force` is rebuilt on it (same name, same meaning).
- `payment_indeterminate` is dropped: reconciliation finds parked payouts
  through the key table's index of parked operations instead (a handful of
  rows), then each payment by its primary key (app/payments/payment_table.py).

Measured in docs/reference/performance.md, "A payment row whose updates are
HOT".

Existing rows: every payment that is not declined or failed holds its
reference (the column's default); the declined and failed ones are set
free by one UPDATE. Payments created before this revision keep a NULL
end-to-end reference until their charge is recorded, which still writes it.

On a large table: the column is added with a constant default, a catalogue
change that rewrites nothing. The backfill is one UPDATE of the declined and
failed payments only (it reads the table once; it locks rows no phase
writes any more). The CHECK is added NOT VALID (instant, but checked on
every write from then on) and validated after the transaction commits, which
reads the table under a SHARE UPDATE EXCLUSIVE lock that lets reads and
writes go on. The new unique index is built CONCURRENTLY (writes go on; it
reads the table twice), the old one and `payment_indeterminate` dropped
CONCURRENTLY, and the new one renamed. Between the build and the drop both
unique indexes exist, and each refuses a second payment in force with a
reference, so the rule holds throughout. A service of the previous revision
still running while this runs would have its declines refused by the CHECK
(its phase's statement rolls back and the payment is recorded by the next
owner, on the new code): stop it first, or upgrade both at once, as
`payments migrate` before `payments api` does.

Revision ID: 0014
Revises: 0013
"""

from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

_RULE = "holds_reference = (status NOT IN ('declined', 'failed'))"


def upgrade() -> None:
    # Written so that it can be run again after it failed half way (a
    # lock_timeout, say): the autocommit block below is not undone by a failure.
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("ALTER TABLE payment ADD COLUMN IF NOT EXISTS holds_reference boolean NOT NULL DEFAULT true")
    op.execute("UPDATE payment SET holds_reference = false WHERE status IN ('declined', 'failed') AND holds_reference")
    op.execute(
        f"""
        DO $$ BEGIN
            IF NOT EXISTS (SELECT FROM pg_constraint WHERE conname = 'payment_holds_reference_by_status') THEN
                ALTER TABLE payment ADD CONSTRAINT payment_holds_reference_by_status CHECK ({_RULE}) NOT VALID;
            END IF;
        END $$
        """
    )
    with op.get_context().autocommit_block():
        op.execute("ALTER TABLE payment VALIDATE CONSTRAINT payment_holds_reference_by_status")
        # A build that failed leaves an invalid index behind, which enforces
        # nothing: never rename one of those into place.
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS payment_reference_held")
        op.execute(
            "CREATE UNIQUE INDEX CONCURRENTLY payment_reference_held "
            "ON payment (client_id, reference) WHERE holds_reference"
        )
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS payment_reference_in_force")
        op.execute("ALTER INDEX payment_reference_held RENAME TO payment_reference_in_force")
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS payment_indeterminate")


def downgrade() -> None:
    op.execute(
        "CREATE INDEX payment_indeterminate ON payment (payout_instructed_at) WHERE status = 'indeterminate'"
    )
    op.execute("DROP INDEX payment_reference_in_force")
    op.execute(
        "CREATE UNIQUE INDEX payment_reference_in_force ON payment (client_id, reference) "
        "WHERE status NOT IN ('declined', 'failed')"
    )
    op.execute("ALTER TABLE payment DROP CONSTRAINT payment_holds_reference_by_status")
    op.execute("ALTER TABLE payment DROP COLUMN holds_reference")
    # The end-to-end references written at creation of payments whose payout
    # was never instructed go back to NULL, as the previous revision wrote them.
    op.execute(
        "UPDATE payment SET end_to_end_reference = NULL "
        "WHERE payout_instructed_at IS NULL AND end_to_end_reference IS NOT NULL"
    )
