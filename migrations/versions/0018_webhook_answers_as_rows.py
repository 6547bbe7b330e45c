"""An optimisation: the outcomes of a batch of webhook attempts reach the database as one array of rows.

The webhook dispatcher writes what its attempts came to in one statement
per batch (app/outbox/delivery.py): `move` writes each first attempt's
delivery and attempt rows as it moves the cursor, and `record` each
retry's new state. Until this revision each statement took its batch as
ten parallel arrays, one per field (the event ids, the status codes, the
latencies, ...), zipped back into rows by `unnest`. asyncpg, encoding an
array parameter, asks of every element whether it is an array itself,
through Python's abstract base classes, one question per element and
field: that cost the dispatcher more than the values' own encoding
(measured in docs/reference/performance.md, "A batch's outcomes as one
array of rows").

This revision adds one composite type, `webhook_answer`: an attempt's
delivery (its event), the lease it was made under, its client and the URL
it went to, and what came of it. Each statement now takes one array of
it, one element per attempt, and asyncpg asks its question once per
attempt. The columns and rows written are the same.

No table is touched: creating a type takes no lock on any table and is
as quick on a database of a billion deliveries as on an empty one. The
downgrade drops the type, which nothing in the schema uses.

A dispatcher of the previous revision runs against the new schema as it
did (it names no such type). A dispatcher of this revision against the
previous schema has its move and record refused (the type does not exist):
nothing is written, and each batch is read or claimed and sent again once
its lease runs out, as after any failed statement. Run `payments migrate`
first, as the service's own start-up (`make run`) does.

Revision ID: 0018
Revises: 0017
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The fields in the order app/outbox/delivery.py::_answer_rows builds each element.
    op.execute(
        """
        CREATE TYPE webhook_answer AS (
            event_id    uuid,     -- the delivery: its event
            lease_token uuid,     -- the lease the attempt was made under (a first attempt's: the cursor's)
            client_id   bigint,   -- the event's client
            url         text,     -- where it was sent
            state       text,     -- what the delivery becomes: delivered, pending, dead, cancelled
            outcome     text,     -- the attempt's outcome; NULL: still in flight
            retry_in    float8,   -- seconds until the next attempt is due
            status_code int,      -- the HTTP status; NULL: no answer
            latency_ms  float8,
            error_class text,     -- NULL: delivered
            error       text
        )
        """
    )


def downgrade() -> None:
    op.execute("DROP TYPE webhook_answer")
