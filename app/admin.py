"""Admin operations on the service's database: migrate it, create clients, set their webhooks, redeliver events.

Off the request path: the library under the `payments` command's admin
commands (app/cli.py, which only parses and prints) and under the development
tooling that sets the system up (devtools/, bench/). Each call takes the
database URL, opens an engine of its own, does its work in one transaction
and disposes of the engine. Each runs its own event loop (asyncio.run): call
them where no loop is running, or from a thread of their own.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from app import client_accounts
from app.config import asyncpg_url
from app.db.transaction import atomic, autocommit, read
from app.idempotency import partitions
from app.outbox import delivery, endpoints
from app.outbox.egress import EgressPolicy
from app.outbox.sealing import SecretsKey

T = TypeVar("T")


class MigrationRefused(RuntimeError):
    """A migration needs something from the operator first (the message says what)."""

# The Alembic configuration at the root of the checkout; its script_location
# (migrations/) is found relative to it.
ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"


def on_database(url: str, work: Callable[[AsyncEngine], Awaitable[T]]) -> T:
    """Run `work(engine)` against `url` with an engine of its own, disposed after."""

    async def go() -> T:
        engine = create_async_engine(asyncpg_url(url), hide_parameters=True)
        try:
            return await work(engine)
        finally:
            await engine.dispose()

    return asyncio.run(go())


def migrate_database(url: str, webhook_secrets_key: str | None = None) -> list[str]:
    """Bring the schema to the newest Alembic revision, and the key table's partitions a week ahead.

    The partitions are part of a usable schema: a claim on a day with no
    partition is refused (503), so a fresh database, or one whose worker has
    not run for a while, gets today's and the coming days' here. Returns the
    names of the partitions created. `webhook_secrets_key` seals the webhook
    secrets an older revision kept in the clear (0009; refused without it
    if there are any).
    """
    from alembic import command
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.attributes["database_url"] = url
    config.attributes["webhook_secrets_key"] = webhook_secrets_key
    command.upgrade(config, "head")
    return on_database(url, lambda engine: autocommit(engine, partitions.ensure_ahead))


class NameTaken(Exception):
    """Clients with this name exist already (`ids`, oldest first)."""

    def __init__(self, name: str, ids: list[int]) -> None:
        super().__init__(f"a client named {name!r} exists already: id {', '.join(map(str, ids))}")
        self.ids = ids


def create_client(url: str, name: str, api_key: str | None = None, *, unique_name: bool = False) -> tuple[int, str]:
    """A new client named `name` with `api_key`, else a new one: (its id, its key).

    `unique_name`: raise NameTaken, creating nothing, if a client has that
    name already (what `payments clients create` asks for). Without it names
    may repeat (the tests, demos and bench name their clients freely).
    Only the key's hash is stored: the key returned is the one chance to see it.
    """
    api_key = api_key or client_accounts.new_api_key()
    create = client_accounts.create_named_once if unique_name else client_accounts.create
    created = on_database(url, lambda engine: atomic(engine, create, name, api_key))
    if isinstance(created, list):
        raise NameTaken(name, created)
    return created, api_key


async def _client_id(conn, client: int | str) -> int | list[int] | None:
    """The id of `client` (an id, or a name held by one client); the ids sharing the name if several; None if none."""
    if isinstance(client, int):
        return client if await client_accounts.exists(conn, client) else None
    ids = await client_accounts.named(conn, client)
    return None if not ids else ids[0] if len(ids) == 1 else ids


async def _for_client(
    conn, client: int | str, done: str, action: Callable[[int], Awaitable[Any]]
) -> tuple[str, Any]:
    """(`done`, what `action(client_id)` returned); or ("no-client", None), or ("ambiguous", the ids), changing nothing."""
    client_id = await _client_id(conn, client)
    if client_id is None:
        return "no-client", None
    if isinstance(client_id, list):
        return "ambiguous", client_id
    return done, await action(client_id)


def client_of_key(url: str, api_key: str) -> int | None:
    """The id of the client that `api_key` authenticates, or None."""
    return on_database(url, lambda engine: read(engine, client_accounts.authenticate, api_key))


def set_webhook(
    url: str, client: int | str, webhook_url: str, *, policy: EgressPolicy, secrets_key: str,
    rotate_secret: bool = False, overlap_hours: float = 0.0, events_per_post: int | None = None,
) -> tuple[str, Any]:
    """Set the webhook endpoint of `client` (its id, or a name only one client has), its secret sealed with `secrets_key`.

    Returns ("set", the signing secret if it is new, else None),
    ("no-client", None) or ("ambiguous", the ids of the clients with that
    name: nothing is changed). Raises InvalidWebhookUrl (the egress `policy`
    refuses the URL) before it touches the database. With `rotate_secret`,
    the old secret is still sent beside the new one for `overlap_hours`.
    `events_per_post`: at most how many events one POST carries (None: the
    endpoint's as it is, 1 for a new one); ValueError, nothing written,
    outside 1 to endpoints.MAX_EVENTS_PER_POST.
    """
    endpoints.checked_url(webhook_url, policy)
    key = SecretsKey(secrets_key)

    async def work(conn) -> tuple[str, Any]:
        return await _for_client(conn, client, "set", lambda client_id: endpoints.set_endpoint(
            conn, client_id, webhook_url, key, rotate_secret=rotate_secret, overlap_seconds=overlap_hours * 3600,
            events_per_post=events_per_post))

    return on_database(url, lambda engine: atomic(engine, work))


def remove_webhook(url: str, client: int | str) -> tuple[str, Any]:
    """Remove the webhook endpoint of `client` (its id, or a name only one client has).

    Returns ("removed", how many pending deliveries were cancelled, None if
    there was no endpoint), ("no-client", None) or ("ambiguous", the ids of
    the clients with that name: nothing is changed).
    """

    async def work(conn) -> tuple[str, Any]:
        return await _for_client(conn, client, "removed", lambda client_id: endpoints.remove_endpoint(conn, client_id))

    return on_database(url, lambda engine: atomic(engine, work))


def webhook_endpoint(url: str, client_id: int, secrets_key: str) -> tuple[str, str | None] | None:
    """The (URL, signing secret) of the webhook endpoint of client `client_id`; None if it has none."""
    key = SecretsKey(secrets_key)

    async def work(conn) -> tuple[str, str | None] | None:
        return await endpoints.get_endpoint(conn, client_id, key)

    return on_database(url, lambda engine: read(engine, work))


def reseal_webhook_secrets(url: str, secrets_key: str) -> int:
    """Every webhook secret sealed again under the first key of `secrets_key`; how many endpoints.

    The step of a key rotation (docs/outbox-inbox.md#signing-secrets-at-rest):
    with the new key first and the old one after it, every row is opened and
    sealed anew in one transaction; then the old key can be dropped.
    """
    key = SecretsKey(secrets_key)
    return on_database(url, lambda engine: atomic(engine, endpoints.reseal_all, key))


def redeliver_event(url: str, event_id: uuid.UUID) -> tuple[str, dict[str, Any] | None]:
    """Deliver the event's webhook again, with a fresh retry schedule: (what happened, its delivery row).

    "queued": made pending and due now; "pending": it already was (nothing
    changed); "no-endpoint": its client has no webhook endpoint; "no-event":
    no such event (the row is None).
    """

    async def work(conn) -> tuple[str, dict[str, Any] | None]:
        found = await delivery.delivery(conn, event_id)
        if found is None:
            return "no-event", None
        if found["endpoint_url"] is None:
            return "no-endpoint", found
        if not await delivery.redeliver(conn, event_id):
            return "pending", found
        return "queued", found

    return on_database(url, lambda engine: atomic(engine, work))
