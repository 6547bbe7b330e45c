"""NATS JetStream, as the batch rows use it: two streams, a publish with a message id, a durable pull consumer.

Where it sits: under the batch publisher and consumer (app/workers/batch_publisher.py,
app/workers/batch_consumer.py), as the rails' clients sit under the engine.
What the broker promises, and what it does not (docs/batches.md#what-the-broker-promises-and-what-it-does-not):

* A publish answered with a PubAck is stored (file storage: it survives a
  broker restart). No PubAck (a timeout, a broker restarting) means nothing
  is known: the publisher publishes again, with the same `Nats-Msg-Id`.
* `Nats-Msg-Id` deduplicates publishes within the stream's duplicate window
  only (DUPLICATE_WINDOW_SECONDS): a re-publish later than that is stored
  twice. So the broker's deduplication is a saving, never the guarantee:
  the row's natural key in our key table is.
* Delivery is at least once: a message not acknowledged within the ack wait
  is delivered again, to this consumer or another. An acknowledgement can
  itself be lost, so any message may arrive more than once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

STREAM = "PAYMENT_BATCH_ROWS"
SUBJECT = "payments.batch.rows"
DEAD_STREAM = "PAYMENT_BATCH_DEAD"
DEAD_SUBJECT = "payments.batch.dead"
DURABLE = "payments"
DUPLICATE_WINDOW_SECONDS = 120.0
MSG_ID = "Nats-Msg-Id"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RowMessage:
    """What a message carries: which row to pay (the row itself is read from our database)."""

    batch_id: uuid.UUID
    row_number: int
    key: str  # the row's natural key, also its Nats-Msg-Id

    def encode(self) -> bytes:
        return json.dumps({"batch_id": str(self.batch_id), "row": self.row_number, "key": self.key}).encode()

    @classmethod
    def decode(cls, data: bytes) -> RowMessage:
        value = json.loads(data)
        return cls(uuid.UUID(value["batch_id"]), int(value["row"]), str(value["key"]))


def servers(url: str) -> list[str]:
    """NATS_URL as a list: one server, or every node of a cluster, comma-separated."""
    return [u.strip() for u in url.split(",") if u.strip()]


async def connect(url: str, name: str) -> Client:
    """A connection that keeps reconnecting for ever: a broker restart is a pause, never the end of a process.

    Given every node of a cluster, it moves to another node when the one it
    is on dies, so a consumer follows the cluster rather than waiting for
    that one node to come back.
    """
    return await nats.connect(
        servers=servers(url), name=name, max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=2,
        allow_reconnect=True, error_cb=_report,
    )


async def _report(exc: Exception) -> None:
    """What the connection meets in the background (the server gone, a reconnect refused): one line each.

    nats-py's default logs every such error at ERROR with its traceback: one
    for each attempt to reconnect while a broker restarts, and a screenful
    whenever the server stops before its consumers (Ctrl-C in `make run`
    reaches both at once). A broker gone is a pause `connect` rides out, not
    a fault in this process; what to do about a broker that stays away is
    the operator's, told by the warnings that go on.
    """
    message = str(exc).splitlines()[0][:200] if str(exc) else ""
    log.warning("the broker connection: %s%s", type(exc).__name__, f": {message}" if message else "")


async def ensure_streams(js: JetStreamContext, *, replicas: int = 1) -> None:
    """Both streams, on file storage, on `replicas` nodes; made if missing, given `replicas` if they have another count.

    With three replicas a stored message is on a majority of the nodes before
    its PubAck, so one node's death loses nothing the publisher was told was
    stored; the durable consumer inherits the stream's replicas, so its
    acknowledgements survive that death too.
    """
    for name, subject in ((STREAM, SUBJECT), (DEAD_STREAM, DEAD_SUBJECT)):
        config = StreamConfig(name=name, subjects=[subject], storage=StorageType.FILE,
                              retention=RetentionPolicy.LIMITS, duplicate_window=DUPLICATE_WINDOW_SECONDS,
                              num_replicas=replicas)
        try:
            info = await js.stream_info(name)
        except nats.js.errors.NotFoundError:
            await js.add_stream(config)
            continue
        if (info.config.num_replicas or 1) != replicas:
            await js.update_stream(dataclasses.replace(info.config, num_replicas=replicas))


async def publish(js: JetStreamContext, message: RowMessage, *, timeout: float = 5.0) -> None:
    """Publish one row; returns only once the broker has stored it (its PubAck), raises otherwise."""
    await js.publish(SUBJECT, message.encode(), timeout=timeout, headers={MSG_ID: message.key})


async def dead_letter(js: JetStreamContext, message: RowMessage, reason: str, deliveries: int) -> None:
    """The row, for a person: on the dead-letter stream, with why and after how many deliveries."""
    await js.publish(DEAD_SUBJECT, message.encode(), headers={
        MSG_ID: message.key, "Payments-Reason": reason[:500], "Payments-Deliveries": str(deliveries),
    })


async def subscribe(js: JetStreamContext, *, ack_wait: float, max_ack_pending: int, replicas: int = 1,
                    leader_within: float = 10.0) -> JetStreamContext.PullSubscription:
    """The durable pull consumer every `payments consume` shares: each message goes to one of them at a time.

    No `max_deliver`: how often a row is tried is our decision, made per
    failure (app/payments/batches/consumption.py), so that a database
    outage never dead-letters a row while a poison row is stopped after a few.

    On a cluster (`replicas` above 1) the durable consumer is a group of
    its own that elects a leader once it is made, and a fetch before that
    is answered "unavailable". The first `payments consume` on a new
    cluster makes it, and the one that binds while it is being made gets it
    back leaderless: so this returns once it has a leader, and raises
    NoLeader if it has none within `leader_within` seconds.
    """
    config = ConsumerConfig(durable_name=DURABLE, ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                            ack_wait=ack_wait, max_deliver=-1, max_ack_pending=max_ack_pending)
    sub = await js.pull_subscribe(SUBJECT, durable=DURABLE, stream=STREAM, config=config)
    if replicas > 1:
        try:
            await _until_led(js, leader_within)
        except BaseException:
            # The caller binds again: not a second subscription beside this one.
            with contextlib.suppress(nats.errors.Error):  # a closed connection has none left to drop
                await sub.unsubscribe()
            raise
    return sub


class NoLeader(Exception):
    """The durable consumer has no leader in the cluster yet."""


async def _until_led(js: JetStreamContext, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        info = await js.consumer_info(STREAM, DURABLE)
        if info.cluster is not None and info.cluster.leader:
            return
        if time.monotonic() > deadline:
            raise NoLeader(f"the durable consumer {DURABLE!r} has no leader after {within:g} s")
        # Polled: the broker announces no election to a client, and on a
        # healthy cluster one is over within a few polls.
        await asyncio.sleep(0.05)


def describe(exc: BaseException) -> str:
    """One line for a log about a failed request to the broker, in words a person can act on.

    Not app/db/errors.py::describe, which names the innermost error of the
    chain (the driver's, under SQLAlchemy's): under nats-py's timeout that
    is asyncio's CancelledError, which says nothing. And JetStream's bare
    "unavailable" answer prints as `code=None err_code=None description='None'`.
    """
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return ("ServiceUnavailableError: no leader for the stream or the durable consumer now "
                "(one being elected, or its node gone)")
    message = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
