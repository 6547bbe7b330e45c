"""What the batch tests share: files of rows, the upload, a NATS server and consumers of a test's own, the evidence."""

from __future__ import annotations

import csv
import io
import uuid

import httpx
import nats
import pytest

from app.broker import jetstream
from app.payments.batches.rows import natural_key, payment_reference
from tests.support import IBAN, headers, until

FAST = {"BATCH_ACK_WAIT_SECONDS": "3", "BACKOFF_BASE_SECONDS": "0.1", "BACKOFF_CAP_SECONDS": "0.5"}


def csv_file(rows: int, *, amount: int = 1250, start: int = 1, value_date: str = "2026-12-24") -> bytes:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["reference", "value_date", "amount", "currency", "card_token", "beneficiary_name",
                     "beneficiary_iban"])
    for n in range(start, start + rows):
        writer.writerow([f"emp-{n:05d}", value_date, amount + n, "EUR", "tok_visa", f"Employee {n}", IBAN])
    return out.getvalue().encode()


async def upload(http: httpx.AsyncClient, api: str, client, body: bytes, *, reference: str = "payroll-2026-12",
                 key: str | None = None, media_type: str = "text/csv") -> httpx.Response:
    return await http.post(f"{api}/v1/payment-batches", params={"reference": reference}, content=body,
                           headers=headers(client, key or str(uuid.uuid4())) | {"Content-Type": media_type})


@pytest.fixture
async def broker(processes, tmp_path):
    return processes.system.start_nats(tmp_path / "nats")


def consumer(processes, name: str = "consumer", **env: str):
    return processes.system.start_consumer(name, **(FAST | env))


async def completed(http, api, client, batch_id, timeout: float = 60.0) -> dict:
    seen: dict = {}

    async def done() -> bool:
        r = await http.get(f"{api}/v1/payment-batches/{batch_id}", headers=client.auth)
        seen.update(r.json())
        return seen.get("status") == "completed"

    await until(done, f"batch {batch_id} completed", timeout)
    return seen


async def charges_per_row(db, client_id: int, reference: str, rows: range) -> dict[str, int]:
    """For each row, how many charges the PSP holds for its payment reference, and transfers at the rail."""
    refs = [payment_reference(natural_key(client_id, reference, f"emp-{n:05d}", _date())) for n in rows]
    charges = dict(await db.fetch("SELECT reference, count(*) FROM fake_psp.charge WHERE reference = ANY($1::text[])"
                                  " GROUP BY 1", refs))
    transfers = dict(await db.fetch("SELECT reference, count(*) FROM fake_rail.transfer WHERE reference = ANY($1::text[])"
                                    " GROUP BY 1", refs))
    payments = dict(await db.fetch("SELECT reference, count(*) FROM payment WHERE reference = ANY($1::text[])"
                                   " GROUP BY 1", refs))
    return {r: (charges.get(r, 0), transfers.get(r, 0), payments.get(r, 0)) for r in refs}


def _date():
    from datetime import date

    return date(2026, 12, 24)


def each_once(counts: dict) -> bool:
    return all(v == (1, 1, 1) for v in counts.values())



@pytest.fixture
async def nats_cluster(processes, tmp_path):
    """Three NATS servers of the test's own as one JetStream cluster; its consumers get every node's URL."""
    return processes.system.start_nats_cluster(tmp_path / "nats-cluster", 3)


async def cluster_answer(cluster, ask, what: str, timeout: float = 30.0):
    """`ask(js)`'s answer once the cluster gives one that is not None: a request can time out while it
    elects a leader, or reach it before a stream or consumer it was just told of is in place."""
    nc = await jetstream.connect(cluster.url, "test")
    answer = None
    try:
        js = nc.jetstream()

        async def answered() -> bool:
            nonlocal answer
            try:
                answer = await ask(js)
            except (nats.errors.Error, TimeoutError):
                return False
            return answer is not None

        await until(answered, what, timeout)
        return answer
    finally:
        await nc.close()


async def stream_leader(cluster) -> str:
    """The name of the node that leads the rows' stream (its replicas follow it)."""

    async def leader(js):
        info = await js.stream_info(jetstream.STREAM)
        return info.cluster.leader if info.cluster else None

    return await cluster_answer(cluster, leader, "the rows' stream's leader")
