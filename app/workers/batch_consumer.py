"""`payments consume`: pay batch rows from the broker, publish the batch outbox, complete finished batches.

Where it sits: beside the API and the worker, over the same services
(app/services.py). Three loops:

    consume   pull row messages from the durable consumer; pay each through
              the payment's machine (app/payments/batches/consumption.py);
              acknowledge only once the row's fate is durable, ask for a later
              redelivery otherwise, dead-letter a poison row after its last delivery
    publish   the outbox to the broker (app/workers/batch_publisher.py)
    complete  batches whose rows are all final: `batch.completed`, once
              (app/payments/batches/progress.py)

Several may run: the broker gives each message to one consumer at a time;
the key table decides the rest. A consumer killed anywhere leaves its
messages unacknowledged, and the broker delivers them again after the ack
wait (docs/batches.md#acknowledge-after-commit).
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvloop
from nats.errors import TimeoutError as NatsTimeout

from app.broker import jetstream
from app.broker.jetstream import RowMessage
from app.config import Settings
from app.db.errors import describe
from app.db.transaction import atomic, read
from app.payments.batches import progress
from app.payments.batches.consumption import Verdict, consume_row
from app.services import Services, open_services
from app.workers import outage_backoff, pause
from app.workers.batch_publisher import publish_loop

log = logging.getLogger(__name__)

CONSUMER_STARTED = "consumer started"  # what devtools waits for
COMPLETE_EVERY_SECONDS = 0.5
FETCH_WAIT_SECONDS = 1.0


async def handle(services: Services, js, msg) -> Verdict | None:
    """One message, start to finish; the verdict acted on (None: no verdict, the ack wait brings it back)."""
    settings = services.settings
    delivery = msg.metadata.num_delivered
    try:
        row = RowMessage.decode(msg.data)
    except (ValueError, KeyError) as exc:
        log.error("not a batch row message (%s): terminated", exc)
        await msg.term()
        return None
    try:
        verdict = await consume_row(services, row.batch_id, row.row_number, delivery=delivery,
                                    max_deliveries=settings.batch_max_deliveries)
    except Exception as exc:
        # The database lost while reading or linking the row: nothing acknowledged.
        log.warning("batch row %s/%s not settled (%s): redelivered later", row.batch_id, row.row_number, describe(exc))
        await msg.nak(delay=outage_backoff(delivery, settings.backoff_base_seconds))
        return None
    if verdict.action == "ack":
        await msg.ack()
    elif verdict.action == "retry":
        await msg.nak(delay=verdict.delay)
    else:
        # Recorded on the row first (durable, and what GET shows); then on the
        # dead-letter stream; then the message stops being delivered.
        await jetstream.dead_letter(js, row, verdict.reason, delivery)
        await msg.term()
    return verdict


async def consume_loop(services: Services, js, stop: asyncio.Event) -> None:
    settings = services.settings
    sub = await until_answered(stop, "bind to the durable consumer", lambda: jetstream.subscribe(
        js, ack_wait=settings.batch_ack_wait_seconds,
        max_ack_pending=max(1000, settings.batch_consumer_concurrency * 4), replicas=settings.batch_stream_replicas))
    if sub is None:
        return
    slots = asyncio.Semaphore(settings.batch_consumer_concurrency)
    tasks: set[asyncio.Task] = set()
    failures = 0

    async def one(msg) -> None:
        try:
            await handle(services, js, msg)
        except Exception as exc:
            log.warning("could not answer the broker for a row (%s); it is redelivered after the ack wait",
                        jetstream.describe(exc))
        finally:
            slots.release()

    while not stop.is_set():
        free = settings.batch_consumer_concurrency - len(tasks)
        if free <= 0:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            continue
        try:
            msgs = await sub.fetch(batch=free, timeout=FETCH_WAIT_SECONDS)
            failures = 0
        except NatsTimeout:
            continue
        except Exception as exc:
            failures += 1
            log.warning("fetching from the broker failed: %s", jetstream.describe(exc))
            await pause(stop, outage_backoff(failures, 0.2, 5.0))
            continue
        for msg in msgs:
            await slots.acquire()
            task = asyncio.create_task(one(msg))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.wait(tasks)


async def complete_loop(services: Services, stop: asyncio.Event) -> None:
    failures = 0
    while not stop.is_set():
        try:
            for batch_id in await read(services.engine, progress.open_batches, 100):
                done = await atomic(services.engine, progress.complete, batch_id)
                if done is not None:
                    log.info("batch %s completed: %s", batch_id, done.counts)
            failures = 0
        except Exception as exc:
            failures += 1
            log.warning("batch completion pass failed: %s", describe(exc))
            await pause(stop, outage_backoff(failures, 0.5))
            continue
        await pause(stop, COMPLETE_EVERY_SECONDS)


async def until_answered(stop: asyncio.Event, what: str, request):
    """`request()`'s answer, asked again until the broker gives one (None if stopped first).

    A cluster electing a leader (at its start, or after a node's death)
    answers "unavailable" or not at all for a few seconds; a consumer that
    asks then must wait and ask again, never exit.
    """
    failures = 0
    while not stop.is_set():
        try:
            return await request()
        except Exception as exc:
            failures += 1
            log.warning("the broker could not %s yet (%s); asking again", what, jetstream.describe(exc))
            await pause(stop, outage_backoff(failures, 0.2, 5.0))
    return None


async def run(settings: Settings, stop: asyncio.Event) -> None:
    async with open_services(settings) as services:
        nc = await jetstream.connect(settings.nats_url, "payments-consume")
        try:
            js = nc.jetstream()
            replicas = settings.batch_stream_replicas
            await until_answered(stop, "set up the batch streams", lambda: jetstream.ensure_streams(js, replicas=replicas))
            if stop.is_set():
                return
            log.info("%s: paying batch rows from %s, publishing the batch outbox", CONSUMER_STARTED, settings.nats_url)
            await asyncio.gather(consume_loop(services, js, stop), publish_loop(services, js, stop),
                                 complete_loop(services, stop))
        finally:
            await nc.close()
        log.info("consumer stopped")


def main(settings: Settings) -> None:
    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await run(settings, stop)

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(go())
