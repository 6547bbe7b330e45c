"""The console's sessions: one row per login, so that a login can end.

Where it sits: under the console's login, logout and every page's check
(app/console/routes.py), on the `console_session` table (migration 0010);
nothing on a payment's path touches it. The browser holds a random id (the
cookie); the table holds its SHA-256, so reading the table opens nothing.
A session opens the console while it is not revoked (logout sets
`revoked_at`), not expired (`expires_at`, CONSOLE_SESSION_SECONDS after the
login) and made under the OPERATOR_TOKEN in force: each row keeps a
fingerprint of the token, so a new token ends every older session even
though no row was touched. Each login first purges the sessions that have
ended, so the table holds about one row per live login. Every statement
here runs on the primary (`Services.engine`), never on the pages' read
engine, which may be a standby still showing a revoked session as open.
"""

from __future__ import annotations

import hashlib
import secrets

from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

# A cookie longer than any id this module makes is not looked up at all.
MAX_ID_LENGTH = 64
_FINGERPRINT_CONTEXT = b"exactly-once-payments console session token fingerprint v1\x00"


def fingerprint(token: SecretStr) -> bytes:
    """What a session remembers of the token it was made under (not the token)."""
    return hashlib.sha256(_FINGERPRINT_CONTEXT + token.get_secret_value().encode()).digest()


def _id_hash(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode()).digest()


async def open_session(conn: AsyncConnection, token: SecretStr, seconds: int) -> str:
    """A new session under `token`, lasting `seconds`; its id, for the cookie. Run in one transaction."""
    current = fingerprint(token)
    await conn.execute(
        text("DELETE FROM console_session WHERE expires_at <= now() OR revoked_at IS NOT NULL "
             "OR token_fingerprint <> :current"),
        dict(current=current),
    )
    session_id = secrets.token_urlsafe(32)
    await conn.execute(
        text("INSERT INTO console_session (id_hash, token_fingerprint, expires_at) "
             "VALUES (:id_hash, :current, now() + make_interval(secs => :seconds))"),
        dict(id_hash=_id_hash(session_id), current=current, seconds=float(seconds)),
    )
    return session_id


async def is_open(conn: AsyncConnection, session_id: str | None, token: SecretStr) -> bool:
    """`session_id` names a live session made under `token`."""
    if not session_id or len(session_id) > MAX_ID_LENGTH:
        return False
    found = await conn.scalar(
        text("SELECT true FROM console_session WHERE id_hash = :id_hash AND token_fingerprint = :current "
             "AND revoked_at IS NULL AND expires_at > now()"),
        dict(id_hash=_id_hash(session_id), current=fingerprint(token)),
    )
    return bool(found)


async def revoke(conn: AsyncConnection, session_id: str | None) -> None:
    """End the session `session_id` now (nothing if there is none)."""
    if not session_id or len(session_id) > MAX_ID_LENGTH:
        return
    await conn.execute(
        text("UPDATE console_session SET revoked_at = now() WHERE id_hash = :id_hash AND revoked_at IS NULL"),
        dict(id_hash=_id_hash(session_id)),
    )
