"""A new payment's two looks for its key skip the day partitions that cannot hold a key yet.

The key table keeps a week of day partitions ahead of today (so that a
worker that has not run for days does not stop the claims), and a new
payment looks for its key twice: in the caller's lookup that starts every
POST (app/idempotency/key_table.py, CALLER_SQL) and in the claim
(`claim_idempotency_key`, below). Each look probed every partition's
primary key, the empty days ahead included: on a young database, six of
the eight partitions probed could not hold the key.

No key row is ever stored on a day after tomorrow. A claim stores its row on
its transaction's day (`key_table_day()`), and the reaper moves a live row to
its own transaction's day; so every row is stored on a day at most that of
the latest transaction that wrote one. A look made now may come from a
transaction that began just before midnight while the row it must find was
stored by one that began just after: one day of margin covers that, since no
claim runs for a day. `key_table_last_day()` is that bound, today + 1, and
both looks now say `stored_on <= key_table_last_day()`. PostgreSQL prunes
the later partitions when the statement starts (the function is STABLE, so
its value is fixed for the statement and known before any partition is
read), and their indexes are never probed. The bound rests on the database's
clock never running a day backwards.

`tests/integration/test_key_table.py` has the claim made just before midnight
that must find a key claimed just after it; `tests/mutants.py` breaks the
bound (no margin) and that test fails. Measured in
docs/reference/performance.md, "A new payment's looks skip the days ahead".

On a large table: nothing is read or rewritten; a function is created and
the claim's function replaced, in one short transaction.

Revision ID: 0015
Revises: 0014
"""

from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

_CLAIM = """
    CREATE OR REPLACE FUNCTION claim_idempotency_key(
        p_client_id bigint, p_key text, p_endpoint text, p_request_hash bytea,
        p_recovery_point text, p_payment_id uuid, p_lease_seconds float8
    ) RETURNS uuid LANGUAGE plpgsql VOLATILE AS $$
    DECLARE
        token uuid;
    BEGIN
        PERFORM pg_advisory_xact_lock(hashtextextended(p_client_id::text || '/' || p_key, 0));
        PERFORM 1 FROM idempotency_key WHERE client_id = p_client_id AND key = p_key{bound};
        IF FOUND THEN
            RETURN NULL;
        END IF;
        INSERT INTO idempotency_key
            (client_id, key, stored_on, endpoint, request_hash, state, recovery_point, payment_id,
             lease_token, lease_expires_at, timeline)
        VALUES (p_client_id, p_key, key_table_day(), p_endpoint, p_request_hash, 'started', p_recovery_point,
                p_payment_id, gen_random_uuid(), now() + make_interval(secs => p_lease_seconds),
                jsonb_build_array(jsonb_build_object(
                    'at', now(), 'event', 'claimed', 'recovery_point', p_recovery_point, 'attempt', 1)))
        -- Within one day's partition the primary key refuses a second
        -- row anyway; this only keeps that refusal an answer, not an error.
        ON CONFLICT DO NOTHING
        RETURNING lease_token INTO token;
        RETURN token;
    END
    $$
"""

# The look as this revision makes it: in every partition up to tomorrow's.
BOUND = "\n                                 AND stored_on <= key_table_last_day()"


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION key_table_last_day() RETURNS date LANGUAGE sql STABLE
        AS $$ SELECT key_table_day() + 1 $$
        """
    )
    op.execute(_CLAIM.format(bound=BOUND))


def downgrade() -> None:
    op.execute(_CLAIM.format(bound=""))
    op.execute("DROP FUNCTION key_table_last_day")
