"""The webhook dispatcher, inside `payments worker`: read or claim, POST each, record.

Where it sits: after the commit. A phase wrote the event with the decision
(app/outbox/events.py); this dispatcher (`dispatch_loop`) is the only thing
that sends it, in two loops over the steps of app/outbox/delivery.py.
`first_attempts` leases the cursor and reads the events after it, POSTs
them (no transaction held; several in one POST to an endpoint that asked
for lists), and moves the cursor past them, writing each one's delivery
row as its attempt left it; once it has caught up, it rests
`webhook_poll_seconds` before it reads again. `retries` claims the
delivery rows that are due (a failed first attempt's, one whose dispatcher
died), POSTs, and records (fenced by each row's lease; `Recorder` puts
every attempt that finished meanwhile into one statement). Up to
`webhook_concurrency` POSTs are in flight, each in a task of its own.
Several workers may run both loops: the cursor's lease keeps each batch
with one of them, the claim's FOR UPDATE SKIP LOCKED and the lease each
retry. docs/outbox-inbox.md#4-delivery-claim-post-record explains the
cursor, the batching, the backoff, and what a crash leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from app.db.errors import database_unavailable, describe, loggable
from app.db.transaction import one_statement
from app.outbox import delivery, egress, http1
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
NO_ENDPOINT = delivery.Answer(None, 0.0, "no_endpoint", "the client has no webhook endpoint")


async def attempt(services: Services, http: http1.Client, post: list[Claimed],
                  policy: egress.EgressPolicy) -> list[delivery.Attempted]:
    """POST one delivery (a first attempt or a claimed retry), or several of one endpoint in one list POST
    (first attempts, delivery.together); what came of each and what follows. Records nothing."""
    settings = services.settings
    first = post[0]  # the events of one POST share its endpoint: its URL and its secrets
    if first.url is None:
        answer = None  # the endpoint was removed after the event was written
    elif not policy.permits_scheme(first.url):
        answer = NOT_HTTPS  # registered before the policy, or while WEBHOOK_ALLOW_HTTP was on
    elif first.secret is None:
        answer = NOT_OPENED  # sealed by a key no longer in WEBHOOK_SECRETS_KEY
    else:
        timeout = settings.webhook_timeout_seconds
        answer = await (delivery.post(http, first, timeout) if len(post) == 1
                        else delivery.post_list(http, post, timeout))
        reached(settings.payments_crash_at, "webhook-after-delivery")
    return [
        delivery.Attempted(claimed, answer or NO_ENDPOINT, delivery.decide(
            answer, claimed.due_attempt, max_attempts=settings.webhook_max_attempts,
            base=settings.webhook_backoff_base_seconds, cap=settings.webhook_backoff_cap_seconds,
        ))
        for claimed in post
    ]


def _log_dead(attempted: delivery.Attempted) -> None:
    if attempted.decision.outcome == delivery.DEAD:
        claimed = attempted.claimed
        log.warning("webhook %s to client %s is dead after %s attempts (%s); `payments events redeliver %s`",
                    claimed.event_id, claimed.client_id, claimed.attempt, attempted.answer.error, claimed.event_id)


async def deliver(services: Services, http: http1.Client, recorder: Recorder, claimed: Claimed,
                  policy: egress.EgressPolicy) -> str:
    """POST one claimed delivery and record what came of it; the outcome."""
    [attempted] = await attempt(services, http, [claimed], policy)
    await recorder.record(attempted)
    _log_dead(attempted)
    return attempted.decision.outcome


async def _deliver_logged(services: Services, http: http1.Client, recorder: Recorder, claimed: Claimed,
                          policy: egress.EgressPolicy) -> None:
    """Deliver a claimed retry and record it, logging a failure to record."""
    try:
        await deliver(services, http, recorder, claimed, policy)
    except Exception as exc:
        _log_unrecorded(claimed, exc)


async def _record_started(recorder: Recorder, started: asyncio.Task, post: list[Claimed]) -> None:
    """Record the attempts of a first POST `started` before its batch moved the cursor on, each by its lease."""
    try:
        attempted = await started
    except Exception as exc:
        for claimed in post:
            _log_unrecorded(claimed, exc)
        return
    outcomes = await asyncio.gather(*(recorder.record(a) for a in attempted), return_exceptions=True)
    for a, outcome in zip(attempted, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome  # a stop's cancellation
            _log_unrecorded(a.claimed, outcome)
        else:
            _log_dead(a)


def _log_unrecorded(claimed: Claimed, exc: Exception) -> None:
    """Log an attempt whose record failed. The POST is over; only the record failed: the lease runs out and
    the delivery is sent again, at least once, never lost (or, LeaseLost, another dispatcher holds it now)."""
    if isinstance(exc, LeaseLost):
        log.warning("%s", exc)
    elif database_unavailable(exc):
        log.warning("webhook %s: the attempt could not be recorded, the database is unavailable (%s); "
                    "it will be sent again", claimed.event_id, describe(exc))
    else:
        log.error("webhook %s: the attempt could not be recorded; it will be sent again\n%s",
                  claimed.event_id, loggable(exc))


# How long a batch read behind the cursor waits for its POSTs before it moves
# the cursor on anyway. An attempt still in flight then gets a leased
# delivery row and is recorded when it ends, as a retry is: one slow
# endpoint holds the other clients' webhooks back this long, not for its
# timeout.
CURSOR_PATIENCE_SECONDS = 1.0


@dataclass
class Dispatcher:
    """What the two loops share: the HTTP client, the recorder, and the tasks in flight (the slots)."""

    services: Services
    stop: asyncio.Event
    http: http1.Client
    recorder: Recorder
    policy: egress.EgressPolicy
    key: SecretsKey
    running: set[asyncio.Task]

    def start(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task:
        """Run `work` in a task that holds a slot until it ends."""
        task = asyncio.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)
        return task

    async def wait_for_slots(self) -> int:
        """The slots free now, once at least half of them are (waiting at most a poll); 0 if none came free."""
        settings = self.services.settings
        free = settings.webhook_concurrency - len(self.running)
        if self.running and free < max(1, settings.webhook_concurrency // 2):
            # Most slots are busy: wait for half of them, so that one read
            # or claim takes a batch instead of one delivery.
            await asyncio.wait(self.running, timeout=settings.worker_poll_seconds,
                               return_when=asyncio.FIRST_COMPLETED)
            return 0
        return free


async def first_attempts(d: Dispatcher) -> None:
    """Read the events behind the cursor, POST them, move the cursor: each webhook's first attempt."""
    settings = d.services.settings
    failures = 0  # reads or moves failed in a row
    # What a POST of the last batch could carry, on average: the next read
    # asks for that many events a free slot, so that an endpoint taking
    # lists gets them full, and a read of events that go one a POST reads
    # no more than it sends.
    per_post = 1.0
    while not d.stop.is_set():
        free = await d.wait_for_slots()
        if not free:
            continue
        try:
            batch = await one_statement(d.services.engine, delivery.take, limit=free, per_post=per_post,
                                        lease_seconds=settings.webhook_lease_seconds, key=d.key)
            if batch is None:  # nothing new, or another dispatcher holds the cursor
                failures = 0
                await pause(d.stop, settings.webhook_poll_seconds)
                continue
            if batch.to_send:
                reached(settings.payments_crash_at, "webhook-after-claim")
            # A task per POST: one event, or several of one endpoint that takes lists.
            posts = delivery.together(batch.to_send)
            if posts:
                per_post = sum(post[0].events_per_post for post in posts) / len(posts)
            tasks = {d.start(attempt(d.services, d.http, post, d.policy)): post for post in posts}
            if tasks:
                await asyncio.wait(tasks, timeout=CURSOR_PATIENCE_SECONDS)
            in_flight = {t: post for t, post in tasks.items() if not t.done()}
            try:
                finished = [a for t in tasks if t.done() for a in t.result()]
                moved = await one_statement(d.services.engine, delivery.move, batch, finished,
                                            [c for post in in_flight.values() for c in post],
                                            lease_seconds=settings.webhook_lease_seconds)
            except BaseException:
                for t in in_flight:  # nothing of the batch is written: it is read and sent again
                    t.cancel()
                raise
        except Exception as exc:
            # Nothing of a batch is written unless its move committed: the
            # cursor's lease runs out and the batch is read and sent again.
            failures += 1
            wait = outage_backoff(failures, settings.worker_poll_seconds)
            if database_unavailable(exc):
                log.warning("webhook cursor: read or move failed, the database is unavailable (%s); "
                            "next try in %.1f s", describe(exc), wait)
            else:
                log.error("webhook cursor: read or move failed; next try in %.1f s\n%s", wait, loggable(exc))
            await pause(d.stop, wait)
            continue
        failures = 0
        if not moved:
            log.warning("the webhook cursor was taken over after its lease ran out; its new holder sends "
                        "this batch of %d webhooks again", len(batch.to_send))
            for t in in_flight:
                t.cancel()
            continue
        for attempted in finished:
            _log_dead(attempted)
        for t, post in in_flight.items():
            d.start(_record_started(d.recorder, t, post))
        if not batch.full:
            # Caught up: rest until the next read, or stop. Under a steady
            # stream this rest, not the POST, is most of a webhook's delay.
            await pause(d.stop, settings.webhook_poll_seconds)


async def retries(d: Dispatcher) -> None:
    """Claim the delivery rows that are due (retries, and attempts whose dispatcher died), POST, record."""
    settings = d.services.settings
    failures = 0  # claims failed in a row
    while not d.stop.is_set():
        free = await d.wait_for_slots()
        if not free:
            continue
        try:
            claimed = await one_statement(
                d.services.engine, delivery.claim, limit=free, lease_seconds=settings.webhook_lease_seconds,
                key=d.key,
            )
        except Exception as exc:
            failures += 1
            wait = outage_backoff(failures, settings.worker_poll_seconds)
            if database_unavailable(exc):
                log.warning("webhook claim failed, the database is unavailable (%s); next try in %.1f s",
                            describe(exc), wait)
            else:
                log.error("webhook claim failed; next try in %.1f s\n%s", wait, loggable(exc))
            await pause(d.stop, wait)
            continue
        failures = 0
        if claimed:
            reached(settings.payments_crash_at, "webhook-after-claim")
        for item in claimed:
            d.start(_deliver_logged(d.services, d.http, d.recorder, item, d.policy))
        if len(claimed) < free:
            # Nothing more is due: rest until the next poll, or stop.
            await pause(d.stop, settings.worker_poll_seconds)
        # Otherwise there may be more due right now: go round again.


async def dispatch_loop(services: Services, stop: asyncio.Event) -> None:
    """Deliver until `stop` is set; deliveries in flight are then cancelled (their leases run out)."""
    settings = services.settings
    running: set[asyncio.Task] = set()
    recorder = Recorder(services, in_flight=lambda: len(running))
    policy = egress.EgressPolicy.from_settings(settings)
    if settings.webhook_secrets_key is None:  # `payments worker` refuses to start without it
        raise RuntimeError("WEBHOOK_SECRETS_KEY is not set: webhook secrets cannot be opened to sign with")
    key = SecretsKey(settings.webhook_secrets_key.get_secret_value())
    recording = asyncio.create_task(recorder.run())
    async with delivery.session(max_connections=settings.webhook_concurrency * 2, policy=policy) as http:
        dispatcher = Dispatcher(services, stop, http, recorder, policy, key, running)
        try:
            async with asyncio.TaskGroup() as loops:
                loops.create_task(first_attempts(dispatcher))
                loops.create_task(retries(dispatcher))
        finally:
            for task in list(running):
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            recording.cancel()
            await asyncio.gather(recording, return_exceptions=True)
