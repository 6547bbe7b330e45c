"""A three-node JetStream cluster losing a node during a batch: every row paid once, judged on the PSP's and rail's records and the ledger.

Real processes: three `nats-server`s routed to each other (devtools/embedded_nats.py::nats_cluster),
the rows' stream on all three (BATCH_STREAM_REPLICAS=3), two `payments consume`
given every node's URL. The node that leads the stream is SIGKILLed mid-batch
and left dead until the batch has completed: the batch finishes on the other two.
"""

from __future__ import annotations

import asyncio
import uuid

import nats

from app.broker import jetstream
from tests.batches.support import (  # noqa: F401  (nats_cluster: a fixture)
    charges_per_row, cluster_answer, completed, consumer, csv_file, each_once, nats_cluster, stream_leader, upload,
)
from tests.support import unbalanced_payments, until

ROWS = 60


async def test_the_stream_leader_killed_mid_batch_leaves_every_row_paid_once_by_the_other_nodes(
    http, stack, db, acme, nats_cluster, processes
):
    # Would catch: the rows' stream kept on one node (no replicas), or a consumer
    # that cannot leave a dead node; the batch would then wait for that node for ever.
    both = [consumer(processes, name, BATCH_CONSUMER_CONCURRENCY="4", LEASE_SECONDS="3") for name in ("one", "two")]
    batch = (await upload(http, stack.api, acme, csv_file(ROWS))).json()

    async def some_paid() -> bool:
        return await db.fetchval("SELECT count(*) FROM payment_batch_row WHERE batch_id = $1"
                                 " AND payment_id IS NOT NULL", uuid.UUID(batch["id"])) >= 10

    await until(some_paid, "ten rows paid", timeout=60)
    leader = await stream_leader(nats_cluster)
    [dead] = [n for n in nats_cluster.nodes if n.process.argv[n.process.argv.index("--server_name") + 1] == leader]
    dead.process.kill()
    # The precondition: rows were still to be paid when the leader died.
    left = await db.fetchval("SELECT count(*) FROM payment_batch_row WHERE batch_id = $1 AND payment_id IS NULL",
                             uuid.UUID(batch["id"]))
    assert left > 0

    done = await completed(http, stack.api, acme, batch["id"], timeout=150)
    assert not dead.process.running  # finished without the dead node
    assert done["counts"] == {"succeeded": ROWS}, done
    assert each_once(await charges_per_row(db, acme.id, "payroll-2026-12", range(1, ROWS + 1)))
    assert await unbalanced_payments(db) == []
    assert await db.fetchval("SELECT count(*) FROM event WHERE type = 'batch.completed'") == 1
    assert all(c.running for c in both), [c.tail() for c in both]
    # A new leader was elected among the two left, and the stream is still kept on three nodes.
    assert await stream_leader(nats_cluster) != leader


async def test_the_streams_are_replicated_on_every_node_of_the_cluster(http, stack, db, acme, nats_cluster, processes):
    # Would catch: BATCH_STREAM_REPLICAS not reaching the consumer, or ensure_streams ignoring it
    # (a stream on one node of three: its node's death is the stream's).
    consumer(processes)
    for name in (jetstream.STREAM, jetstream.DEAD_STREAM):
        info = await cluster_answer(nats_cluster, lambda js, n=name: js.stream_info(n), f"stream {name}")
        assert info.config.num_replicas == 3, info

        async def peers(js, n=name):
            info = await js.stream_info(n)
            return info.cluster.replicas if info.cluster and info.cluster.replicas else None

        assert len(await cluster_answer(nats_cluster, peers, f"{name}'s replicas")) == 2

    # The durable consumer (its acknowledgements) inherits the stream's three replicas.
    async def durable_peers(js):
        info = await js.consumer_info(jetstream.STREAM, jetstream.DURABLE)
        return info.cluster.replicas if info.cluster and info.cluster.replicas else None

    # (While it is being placed the leader may list itself among them too: at least the two others.)
    assert len(await cluster_answer(nats_cluster, durable_peers, "the durable consumer's replicas")) >= 2


async def test_two_consumers_binding_on_a_new_cluster_are_each_bound_to_a_consumer_with_a_leader(nats_cluster):
    # Would catch: subscribe() returning before the durable consumer has a leader. Two consumers
    # start on a new cluster at once, as `make cluster`'s do: each connects, makes the streams and
    # binds, asking again while the new cluster answers "not yet" (as until_answered does in
    # app/workers/batch_consumer.py). The one that binds while the other is making the durable
    # consumer got it back leaderless, and its first fetches were answered "unavailable": a
    # warning line on the first `make cluster` of a new store.
    clients = []

    async def answer(request, what: str):
        answered = None

        async def asked() -> bool:
            nonlocal answered
            try:
                answered = await request()
            except (nats.errors.Error, TimeoutError, jetstream.NoLeader):
                return False
            return True

        await until(asked, what)
        return answered

    async def bind(name):
        nc = await jetstream.connect(nats_cluster.url, name)
        clients.append(nc)
        js = nc.jetstream()
        await answer(lambda: jetstream.ensure_streams(js, replicas=3), "the batch streams")
        await answer(lambda: jetstream.subscribe(js, ack_wait=30, max_ack_pending=100, replicas=3), "a binding")
        # Asked at once (again only if the cluster does not answer): a leader elected later would not do.
        info = await answer(lambda: js.consumer_info(jetstream.STREAM, jetstream.DURABLE), "the consumer's info")
        assert info.cluster is not None and info.cluster.leader, f"{name} bound to a leaderless consumer: {info}"

    try:
        await asyncio.gather(bind("test-1"), bind("test-2"))
    finally:
        for nc in clients:
            await nc.close()
