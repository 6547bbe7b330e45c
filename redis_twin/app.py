"""THE REDIS TWIN: the naive twin's payment flow behind idempotency keys kept in Redis. A counter-example.

Where it sits: an HTTP middleware in front of the naive twin's route
(naive_twin/app.py::create_app), so the payment work is the naive twin's,
step for step, in the same `naive` tables; only the key handling is added,
the way an idempotency middleware backed by Redis usually does it:

    1. GET the key (scoped to the caller's credential). COMPLETED: replay the
       stored answer. IN_PROGRESS: 409, retry later.
    2. SET the key to IN_PROGRESS with NX and a TTL (REDIS_TWIN_LOCK_SECONDS),
       so only one attempt runs; the TTL is there because a crashed attempt
       would otherwise hold the key forever.
    3. Run the payment: the naive twin's commits in PostgreSQL, its calls to
       the PSP and the rail (with fresh keys: this code trusts Redis to have
       kept the retry out).
    4. SET the key to COMPLETED with the answer, then answer.

Steps 3 and 4 write to two stores, and nothing makes them one. A crash
between them (REDIS_TWIN_CRASH_BEFORE_COMPLETED=1 dies exactly there) leaves
the payment committed and paid, and the key IN_PROGRESS until its TTL runs
out; then the retry finds no key at all and pays again. Shortening the TTL
makes the window come sooner, lengthening it makes a crashed payment
unretryable for longer; no value closes it. The service closes it by keeping
the key in the same database as the payment and finishing both in one
transaction (docs/naive-vs-safe.md#the-redis-window).

Never copy this: `make demo-redis-window` and tests/crash/test_redis_twin.py
show the duplicate charge it makes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os

import redis.asyncio as redis
from fastapi import FastAPI, Request, Response
from redis.exceptions import RedisError

from app.api.errors import problem_response
from app.config import Settings
from app.idempotency.keys import parse_idempotency_key
from app.problems import IDEMPOTENCY_KEY_MISSING, REQUEST_IN_PROGRESS, ProblemError, ProblemType
from naive_twin.app import create_app as create_naive_app

IN_PROGRESS = "IN_PROGRESS"
COMPLETED = "COMPLETED"
# How long a COMPLETED answer is kept for replays: the service's key retention.
RETENTION_SECONDS = 24 * 3600
KEY_STORE_UNAVAILABLE = ProblemType(
    "key-store-unavailable", 503, "The twin cannot reach Redis",
    "THE REDIS TWIN keeps its idempotency keys in Redis and could not reach it; nothing was done.",
)


class RedisKeys:
    """The twin's key store: one Redis string per (credential, key), JSON holding its state and answer."""

    def __init__(self, url: str, prefix: str, lock_seconds: int) -> None:
        self.client = redis.from_url(url)
        self.prefix = prefix
        self.lock_seconds = lock_seconds

    def name(self, authorization: str, key: str) -> str:
        # Scoped to the caller's credential, as the service scopes a key to its client.
        caller = hashlib.sha256(authorization.encode()).hexdigest()[:16]
        return f"{self.prefix}:{caller}:{key}"

    async def get(self, name: str) -> dict | None:
        raw = await self.client.get(name)
        return None if raw is None else json.loads(raw)

    async def lock(self, name: str) -> bool:
        return bool(await self.client.set(name, json.dumps({"state": IN_PROGRESS}), nx=True, ex=self.lock_seconds))

    async def complete(self, name: str, status: int, body: bytes, content_type: str | None) -> None:
        answer = {"state": COMPLETED, "status": status, "body": body.decode(), "content_type": content_type}
        await self.client.set(name, json.dumps(answer), ex=RETENTION_SECONDS)

    async def seconds_left(self, name: str) -> int:
        return max(1, math.ceil(await self.client.pttl(name) / 1000))

    async def release(self, name: str) -> None:
        await self.client.delete(name)


def redis_url() -> str:
    url = os.environ.get("REDIS_URL")
    if not url:
        raise SystemExit("THE REDIS TWIN needs REDIS_URL (redis_twin/server.py starts a server and sets it)")
    return url


def create_app(settings: Settings | None = None) -> FastAPI:
    app = create_naive_app(settings)
    app.title = "THE REDIS TWIN (unsafe, for comparison only)"
    keys = RedisKeys(redis_url(), os.environ.get("REDIS_TWIN_KEY_PREFIX", "redis-twin"),
                     int(os.environ.get("REDIS_TWIN_LOCK_SECONDS", "30")))
    # For the demo and the test: die after the payment committed, before Redis hears of it.
    crash_before_completed = os.environ.get("REDIS_TWIN_CRASH_BEFORE_COMPLETED") == "1"

    @app.middleware("http")
    async def idempotency_in_redis(request: Request, call_next) -> Response:
        if request.method != "POST" or request.url.path != "/v1/payments":
            return await call_next(request)
        raw = request.headers.get("idempotency-key")
        if raw is None:
            return problem_response(IDEMPOTENCY_KEY_MISSING, "this request needs an Idempotency-Key header")
        try:
            name = keys.name(request.headers.get("authorization", ""), parse_idempotency_key(raw))
        except ProblemError as exc:
            return problem_response(exc.problem, exc.detail)
        try:
            stored = await keys.get(name)
            if stored is not None and stored["state"] == COMPLETED:
                return Response(stored["body"], stored["status"], media_type=stored["content_type"])
            if stored is not None or not await keys.lock(name):
                # Until the lock's TTL runs out, whether its attempt is alive or long dead.
                return problem_response(REQUEST_IN_PROGRESS, "an attempt with this key holds its lock in Redis",
                                        headers={"Retry-After": str(await keys.seconds_left(name))})
        except RedisError as exc:
            return problem_response(KEY_STORE_UNAVAILABLE, f"Redis did not answer: {exc}", headers={"Retry-After": "1"})
        # The payment itself: the naive twin's commits in PostgreSQL and its calls to the PSP and the rail.
        response = await call_next(request)
        body = b"".join([chunk async for chunk in response.body_iterator])
        try:
            if response.status_code >= 500:
                await keys.release(name)  # let the client try again, as such middlewares do
            else:
                if crash_before_completed:
                    os._exit(137)  # THE WINDOW: PostgreSQL has the payment, Redis still says IN_PROGRESS
                await keys.complete(name, response.status_code, body, response.headers.get("content-type"))
        except RedisError:
            pass  # the same window, opened by Redis instead of a crash: the payment is made, so answer it
        return Response(body, response.status_code, headers=dict(response.headers))

    return app
