"""The naive twin's tables: the same payment and ledger, without any protection.

The naive twin (naive_twin/, a deliberate counter-example for benchmarks and
demos) writes the same business rows as the service, but to a schema of its
own with none of the service's safety: no key table, and no uniqueness of a
client's payment reference, so a retried request really does pay twice there.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE SCHEMA naive")
    # LIKE copies the columns, defaults and CHECKs, but no unique index and no
    # foreign key: exactly the protections the naive twin goes without.
    op.execute("CREATE TABLE naive.payment (LIKE public.payment INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
    op.execute("ALTER TABLE naive.payment ADD PRIMARY KEY (id)")
    op.execute(
        "CREATE TABLE naive.ledger_entry (LIKE public.ledger_entry INCLUDING DEFAULTS INCLUDING CONSTRAINTS "
        "INCLUDING IDENTITY)"
    )


def downgrade() -> None:
    op.execute("DROP SCHEMA naive CASCADE")
