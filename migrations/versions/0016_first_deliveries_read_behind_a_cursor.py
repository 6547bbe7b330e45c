"""A webhook's first attempt is read from the events behind a cursor; its delivery row is written after it.

Until this revision the statement that decided a payment wrote its event and,
for a client with an endpoint, a `webhook_delivery` row (pending); the
dispatcher then updated that row twice per attempt (its claim, its record)
beside an attempt row. That is three writes of a row whose every update
moves it in an index, on every webhook, even though nearly every webhook is
delivered the first time.

Now a payment writes its event only. Each event carries the id of the
transaction that wrote it (`written_by`, filled by its default), and one
dispatcher at a time holds `webhook_cursor`: it reads the events after the
cursor, in transaction order, POSTs them, and then, in one statement, moves
the cursor past them and inserts each one's delivery row as its attempt
left it (delivered, pending a retry, dead) with its attempt row. Retries
keep the rows and the claim they had (app/outbox/delivery.py).

Why the transaction's id and not the event's own id or time: an event
becomes visible when its transaction commits, not when it is inserted, so a
cursor over ids or times could move past an event inserted earlier but
committed later, and never come back for it. A cursor over transaction ids
reads only events written by transactions older than every transaction
still running (`pg_snapshot_xmin`): none of those can still commit, so
nothing is ever left behind it. The price: a transaction that writes and
stays open holds every later event back until it ends (docs/outbox-inbox.md
says what that means for a deployment).

Rows of earlier revisions: an event written before this revision has no
`written_by` and is not in the cursor's index; its delivery row, if it has
one, is claimed as before. An event written after it by a service of the
previous revision (while both run) has a delivery row and a `written_by`:
the cursor skips every event that has a delivery row.

On a large table: the column is added without a default first (no rewrite),
its default set after (for new rows only); the partial index holds only the
new rows and is built CONCURRENTLY (writes go on); the cursor is a new
table of one row.

Revision ID: 0016
Revises: 0015
"""

from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Written so that it can be run again after it failed half way (the
    # autocommit block below is not undone by a failure).
    op.execute("SET LOCAL lock_timeout = '10s'")
    op.execute("ALTER TABLE event ADD COLUMN IF NOT EXISTS written_by xid8")
    op.execute("ALTER TABLE event ALTER COLUMN written_by SET DEFAULT pg_current_xact_id()")
    op.execute(
        """
        CREATE TABLE IF NOT EXISTS webhook_cursor (
            -- One row: the dispatchers share one cursor and take turns with it.
            only_one          boolean PRIMARY KEY DEFAULT true CHECK (only_one),
            -- The last event passed, in the order the cursor reads:
            -- (written_by, id). Every event up to it has had its first attempt.
            written_by        xid8 NOT NULL DEFAULT '0',
            event_id          uuid NOT NULL DEFAULT '00000000-0000-0000-0000-000000000000',
            -- The dispatcher holding the cursor (a fencing token and an expiry
            -- by the database's clock), from its read to its move.
            lease_token       uuid,
            lease_expires_at  timestamptz,
            moved_at          timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute("INSERT INTO webhook_cursor DEFAULT VALUES ON CONFLICT DO NOTHING")
    with op.get_context().autocommit_block():
        # A build that failed leaves an invalid index behind: build it again.
        op.execute("DROP INDEX CONCURRENTLY IF EXISTS event_written_by")
        op.execute(
            "CREATE INDEX CONCURRENTLY event_written_by ON event (written_by, id) WHERE written_by IS NOT NULL"
        )


def downgrade() -> None:
    # The previous revision's dispatcher reads delivery rows only: the events
    # still ahead of the cursor get theirs, so that none is left undelivered.
    op.execute(
        """
        INSERT INTO webhook_delivery (event_id, client_id)
        SELECT e.id, e.client_id
          FROM event e JOIN webhook_endpoint w ON w.client_id = e.client_id, webhook_cursor c
         WHERE e.written_by IS NOT NULL AND (e.written_by, e.id) > (c.written_by, c.event_id)
        ON CONFLICT (event_id) DO NOTHING
        """
    )
    op.execute("DROP TABLE webhook_cursor")
    op.execute("DROP INDEX event_written_by")
    op.execute("ALTER TABLE event DROP COLUMN written_by")
