"""A webhook endpoint may take several events in one POST, if its merchant asks for it.

Until this revision every webhook was one event in one POST, the Standard
Webhooks message: its id in `webhook-id`, the event in the body. Each POST
costs the dispatcher the same work whatever it carries (a request built
and signed, a write and a read on the socket, an answer parsed), and at a
steady stream of payments that work is most of what the outbox costs
(docs/reference/performance.md, "Several events in one POST").

This revision adds `webhook_endpoint.events_per_post`: at most how many
events the dispatcher may put in one POST to that endpoint. 1, the
default and every existing endpoint's value, keeps the one-event message.
A merchant that sets more (`payments clients set-webhook ...
--events-per-post N`) receives, when several of its events wait for a
first attempt at once, one signed POST whose body lists them, each with
its own id (docs/outbox-inbox.md#several-events-in-one-post). A retry is
always one event in one POST, so such an endpoint takes both forms.

On a large table: a column added with a constant default is a catalogue
change, and no row is rewritten. Its CHECK is verified against the rows
already there, a read of the whole table under its ACCESS EXCLUSIVE lock;
the table holds one row per client with an endpoint, not one per payment
or event, so the read is short. The downgrade drops the column, a
catalogue change too.

A dispatcher of the previous revision runs against the new schema as it
did (it reads no such column, and sends one event a POST). A dispatcher of
this revision against the previous schema has its read refused (the column
does not exist): nothing is sent and nothing written, and it tries again
after its back-off. Run `payments migrate` first, as the service's own
start-up (`make run`) does.

Revision ID: 0019
Revises: 0018
"""

from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        """
        ALTER TABLE webhook_endpoint
          ADD COLUMN events_per_post smallint NOT NULL DEFAULT 1
              CONSTRAINT webhook_endpoint_events_per_post_check CHECK (events_per_post BETWEEN 1 AND 100)
        """
    )


def downgrade() -> None:
    op.execute("ALTER TABLE webhook_endpoint DROP COLUMN events_per_post")
