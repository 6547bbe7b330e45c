"""Nothing written per operation references the client row by a foreign key; a client is never deleted.

Every payment wrote three rows that pointed at its client by a foreign key
(the key row, the payment, its event), and a webhook's delivery, a refund
and a batch's rows a fourth. PostgreSQL checks such a key by locking the
client's row FOR KEY SHARE in every inserting transaction, so all of one
client's concurrent payments lock the same row: each lock writes the row's
header (and a WAL record), and several holders at once must be recorded as
a MultiXact. The busier the client, the more its payments queue on one
heap page and the faster MultiXacts are used up. Measured, with the service's
own SQL for one payment in pgbench from 32 connections: about 0.88 of the
rate without these checks (docs/reference/performance.md, "The client row
every payment locked").

What those foreign keys guarded is kept another way. A row names its client
because the client was authenticated (the caller lookup) or is the client of
the payment it belongs to; no statement of the service takes a client id from
anywhere else. And a client row can no longer disappear under them: a
trigger refuses to delete one (`client_is_never_deleted`), with or without
rows that name it, where before only a client with rows was protected (the
service has no command that deletes a client). TRUNCATE, a whole-table
operation that only tests and a person rebuilding a database use, is left
alone.

The foreign keys that point at the payment (the ledger's legs, the event,
the key row's DEFERRABLE one that lets a refused reference roll its claim
back) stay: each locks only its own payment's row, which nothing else
contends for.

On a large table: dropping a foreign key changes only the catalogue (no row
is read or written), but takes a short ACCESS EXCLUSIVE lock on the table
and on `client`; `lock_timeout` keeps the migration from queueing in front
of traffic for long (it fails instead, and can be run again). Creating the
trigger takes a SHARE ROW EXCLUSIVE lock on `client` for as long.

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# (table, the foreign key's name): each table written per operation, and its key into client.
CLIENT_KEYS = (
    ("idempotency_key", "idempotency_key_client_id_fkey"),  # on the partitioned table: every partition follows
    ("payment", "payment_client_id_fkey"),
    ("event", "event_client_id_fkey"),
    ("webhook_delivery", "webhook_delivery_client_id_fkey"),
    ("refund", "refund_client_id_fkey"),
    ("payment_batch", "payment_batch_client_id_fkey"),
    ("payment_batch_row", "payment_batch_row_client_id_fkey"),
)


def upgrade() -> None:
    op.execute("SET LOCAL lock_timeout = '10s'")
    for table, name in CLIENT_KEYS:
        op.execute(f"ALTER TABLE {table} DROP CONSTRAINT {name}")
    op.execute(
        """
        CREATE FUNCTION client_is_never_deleted() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'client % is never deleted: its keys, payments and events name it', OLD.id
                USING ERRCODE = 'restrict_violation';
        END
        $$
        """
    )
    op.execute(
        "CREATE TRIGGER client_is_never_deleted BEFORE DELETE ON client "
        "FOR EACH ROW EXECUTE FUNCTION client_is_never_deleted()"
    )


def downgrade() -> None:
    op.execute("DROP TRIGGER client_is_never_deleted ON client")
    op.execute("DROP FUNCTION client_is_never_deleted()")
    # Validated: every row written meanwhile is read once (PostgreSQL before
    # 18 cannot add a NOT VALID foreign key to a partitioned table).
    for table, name in CLIENT_KEYS:
        op.execute(f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY (client_id) REFERENCES client (id)")
