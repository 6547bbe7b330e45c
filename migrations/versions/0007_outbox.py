"""The outbox: events a client must hear about, and their signed webhook deliveries.

`event`: one row per decision a client must hear about (a payment
succeeded, was declined, failed and was refunded, was parked as
indeterminate), written by the very statement or transaction that makes the
decision (app/payments/sql.py, app/payments/phases.py::park), so neither
exists without the other. Rows are never updated. `type` is a dotted name
checked for its shape only: the allow-list is in app/outbox/events.py, so a
later type (`payment.returned`) needs no schema change. `data` is `json`,
not `jsonb`: it is the payment's public view as its text was built, so a
webhook body and `GET /v1/events` show the fields in the order the API
shows them.

`time_ordered_uuid()`: event ids are UUIDv7, made by the database at the
moment of the insert (its clock, not a replica's), from gen_random_uuid()
with the first 48 bits replaced by the Unix time in milliseconds and the
version nibble set to 7: the same layout as PostgreSQL 18's uuidv7(),
which PostgreSQL 15 to 17 do not have. Within one millisecond the order is
random; `GET /v1/events` never shows events of the last second
(app/outbox/events.py::FEED_HORIZON_SECONDS), so it never matters.

`webhook_endpoint`: at most one per client for now (its URL and its
signing secret, which must be kept readable to sign with). A second endpoint
per client would key deliveries by (event, endpoint).

`webhook_delivery`: one per event of a client that had an endpoint when
the event was written (inserted by the same statement as the event), with
the state a dispatcher leases, retries and finishes: pending, delivered,
dead (given up after the schedule: for a person, `payments events
redeliver`), cancelled (the endpoint was removed). The partial index holds
only pending rows, ordered by when they are due.

`webhook_attempt`: one row per attempt, inserted when a dispatcher claims
the delivery and completed when it records the answer; a row never
completed is an attempt whose dispatcher died mid-flight.

On a large table: only new tables and a new function; nothing existing is
rewritten or locked beyond the catalogue.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        CREATE FUNCTION time_ordered_uuid() RETURNS uuid
        LANGUAGE sql VOLATILE PARALLEL SAFE AS $$
            SELECT encode(
                set_bit(set_bit(
                    overlay(uuid_send(gen_random_uuid())
                            PLACING substring(int8send(floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint)
                                              FROM 3)
                            FROM 1 FOR 6),
                    52, 1), 53, 1),
                'hex')::uuid
        $$
        """
    )
    op.execute(
        """
        CREATE TABLE event (
            id          uuid PRIMARY KEY DEFAULT time_ordered_uuid(),
            -- The payment's client, copied so that a client's feed is one index range.
            client_id   bigint NOT NULL REFERENCES client (id),
            type        text NOT NULL CHECK (type ~ '^[a-z_]+\\.[a-z_]+$'),
            payment_id  uuid NOT NULL REFERENCES payment (id),
            data        json NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("CREATE INDEX event_client_id ON event (client_id, id)")
    op.execute("CREATE INDEX event_payment_id ON event (payment_id)")
    op.execute(
        """
        CREATE TABLE webhook_endpoint (
            client_id   bigint PRIMARY KEY REFERENCES client (id),
            url         text NOT NULL CHECK (url ~ '^https?://'),
            -- whsec_ + base64 of 32 random bytes (the Standard Webhooks format).
            -- Unlike an API key it cannot be kept as a hash: we sign with it.
            secret      text NOT NULL CHECK (secret LIKE 'whsec\\_%'),
            created_at  timestamptz NOT NULL DEFAULT now(),
            updated_at  timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        """
        CREATE TABLE webhook_delivery (
            event_id          uuid PRIMARY KEY REFERENCES event (id),
            client_id         bigint NOT NULL REFERENCES client (id),
            state             text NOT NULL DEFAULT 'pending'
                CHECK (state IN ('pending', 'delivered', 'dead', 'cancelled')),
            -- Claims made, crashed ones included: the give-up counts them all.
            attempts          integer NOT NULL DEFAULT 0,
            -- `payments events redeliver` starts the schedule again from here
            -- (attempts keep counting, so each attempt keeps its number).
            schedule_from     integer NOT NULL DEFAULT 0,
            next_attempt_at   timestamptz NOT NULL DEFAULT now(),
            -- The dispatcher's lease (a fencing token and an expiry, by the
            -- database's clock), held from the claim until the attempt is recorded.
            lease_token       uuid,
            lease_expires_at  timestamptz,
            last_status       integer,
            last_error        text,
            delivered_at      timestamptz,
            created_at        timestamptz NOT NULL DEFAULT now(),
            updated_at        timestamptz NOT NULL DEFAULT now(),
            CHECK ((state = 'delivered') = (delivered_at IS NOT NULL))
        )
        """
    )
    op.execute(
        "CREATE INDEX webhook_delivery_due ON webhook_delivery (next_attempt_at) WHERE state = 'pending'"
    )
    op.execute(
        """
        CREATE TABLE webhook_attempt (
            event_id      uuid NOT NULL REFERENCES webhook_delivery (event_id),
            attempt       integer NOT NULL,
            url           text,
            started_at    timestamptz NOT NULL DEFAULT now(),
            -- NULL until the dispatcher records the answer: a dispatcher that
            -- died mid-flight leaves its attempt here, without an outcome.
            finished_at   timestamptz,
            -- delivered | retry | dead | cancelled
            outcome       text,
            status_code   integer,
            latency_ms    double precision,
            -- timeout | connection | http_status | rate_limited | no_endpoint
            error_class   text,
            error         text,
            PRIMARY KEY (event_id, attempt)
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TABLE webhook_attempt, webhook_delivery, webhook_endpoint, event")
    op.execute("DROP FUNCTION time_ordered_uuid()")
