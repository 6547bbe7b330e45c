"""The operator console's sessions, held by the server so that they can end.

One row per login (app/console/sessions.py). The browser's cookie holds a
random session id; the row holds only its SHA-256 (`id_hash`), so a copy of
the table opens nothing. A session opens the console while it is not
revoked (`revoked_at`, set by logout), not expired (`expires_at`, set at
login from CONSOLE_SESSION_SECONDS) and made under the operator token in
force (`token_fingerprint`, a hash of OPERATOR_TOKEN: a new token ends every
session made under the old one). `console_session_expires_at` serves the
purge of ended sessions that each login runs.

On a large table: this makes a new, empty table and its index, a catalogue
change that takes no lock on any existing table, instant whatever else the
database holds. The downgrade drops it (every console session ends; the
cookie of the previous revision was not stored anywhere).
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    op.create_table(
        "console_session",
        sa.Column("id_hash", sa.LargeBinary, primary_key=True),
        sa.Column("token_fingerprint", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.TIMESTAMP(timezone=True), nullable=False, server_default=sa.text("now()")),
        sa.Column("expires_at", sa.TIMESTAMP(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.TIMESTAMP(timezone=True), nullable=True),
        sa.CheckConstraint("octet_length(id_hash) = 32", name="console_session_id_hash_sha256"),
        sa.CheckConstraint("expires_at > created_at", name="console_session_expires_after_creation"),
    )
    op.create_index("console_session_expires_at", "console_session", ["expires_at"])


def downgrade() -> None:
    op.drop_table("console_session")
