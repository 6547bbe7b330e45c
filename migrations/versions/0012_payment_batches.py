"""Payment batches: the batch, its rows with their natural keys, and the outbox that takes them to the broker.

`payment_batch`: one row per accepted upload, under the batch's own
Idempotency-Key (its key row's endpoint is `POST /v1/payment-batches`).
`completed_at` is written once, by whoever first sees every row final; it is
the only write to this row after the upload (no row updates a shared
counter on it).

`payment_batch_row`: one row per line of the file. `row_key` is the natural
key uuid5(namespace, client, batch reference, row reference, value date):
the row's payment's Idempotency-Key in the key table, and (as
`batch-row:<row_key>`) its payment reference, so a resubmitted row stays one
payment after its key row is reaped. `payment_id` is set by the consumer
once the row's payment is durable (its own row, nothing shared);
`dead_lettered_at` and `dead_letter_reason` once it gave up on a poison row.

`batch_outbox`: one row per batch row not yet acknowledged by the broker,
written in the upload's transaction and deleted once the broker's PubAck
arrives. `claimed_until` is a publisher's lease on it.

`event.payment_id` becomes nullable: a `batch.completed` event names a
batch, not a payment (its id is in the event's data).

On a large table: three new tables, and DROP NOT NULL on `event.payment_id`,
which changes only the catalogue (no scan, no rewrite; a brief ACCESS
EXCLUSIVE lock on `event`).

Revision ID: 0012
Revises: 0011
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE TABLE payment_batch (
            id               uuid PRIMARY KEY,
            client_id        bigint NOT NULL REFERENCES client (id),
            reference        text NOT NULL,
            idempotency_key  text NOT NULL,
            row_count        integer NOT NULL CHECK (row_count > 0),
            created_at       timestamptz NOT NULL DEFAULT now(),
            completed_at     timestamptz
        )
        """
    )
    op.execute("CREATE INDEX payment_batch_open ON payment_batch (created_at) WHERE completed_at IS NULL")
    op.execute("CREATE INDEX payment_batch_client ON payment_batch (client_id, reference)")
    op.execute(
        """
        CREATE TABLE payment_batch_row (
            batch_id            uuid NOT NULL REFERENCES payment_batch (id),
            row_number          integer NOT NULL,
            client_id           bigint NOT NULL REFERENCES client (id),
            row_key             uuid NOT NULL,
            reference           text NOT NULL,
            value_date          date NOT NULL,
            request             jsonb NOT NULL,
            payment_id          uuid REFERENCES payment (id),
            duplicate           boolean NOT NULL DEFAULT false,
            dead_lettered_at    timestamptz,
            dead_letter_reason  text,
            PRIMARY KEY (batch_id, row_number)
        )
        """
    )
    op.execute("CREATE INDEX payment_batch_row_key ON payment_batch_row (client_id, row_key)")
    op.execute(
        """
        CREATE TABLE batch_outbox (
            batch_id       uuid NOT NULL,
            row_number     integer NOT NULL,
            claimed_until  timestamptz,
            PRIMARY KEY (batch_id, row_number),
            FOREIGN KEY (batch_id, row_number) REFERENCES payment_batch_row (batch_id, row_number)
        )
        """
    )
    op.execute("ALTER TABLE event ALTER COLUMN payment_id DROP NOT NULL")


def downgrade() -> None:
    op.execute("DELETE FROM event WHERE payment_id IS NULL")
    op.execute("ALTER TABLE event ALTER COLUMN payment_id SET NOT NULL")
    op.execute("DROP TABLE batch_outbox")
    op.execute("DROP TABLE payment_batch_row")
    op.execute("DROP TABLE payment_batch")
