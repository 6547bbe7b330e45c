"""Nothing private reaches an error's text: a database error, as logged, names no parameter value.

A statement's parameters are card tokens, names, IBANs and API key hashes.
Whatever raises on the request path, the `_bug` handler in app/api/errors.py
logs the exception with its traceback (every chained exception included), so
that text must not carry them.
"""

from __future__ import annotations

import traceback
import uuid

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError, IntegrityError

from app import client_accounts
from app.db.errors import loggable
from app.config import Settings
from app.db.engine import build_engine
from app.db.transaction import atomic
from app.fastpath.lookup_pool import LookupPool


async def test_a_database_error_from_the_engine_does_not_carry_the_statements_parameters(database_url):
    engine = build_engine(Settings(database_url=database_url))
    secret = f"tok_{uuid.uuid4().hex}"
    try:
        with pytest.raises(DBAPIError) as raised:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT CAST(:card_token AS text) || CAST(1 / 0 AS text)"), {"card_token": secret})
    finally:
        await engine.dispose()

    logged = "".join(traceback.format_exception(raised.value))
    assert "division by zero" in logged
    # Without hide_parameters: "[parameters: ('tok_...',)]" in the text of the error.
    assert secret not in logged


async def test_a_constraint_violation_is_logged_without_the_row_postgresql_quotes_in_its_detail(database_url):
    engine = build_engine(Settings(database_url=database_url))
    secret_name, api_key = f"secret-{uuid.uuid4().hex}", client_accounts.new_api_key()
    try:
        await atomic(engine, client_accounts.create, "first", api_key)
        with pytest.raises(IntegrityError) as raised:  # the same API key hash again: UNIQUE
            await atomic(engine, client_accounts.create, secret_name, api_key)
    finally:
        await engine.dispose()

    key_hash = client_accounts.hash_api_key(api_key).hex()
    # asyncpg's error, chained under SQLAlchemy's, ends with PostgreSQL's DETAIL:
    # "Key (api_key_hash)=(\x...) already exists." A plain log.exception prints it.
    assert key_hash in "".join(traceback.format_exception(raised.value))
    logged = loggable(raised.value)
    assert "api_key_hash" in logged and "UniqueViolationError" in logged  # still says what went wrong
    assert secret_name not in logged and key_hash not in logged


async def test_a_database_error_on_the_lookup_pool_does_not_carry_its_arguments(database_url):
    secret = f"tok_{uuid.uuid4().hex}"
    async with LookupPool(Settings(database_url=database_url)) as lookups:
        with pytest.raises(Exception) as raised:  # asyncpg's own error, with no SQLAlchemy around it
            await lookups.pool.fetchval("SELECT $1::text || (1 / 0)::text", secret)

    logged = "".join(traceback.format_exception(raised.value))
    assert "division by zero" in logged
    assert secret not in logged  # asyncpg never puts a query's arguments into a server error
