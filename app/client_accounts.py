"""Clients (merchant platforms) and their API keys.

An API key is 32 random bytes shown once at creation; only its SHA-256 is
stored. A fast hash is right here (unlike for passwords): the key has 256 bits
of entropy, so there is nothing to brute-force, and it is checked on every
request.
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

API_KEY_PREFIX = "sk_test_"

_INSERT = text("INSERT INTO client (name, api_key_hash) VALUES (:name, :hash) RETURNING id")
_BY_HASH = text("SELECT id FROM client WHERE api_key_hash = :hash")
# Names are not unique in the table (the `payments` command refuses a name
# already taken, but clients made before, or with --allow-duplicate-name,
# may share one): a name finds every client that has it, oldest first.
_BY_NAME = text("SELECT id FROM client WHERE name = :name ORDER BY id")
_BY_ID = text("SELECT id FROM client WHERE id = :id")
# One name at a time: the check that a name is free and the insert that
# takes it are not raced by another creation of the same name.
_LOCK_NAME = text("SELECT pg_advisory_xact_lock(hashtextextended('client name:' || :name, 0))")


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


async def create(conn: AsyncConnection, name: str, api_key: str) -> int:
    return (await conn.execute(_INSERT, dict(name=name, hash=hash_api_key(api_key)))).scalar_one()


async def authenticate(conn: AsyncConnection, api_key: str) -> int | None:
    """The client id owning `api_key`, or None."""
    return (await conn.execute(_BY_HASH, dict(hash=hash_api_key(api_key)))).scalar_one_or_none()


async def named(conn: AsyncConnection, name: str) -> list[int]:
    """The ids of the clients named `name`, oldest first (none, one, or several)."""
    return list((await conn.execute(_BY_NAME, dict(name=name))).scalars())


async def exists(conn: AsyncConnection, client_id: int) -> bool:
    return (await conn.execute(_BY_ID, dict(id=client_id))).scalar_one_or_none() is not None


async def create_named_once(conn: AsyncConnection, name: str, api_key: str) -> int | list[int]:
    """A new client named `name`, its id; or, if clients have that name already, their ids (nothing created).

    In the caller's transaction, which holds a lock on the name until it ends.
    """
    await conn.execute(_LOCK_NAME, dict(name=name))
    if taken := await named(conn, name):
        return taken
    return await create(conn, name, api_key)
