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
# Names are not unique (two clients may share one); the newest wins.
_BY_NAME = text("SELECT id FROM client WHERE name = :name ORDER BY id DESC LIMIT 1")


def new_api_key() -> str:
    return API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(api_key: str) -> bytes:
    return hashlib.sha256(api_key.encode()).digest()


async def create(conn: AsyncConnection, name: str, api_key: str) -> int:
    return (await conn.execute(_INSERT, dict(name=name, hash=hash_api_key(api_key)))).scalar_one()


async def authenticate(conn: AsyncConnection, api_key: str) -> int | None:
    """The client id owning `api_key`, or None."""
    return (await conn.execute(_BY_HASH, dict(hash=hash_api_key(api_key)))).scalar_one_or_none()


async def by_name(conn: AsyncConnection, name: str) -> int | None:
    """The id of the newest client named `name`, or None."""
    return (await conn.execute(_BY_NAME, dict(name=name))).scalar_one_or_none()
