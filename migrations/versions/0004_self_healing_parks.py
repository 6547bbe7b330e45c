"""Faults nobody scripted: a call known not sent, and parked operations re-probed.

`not_sent`: a release (or a park) after an outcome that was certainly *not
applied* (the connection was refused before anything was sent, or the system
answered with a refusal it documents as storing nothing) says so, and the
next owner may then send without probing first, even to a rail that cannot
deduplicate. Every takeover resets it in the same statement that hands over
the lease, because from then on the new owner may send.

`idempotency_key_parked`: the worker re-probes parked operations every
PARKED_RECHECK_SECONDS (their `next_attempt_at` says when), so it needs to
find the due ones without scanning the table.

On a large table: ADD COLUMN with a constant default changes only the
catalogue (PostgreSQL 11 and later), whatever the table's size. The index
holds only parked rows (a handful), but building it reads the whole table,
so it is built CONCURRENTLY: writes to the key table go on while it builds.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE idempotency_key ADD COLUMN not_sent boolean NOT NULL DEFAULT false")
    with op.get_context().autocommit_block():
        op.execute(
            "CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_key_parked ON idempotency_key (next_attempt_at) "
            "WHERE state = 'started' AND parked_at IS NOT NULL"
        )


def downgrade() -> None:
    op.execute("DROP INDEX IF EXISTS idempotency_key_parked")
    op.execute("ALTER TABLE idempotency_key DROP COLUMN not_sent")
