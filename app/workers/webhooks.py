"""The webhook dispatcher, inside `payments worker`: claim due deliveries, POST each, record it.

Where it sits: after the commit. A phase wrote the event and its delivery
with the decision (app/outbox/events.py); this loop (`dispatch_loop`) is the
only thing that sends them, by the three steps of app/outbox/delivery.py:
claim (committed), POST (no transaction held), record (fenced by the lease;
`Recorder` puts every attempt that finished meanwhile into one statement).
Up to `webhook_concurrency` deliveries are in flight, each in a task of its
own. Several workers may run this loop: the claim's FOR UPDATE SKIP LOCKED
and the lease keep each delivery with one of them at a time.
docs/outbox-inbox.md#4-delivery-claim-post-record explains the batching, the
backoff, and what a crash leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from app.db.errors import database_unavailable, describe, loggable
from app.db.transaction import one_statement
from app.outbox import delivery, egress
from app.outbox.delivery import Claimed, LeaseLost
from app.outbox.sealing import SecretsKey
from app.machine.crash import reached
from app.services import Services
from app.workers import outage_backoff, pause

log = logging.getLogger(__name__)


# The most attempts one record statement carries.
RECORD_BATCH = 100
# How long a finished attempt waits for others still in flight to join its
# record statement (`Recorder`), at most; with nothing else in flight, none.
RECORD_LINGER_SECONDS = 0.02


class Recorder:
    """Records finished attempts in batches: one statement for all that finished since the last one.

    A delivery's task hands over its attempt and waits until it is recorded,
    so its slot stays taken (and its lease held) until then, as if it had
    recorded it alone. While one statement runs, the attempts finishing
    meanwhile queue up and go in the next. And when an attempt finishes
    while others are still in flight (a claim leases a batch, and their
    POSTs end within milliseconds of each other), it waits up to
    RECORD_LINGER_SECONDS for them, so that one statement records most of a
    claim's batch instead of a few of its attempts (measured in
    docs/reference/performance.md#judged-side-by-side-met-runs-7-and-8). At
    a trickle, with nothing else in flight, an attempt is recorded at once,
    alone.
    """

    def __init__(self, services: Services, in_flight: Callable[[], int]) -> None:
        self.engine = services.engine
        self.in_flight = in_flight  # deliveries being POSTed or recorded, this one included
        self.queue: asyncio.Queue[tuple[delivery.Attempted, asyncio.Future[bool]]] = asyncio.Queue()

    async def record(self, attempted: delivery.Attempted) -> None:
        """Wait until the attempt is recorded; LeaseLost if it was not, or the record's own error."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        await self.queue.put((attempted, done))
        if not await done:
            raise LeaseLost(f"delivery of event {attempted.claimed.event_id} was claimed again; "
                            "this attempt is not recorded")

    async def run(self) -> None:
        while True:
            batch = [await self.queue.get()]
            if self.queue.qsize() + 1 < self.in_flight():
                await asyncio.sleep(RECORD_LINGER_SECONDS)  # let the others finishing now join this statement
            while len(batch) < RECORD_BATCH and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            try:
                recorded = await one_statement(self.engine, delivery.record, [a for a, _ in batch])
            except Exception as exc:
                for _, done in batch:
                    if not done.done():
                        done.set_exception(exc)
                continue
            for attempted, done in batch:
                if not done.done():  # its task may have been cancelled by a stop
                    done.set_result(attempted.claimed.event_id in recorded)


# What an attempt records when nothing could be sent.
NOT_OPENED = delivery.Answer(None, 0.0, "sealed_secret",
                             "the signing secret cannot be opened with WEBHOOK_SECRETS_KEY")
NOT_HTTPS = delivery.Answer(None, 0.0, "refused_scheme", egress.NOT_HTTPS)


async def deliver(services: Services, http: aiohttp.ClientSession, recorder: Recorder, claimed: Claimed,
                  policy: egress.EgressPolicy) -> str:
    """POST one claimed delivery and record what came of it; the outcome."""
    settings = services.settings
    if claimed.url is None:
        answer = None  # the endpoint was removed after the event was written
    elif not policy.permits_scheme(claimed.url):
        answer = NOT_HTTPS  # registered before the policy, or while WEBHOOK_ALLOW_HTTP was on
    elif claimed.secret is None:
        answer = NOT_OPENED  # sealed by a key no longer in WEBHOOK_SECRETS_KEY
    else:
        answer = await delivery.post(http, claimed, settings.webhook_timeout_seconds)
        reached(settings.payments_crash_at, "webhook-after-delivery")
    decision = delivery.decide(
        answer, claimed.due_attempt, max_attempts=settings.webhook_max_attempts,
        base=settings.webhook_backoff_base_seconds, cap=settings.webhook_backoff_cap_seconds,
    )
    no_answer = delivery.Answer(None, 0.0, "no_endpoint", "the client has no webhook endpoint")
    await recorder.record(delivery.Attempted(claimed, answer or no_answer, decision))
    if decision.outcome == delivery.DEAD:
        log.warning("webhook %s to client %s is dead after %s attempts (%s); `payments events redeliver %s`",
                    claimed.event_id, claimed.client_id, claimed.attempt, answer and answer.error, claimed.event_id)
    return decision.outcome


async def _deliver_logged(services: Services, http: aiohttp.ClientSession, recorder: Recorder, claimed: Claimed,
                          policy: egress.EgressPolicy) -> None:
    try:
        await deliver(services, http, recorder, claimed, policy)
    except LeaseLost as exc:
        log.warning("%s", exc)
    except Exception as exc:
        # The POST is over; only the record failed. The lease runs out and
        # the delivery is sent again: at least once, never lost.
        if database_unavailable(exc):
            log.warning("webhook %s: the attempt could not be recorded, the database is unavailable (%s); "
                        "it will be sent again", claimed.event_id, describe(exc))
        else:
            log.error("webhook %s: the attempt could not be recorded; it will be sent again\n%s",
                      claimed.event_id, loggable(exc))


async def dispatch_loop(services: Services, stop: asyncio.Event) -> None:
    """Deliver until `stop` is set; deliveries in flight are then cancelled (their leases run out)."""
    settings = services.settings
    running: set[asyncio.Task] = set()
    failures = 0  # claims failed in a row
    refill = max(1, settings.webhook_concurrency // 2)
    recorder = Recorder(services, in_flight=lambda: len(running))
    policy = egress.EgressPolicy.from_settings(settings)
    if settings.webhook_secrets_key is None:  # `payments worker` refuses to start without it
        raise RuntimeError("WEBHOOK_SECRETS_KEY is not set: webhook secrets cannot be opened to sign with")
    key = SecretsKey(settings.webhook_secrets_key.get_secret_value())
    recording = asyncio.create_task(recorder.run())
    async with delivery.session(max_connections=settings.webhook_concurrency * 2, policy=policy) as http:
        try:
            while not stop.is_set():
                free = settings.webhook_concurrency - len(running)
                if running and free < refill:
                    # Most slots are busy: wait for half of them, so that
                    # one claim leases a batch instead of one delivery.
                    await asyncio.wait(running, timeout=settings.worker_poll_seconds,
                                       return_when=asyncio.FIRST_COMPLETED)
                    continue
                try:
                    claimed = await one_statement(
                        services.engine, delivery.claim, limit=free, lease_seconds=settings.webhook_lease_seconds,
                        key=key,
                    )
                except Exception as exc:
                    failures += 1
                    wait = outage_backoff(failures, settings.worker_poll_seconds)
                    if database_unavailable(exc):
                        log.warning("webhook claim failed, the database is unavailable (%s); next try in %.1f s",
                                    describe(exc), wait)
                    else:
                        log.error("webhook claim failed; next try in %.1f s\n%s", wait, loggable(exc))
                    await pause(stop, wait)
                    continue
                failures = 0
                if claimed:
                    reached(settings.payments_crash_at, "webhook-after-claim")
                for item in claimed:
                    task = asyncio.create_task(_deliver_logged(services, http, recorder, item, policy))
                    running.add(task)
                    task.add_done_callback(running.discard)
                if len(claimed) < free:
                    # Nothing more is due: rest until the next poll, or stop.
                    await pause(stop, settings.worker_poll_seconds)
                # Otherwise there may be more due right now: go round again.
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            recording.cancel()
            await asyncio.gather(recording, return_exceptions=True)
