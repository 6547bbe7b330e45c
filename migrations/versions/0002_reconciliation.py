"""Reconciliation: once-per-window runs, breaks, and when a payout was instructed.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # When Handler2 built the payout instruction: the rail books it on that
    # day's statement or, within its booking horizon, a later one.
    op.execute("ALTER TABLE payment ADD COLUMN payout_instructed_at timestamptz")
    op.execute(
        "CREATE INDEX payment_indeterminate ON payment (payout_instructed_at) WHERE status = 'indeterminate'"
    )
    op.execute(
        """
        CREATE TABLE scheduled_run (
            -- The durable tick key (seed 002): a job and the UTC window it is
            -- meant for. Every worker may try to claim a window; the primary
            -- key lets exactly one of them run it.
            job               text NOT NULL,
            window_start      date NOT NULL,
            state             text NOT NULL CHECK (state IN ('started', 'finished', 'failed')),
            -- A run is leased like an operation: a run killed halfway is taken
            -- over once its lease expires, and a stale one is fenced off.
            lease_token       uuid,
            lease_expires_at  timestamptz,
            attempts          integer NOT NULL DEFAULT 1,
            counts            jsonb NOT NULL DEFAULT '{}',
            error             text,
            started_at        timestamptz NOT NULL DEFAULT now(),
            finished_at       timestamptz,
            PRIMARY KEY (job, window_start)
        )
        """
    )
    op.execute(
        """
        CREATE TABLE reconciliation_break (
            id                    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            window_start          date NOT NULL,
            kind                  text NOT NULL
                CHECK (kind IN ('amount_mismatch', 'unmatched_transfer', 'duplicate_booking',
                                'unexpected_booking')),
            end_to_end_reference  text NOT NULL,
            payment_id            uuid REFERENCES payment (id),
            details               jsonb NOT NULL,
            detected_at           timestamptz NOT NULL DEFAULT now(),
            -- A rerun of a window finds the same break again; it is one break.
            UNIQUE (kind, end_to_end_reference)
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE reconciliation_break, scheduled_run")
    op.execute("DROP INDEX payment_indeterminate")
    op.execute("ALTER TABLE payment DROP COLUMN payout_instructed_at")
