"""Operating the key table: one partition per UTC day, a claim that stays unique across them.

`idempotency_key` becomes a table RANGE-partitioned by a new column,
`stored_on`: the UTC day of the partition that holds the row (the day it was
claimed, or the day the reaper moved a still-live row to; `created_at` stays
the true claim time and is never rewritten). Old keys are then removed by
dropping a whole day's partition (app/workers/retention.py), never by a mass
DELETE, which would leave the busiest table full of dead rows to vacuum.

The primary key must contain the partition column, so it becomes
`(client_id, key, stored_on)`, and PostgreSQL no longer enforces that a key
exists once across days. `claim_idempotency_key` does instead (see the
comment where it is created), and every claim goes through it.

`key_table_clock()` is the clock that decides the day (now(); a test
replaces it in its own database to stand just before or after midnight).
Leases keep using now().

How the existing table is converted, and what that costs on a large one:
nothing is copied. The old table gets `stored_on` as a column with a
constant default (the day of the migration: a catalogue change only, every
existing row reads it), a CHECK that bounds it (added NOT VALID, then
validated, which reads the table once without blocking writes), and a
unique index on (client_id, key, stored_on) built CONCURRENTLY (writes go
on). Then, in one short transaction that only changes the catalogue (an
ACCESS EXCLUSIVE lock on the old table for milliseconds, bounded by a
lock_timeout so it cannot queue in front of traffic for long): the old table
is renamed `idempotency_key_legacy`, a partitioned `idempotency_key` is
created with the same columns and constraints, and the old table is ATTACHed
as its partition for every day up to the migration's (the validated CHECK
proves its rows fit, so ATTACH does not scan it; its existing indexes and
foreign keys are adopted, not rebuilt). Daily partitions follow from the next
day on. The legacy partition is dropped by the reaper by the same rule as any
other, once the day of the migration is past retention and its live rows
have been moved out.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from datetime import date, timedelta

from alembic import op
from sqlalchemy import text

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Days of partitions created ahead by the migration (the worker's daily tick
# and `payments migrate` keep them ahead afterwards).
AHEAD_DAYS = 7


def upgrade() -> None:
    today: date = op.get_bind().execute(text("SELECT (now() AT TIME ZONE 'UTC')::date")).scalar_one()
    bound = today + timedelta(days=1)

    op.execute(
        """
        CREATE FUNCTION key_table_clock() RETURNS timestamptz LANGUAGE sql STABLE
        AS $$ SELECT now() $$
        """
    )
    op.execute(
        """
        CREATE FUNCTION key_table_day() RETURNS date LANGUAGE sql STABLE
        AS $$ SELECT (key_table_clock() AT TIME ZONE 'UTC')::date $$
        """
    )
    # A constant default: PostgreSQL 11 and later record it in the catalogue
    # and every existing row reads it, so nothing is rewritten.
    op.execute(f"ALTER TABLE idempotency_key ADD COLUMN stored_on date NOT NULL DEFAULT '{today}'")
    op.execute(
        "ALTER TABLE idempotency_key ADD CONSTRAINT idempotency_key_legacy_bound "
        f"CHECK (stored_on < '{bound}') NOT VALID"
    )
    with op.get_context().autocommit_block():
        op.execute("ALTER TABLE idempotency_key VALIDATE CONSTRAINT idempotency_key_legacy_bound")
        op.execute(
            "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS idempotency_key_legacy_pkey "
            "ON idempotency_key (client_id, key, stored_on)"
        )

    # From here on, one transaction of catalogue changes only.
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("ALTER TABLE idempotency_key RENAME TO idempotency_key_legacy")
    op.execute("ALTER TABLE idempotency_key_legacy DROP CONSTRAINT idempotency_key_pkey")
    op.execute(
        "ALTER TABLE idempotency_key_legacy ADD CONSTRAINT idempotency_key_legacy_pkey "
        "PRIMARY KEY USING INDEX idempotency_key_legacy_pkey"
    )
    for index in ("unfinished", "parked", "payment_id"):
        op.execute(f"ALTER INDEX idempotency_key_{index} RENAME TO idempotency_key_legacy_{index}")
    # LIKE copies the columns, their defaults, NOT NULLs and CHECKs by name,
    # which is what ATTACH requires of a partition.
    op.execute(
        "CREATE TABLE idempotency_key (LIKE idempotency_key_legacy INCLUDING DEFAULTS INCLUDING CONSTRAINTS) "
        "PARTITION BY RANGE (stored_on)"
    )
    op.execute("ALTER TABLE idempotency_key DROP CONSTRAINT idempotency_key_legacy_bound")
    op.execute("ALTER TABLE idempotency_key ALTER COLUMN stored_on SET DEFAULT key_table_day()")
    op.execute("ALTER TABLE idempotency_key ADD PRIMARY KEY (client_id, key, stored_on)")
    op.execute(
        "ALTER TABLE idempotency_key ADD CONSTRAINT idempotency_key_client_id_fkey "
        "FOREIGN KEY (client_id) REFERENCES client (id)"
    )
    # Still DEFERRABLE INITIALLY DEFERRED: a claim whose payment cannot be
    # created (its reference is taken) is refused when its statement ends,
    # claim included (app/payments/sql.py, HANDLER1).
    op.execute(
        "ALTER TABLE idempotency_key ADD CONSTRAINT idempotency_key_payment_id_fkey "
        "FOREIGN KEY (payment_id) REFERENCES payment (id) DEFERRABLE INITIALLY DEFERRED"
    )
    op.execute(
        "CREATE INDEX idempotency_key_unfinished ON idempotency_key (next_attempt_at) "
        "WHERE state = 'started' AND parked_at IS NULL"
    )
    op.execute(
        "CREATE INDEX idempotency_key_parked ON idempotency_key (next_attempt_at) "
        "WHERE state = 'started' AND parked_at IS NOT NULL"
    )
    op.execute("CREATE INDEX idempotency_key_payment_id ON idempotency_key (payment_id)")
    op.execute(
        f"ALTER TABLE idempotency_key ATTACH PARTITION idempotency_key_legacy FOR VALUES FROM (MINVALUE) TO ('{bound}')"
    )
    op.execute("ALTER TABLE idempotency_key_legacy DROP CONSTRAINT idempotency_key_legacy_bound")
    op.execute("ALTER TABLE idempotency_key_legacy ALTER COLUMN stored_on SET DEFAULT key_table_day()")
    for n in range(1, AHEAD_DAYS + 1):
        day = today + timedelta(days=n)
        op.execute(
            f"CREATE TABLE idempotency_key_p{day:%Y%m%d} PARTITION OF idempotency_key "
            f"FOR VALUES FROM ('{day}') TO ('{day + timedelta(days=1)}')"
        )

    # Why a function: (client_id, key) must be unique across every day's
    # partition, and no index can say so (a unique index on a partitioned
    # table must contain the partition column). So a claim serialises with
    # every other claim of the same key (the advisory lock, held until its
    # transaction ends), and only then looks for the key in every partition.
    # The look must see whatever the claim it waited for committed; a lock
    # taken inside one SQL statement does not refresh that statement's
    # snapshot, so a claim committed while we waited (yesterday's, say, just
    # before midnight) would be invisible and we would insert a second row
    # in today's partition. A VOLATILE PL/pgSQL function takes a new snapshot
    # for every statement it runs (READ COMMITTED), so the look after the lock
    # sees it. It is still one statement for the caller: one round trip.
    # Returns the new lease token, or NULL when the key exists.
    # (Checked by experiment on PostgreSQL 15 and 18: a claim committed across
    # midnight while a second waited on the lock was invisible to a single
    # statement that locked and then looked, which inserted a second row in
    # the next day's partition; this function returned NULL. The tests in
    # tests/integration/test_key_table.py straddle midnight the same way.)
    op.execute(
        """
        CREATE FUNCTION claim_idempotency_key(
            p_client_id bigint, p_key text, p_endpoint text, p_request_hash bytea,
            p_recovery_point text, p_payment_id uuid, p_lease_seconds float8
        ) RETURNS uuid LANGUAGE plpgsql VOLATILE AS $$
        DECLARE
            token uuid;
        BEGIN
            PERFORM pg_advisory_xact_lock(hashtextextended(p_client_id::text || '/' || p_key, 0));
            PERFORM 1 FROM idempotency_key WHERE client_id = p_client_id AND key = p_key;
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
    )


def downgrade() -> None:
    # Back to one table: this copies every row (the reverse of the upgrade
    # cannot be done in the catalogue alone), under an exclusive lock.
    op.execute("DROP FUNCTION claim_idempotency_key")
    op.execute("LOCK TABLE idempotency_key IN ACCESS EXCLUSIVE MODE")
    op.execute("ALTER TABLE idempotency_key RENAME TO idempotency_key_partitioned")
    op.execute(
        "CREATE TABLE idempotency_key (LIKE idempotency_key_partitioned INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"
    )
    op.execute("INSERT INTO idempotency_key SELECT * FROM idempotency_key_partitioned")
    op.execute("DROP TABLE idempotency_key_partitioned")
    op.execute("ALTER TABLE idempotency_key DROP COLUMN stored_on")
    op.execute("ALTER TABLE idempotency_key ADD PRIMARY KEY (client_id, key)")
    op.execute("ALTER TABLE idempotency_key ADD FOREIGN KEY (client_id) REFERENCES client (id)")
    op.execute(
        "ALTER TABLE idempotency_key ADD CONSTRAINT idempotency_key_payment_id_fkey "
        "FOREIGN KEY (payment_id) REFERENCES payment (id) DEFERRABLE INITIALLY DEFERRED"
    )
    op.execute(
        "CREATE INDEX idempotency_key_unfinished ON idempotency_key (next_attempt_at) "
        "WHERE state = 'started' AND parked_at IS NULL"
    )
    op.execute(
        "CREATE INDEX idempotency_key_parked ON idempotency_key (next_attempt_at) "
        "WHERE state = 'started' AND parked_at IS NOT NULL"
    )
    op.execute("CREATE INDEX idempotency_key_payment_id ON idempotency_key (payment_id)")
    op.execute("DROP FUNCTION key_table_day")
    op.execute("DROP FUNCTION key_table_clock")
