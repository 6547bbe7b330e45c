"""Operating the key table: stored responses capped, and the key row findable by its payment.

`idempotency_key_response_body_capped`: a stored response is at most
4096 bytes (app/payments/phases.py::MAX_STORED_RESPONSE_BYTES, where a
larger one is refused as a bug before it reaches here); the key table must
not become a store of blobs. This CHECK is the last line of defence.

`idempotency_key_payment_id`: reconciliation and the parked queries join the
key table to payments by `payment_id`, and so will retention; without an
index each such join reads the whole key table.

On a large table: the CHECK is added NOT VALID (instant, it checks only new
rows) and validated in a transaction of its own, which reads the table
without blocking writes (SHARE UPDATE EXCLUSIVE). The index is built
CONCURRENTLY, so writes go on while it builds.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "ALTER TABLE idempotency_key ADD CONSTRAINT idempotency_key_response_body_capped "
        "CHECK (octet_length(response_body) <= 4096) NOT VALID"
    )
    with op.get_context().autocommit_block():
        op.execute("ALTER TABLE idempotency_key VALIDATE CONSTRAINT idempotency_key_response_body_capped")
        op.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_key_payment_id ON idempotency_key (payment_id)"
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS idempotency_key_payment_id")
    op.execute("ALTER TABLE idempotency_key DROP CONSTRAINT idempotency_key_response_body_capped")
