"""Development tooling, not the payment path: `make soak`, a seeded chaos run audited three ways.

    python -m devtools.soak --seed 1 --payments 300 --seconds 60

It starts the system the one way (devtools/system.py): a PostgreSQL of its
own for our data (the embedded one on a private data directory and port, so
it can be restarted without disturbing anyone; or DATABASE_URL's server,
which it cannot restart), a second one for the fake PSP's and rail's records
(other people's systems do not go down with our database), N API replicas
and two workers behind nginx (devtools/nginx.py), with a short lease
(LEASE_SECONDS=3) so that a frozen replica loses its payments within the
run. Then, in one command:

1. a calm run: N payments offered over T seconds through nginx, no chaos;
2. a chaos run: N more payments over T seconds while a seeded loop kills
   replicas and workers, freezes a replica past its lease, restarts our
   PostgreSQL once, and sets random fault plans on the PSP and the rail;
3. a calm phase: faults cleared, every process up, the workers drain, the
   rail's days closed, reconciliation run, the workers drain again, the
   clients collect their final answers;
4. the audit (devtools/audit.py) of every payment both runs started, the
   throughput of the chaos run against the calm one, the time from a
   replica's death to its stranded payments finishing, the chaos actions
   taken. Printed, and written as JSON to the results directory; the exit
   status is 1 on any violation.

The clients behave like payments_client (docs/reference/client.md): a key
per payment, written to a journal (fsynced) before the first attempt, the
same key on every retry until a final answer, Retry-After honoured, 409,
429, 502, 503, 504 and connection errors retried, anything else a refusal.
They are written on aiohttp's asyncio client rather than by using
payments_client itself: thousands of payments at once from one process on
two cores need an event loop, not a thread and a JSON store per payment.

A share of the payments are declines (tok_decline), rejected payouts (the
rail's reject fault, by reference) and payouts to a legacy account
(GB82WEST12345698765432, in RAIL_LEGACY_ACCOUNTS and the rail's
--legacy-accounts), so every path of a payment meets the chaos.

Payment batches (--batch-rows, on by default): the system also runs a
three-node NATS JetStream cluster and two `payments consume`; each run
uploads --batch-files CSV files through nginx (rows with the same mix), the
chaos run the calm run's first file again under a new key, and the chaos
adds kill_broker and kill_consumer, each struck while rows are being paid.
The drain waits for the rows too, and the audit judges each row as a
payment and each batch as a batch (docs/batches.md#the-soak-batches-beside-the-payments-a-broker-node-killed).
A soak that starts no broker (soak_ha's) uploads no batches and takes
neither action.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from rich.console import Console

from devtools import audit, embedded_db, nginx
from devtools.bodies import IBAN, payment_body
from devtools.processes import BIN, Process, child_env, free_port
from devtools.system import System

LEGACY_IBAN = "GB82WEST12345698765432"
LEASE_SECONDS = 3
BOOKING_DAYS = 3
# The service's settings for the soak. A short lease, so a replica frozen for
# LEASE_SECONDS + 2 loses its payments within the run; short timeouts and
# backoffs, so faults resolve in seconds; the worker sweeping often and
# re-probing parked payments every 2 s, so the drain is quick.
SETTINGS = {
    "LEASE_SECONDS": str(LEASE_SECONDS),
    "PSP_TIMEOUT_SECONDS": "2",
    "RAIL_TIMEOUT_SECONDS": "2",
    "RAIL_LEGACY_ACCOUNTS": LEGACY_IBAN,
    "RECONCILE_BOOKING_DAYS": str(BOOKING_DAYS),
    "WORKER_POLL_SECONDS": "0.2",
    "WORKER_MIN_AGE_SECONDS": "1",
    "BACKOFF_BASE_SECONDS": "0.2",
    "BACKOFF_CAP_SECONDS": "2",
    "PARKED_RECHECK_SECONDS": "2",
    "SHUTDOWN_GRACE_SECONDS": "2",
    # The soak runs reconciliation itself once the days are closed.
    "RECONCILE_EVERY_SECONDS": "3600",
}
# The mix of payments: the rest are ordinary ones that pay out.
SHARES = {"decline": 0.10, "reject": 0.10, "legacy": 0.10}
RETRY_STATUSES = {409, 429, 500, 502, 503, 504}
FINAL = {"succeeded", "declined", "failed"}


# -- the clients ---------------------------------------------------------------


@dataclass
class Payment:
    """One payment a client makes, and what happened to it, as the client saw it."""

    reference: str
    kind: str  # normal | decline | reject | legacy
    key: str
    body: dict[str, Any]
    run: str  # calm | chaos
    offered_at: float = 0.0  # wall clock: when the client started it
    answered_at: float | None = None  # the first answer that is not "try again" (final, or indeterminate)
    final_at: float | None = None
    payment_id: str | None = None
    first_status: str | None = None
    final_status: str | None = None
    refused: dict[str, Any] | None = None
    gave_up: bool = False
    response: tuple[int, str] | None = None  # the final answer's status and body, as received
    attempts: int = 0
    statuses: Counter = field(default_factory=Counter)


class Journal:
    """The clients' durable memory: one JSON line per key, fsynced before the payment's first attempt."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = path.open("a")

    def append(self, *records: dict[str, Any]) -> None:
        self.file.write("".join(json.dumps(record) + "\n" for record in records))
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class Clients:
    """The soak's clients, sharing one HTTP session to nginx; each payment is a task."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str, journal: Journal,
                 lock: asyncio.Lock) -> None:
        self.session, self.base_url, self.journal, self.lock = session, base_url, journal, lock
        self.headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}
        self.stop_polling = asyncio.Event()

    async def answer(self, p: Payment, deadline: float) -> None:
        """POST with the payment's key until an answer that is not "try again" (or the deadline)."""
        async with self.lock:  # one writer at a time; the fsync runs off the loop
            await asyncio.to_thread(self.journal.append, {"reference": p.reference, "key": p.key, "body": p.body})
        p.offered_at = time.time()
        body = json.dumps(p.body)
        attempt = 0
        while time.monotonic() < deadline:
            attempt += 1
            p.attempts += 1
            wait = min(2.0, 0.1 * 2 ** min(attempt, 5)) * random.uniform(0.5, 1.0)
            try:
                async with self.session.post(f"{self.base_url}/v1/payments", data=body,
                                             headers=self.headers | {"Idempotency-Key": p.key}) as r:
                    status, text, after = r.status, await r.text(), r.headers.get("Retry-After")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                p.statuses[type(exc).__name__] += 1
                await asyncio.sleep(wait)
                continue
            p.statuses[str(status)] += 1
            if status in (200, 201, 202):
                payment = json.loads(text)
                p.payment_id = payment["id"]
                if payment["status"] in FINAL or payment["status"] == "indeterminate":
                    p.answered_at = time.time()
                    p.first_status = payment["status"]
                    if payment["status"] in FINAL:
                        p.final_status, p.final_at = payment["status"], p.answered_at
                        p.response = (status, text)
                    return
                # processing: the outcome is not known yet; the same key again drives it on.
            elif status not in RETRY_STATUSES or (status == 409 and "request-in-progress" not in text):
                p.refused = {"status": status, "body": text[:500]}
                return
            if after is not None:
                try:
                    wait = max(wait, float(after))
                except ValueError:
                    pass
            await asyncio.sleep(wait)
        p.gave_up = True

    async def ask_again(self, p: Payment) -> tuple[int, str] | None:
        """The same key and body once more, after everything: the stored answer, which must be the one the
        client was given (None if the answer was not final, or the request failed)."""
        if p.response is None:
            return None
        try:
            async with self.session.post(f"{self.base_url}/v1/payments", data=json.dumps(p.body),
                                         headers=self.headers | {"Idempotency-Key": p.key}) as r:
                return r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return 0, type(exc).__name__

    async def settle(self, p: Payment, deadline: float) -> None:
        """An indeterminate answer is not final: look again (GET) until reconciliation has settled it."""
        if p.payment_id is None or p.final_status is not None:
            return
        while time.monotonic() < deadline:
            try:
                async with self.session.get(f"{self.base_url}/v1/payments/{p.payment_id}",
                                            headers=self.headers) as r:
                    if r.status == 200:
                        status = (await r.json())["status"]
                        if status in FINAL:
                            p.final_status, p.final_at = status, time.time()
                            return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(2.0)

    def done(self, payments: list[Payment]) -> None:
        """Mark the operations done, with their answers (one write: the soak is over)."""
        self.journal.append(*({"reference": p.reference, "key": p.key, "done": p.final_status or p.first_status}
                              for p in payments))


def plan_payments(rng: random.Random, run: str, seed: int, n: int) -> list[Payment]:
    payments = []
    for i in range(n):
        roll = rng.random()
        kind = "normal"
        edge = 0.0
        for name, share in SHARES.items():
            edge += share
            if roll < edge:
                kind = name
                break
        reference = f"soak-{seed}-{run}-{i}"
        overrides: dict[str, Any] = {"amount": rng.randint(500, 500_000)}
        if kind == "decline":
            overrides["card_token"] = "tok_decline"
        if kind == "legacy":
            overrides["beneficiary"] = {"name": "Charles Babbage", "iban": LEGACY_IBAN}
        key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        payments.append(Payment(reference, kind, key, payment_body(reference, **overrides), run))
    return payments


async def offer(clients: Clients, payments: list[Payment], seconds: float, concurrency: int,
                deadline: float) -> tuple[float, float]:
    """Offer the payments evenly over `seconds`, at most `concurrency` unanswered at a time;
    (start, end) of the run, end being when the last one was answered."""
    gate = asyncio.Semaphore(concurrency)
    start = time.monotonic()
    wall = time.time()
    interval = seconds / max(1, len(payments))

    async def one(i: int, p: Payment) -> None:
        await asyncio.sleep(max(0.0, start + i * interval - time.monotonic()))
        async with gate:
            await clients.answer(p, deadline)

    await asyncio.gather(*(one(i, p) for i, p in enumerate(payments)))
    answered = [p.answered_at for p in payments if p.answered_at is not None]
    return wall, max(answered, default=time.time())


# -- the batches (--batch-rows) -------------------------------------------------


@dataclass
class Batch:
    """One payroll file a client uploads (CSV), and what it was told about it."""

    name: str  # calm-1, chaos-2, calm-1-again
    reference: str  # the batch's reference (a payroll run); a resubmission keeps the file's
    body: bytes
    rows: list[dict[str, Any]]  # each row's reference, kind, and its payment's reference (from its natural key)
    key: str  # the upload's Idempotency-Key, the same on every retry of this upload
    run: str  # calm | chaos
    resubmission_of: str | None = None  # the name of the batch whose file this is, sent again under a new key
    batch_id: str | None = None
    refused: dict[str, Any] | None = None
    report: dict[str, Any] | None = None  # GET /v1/payment-batches/{id} at the end


def plan_batches(rng: random.Random, run: str, seed: int, files: int, rows: int, client_id: int) -> list[Batch]:
    """`files` files of `rows` rows, with the payments' mix of declines, rejected and legacy payouts."""
    from app.payments.batches.rows import natural_key, payment_reference

    value_date = datetime.now(UTC).date()
    batches = []
    for f in range(1, files + 1):
        reference = f"soak-{seed}-{run}-batch-{f}"
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["reference", "value_date", "amount", "currency", "card_token", "beneficiary_name",
                         "beneficiary_iban"])
        planned = []
        for n in range(1, rows + 1):
            roll, kind, edge = rng.random(), "normal", 0.0
            for name, share in SHARES.items():
                edge += share
                if roll < edge:
                    kind = name
                    break
            row_reference = f"row-{n:05d}"
            card = "tok_decline" if kind == "decline" else "tok_visa"
            name_, iban = ("Charles Babbage", LEGACY_IBAN) if kind == "legacy" else ("Ada Lovelace", IBAN)
            writer.writerow([row_reference, value_date.isoformat(), rng.randint(500, 500_000), "EUR", card, name_, iban])
            key = natural_key(client_id, reference, row_reference, value_date)
            planned.append({"row": n, "reference": row_reference, "kind": kind, "payment_reference": payment_reference(key)})
        key = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        batches.append(Batch(f"{run}-{f}", reference, out.getvalue().encode(), planned, key, run))
    return batches


def sent_again(batch: Batch, rng: random.Random, run: str) -> Batch:
    """The same file uploaded again under a new key (a client that lost track of its first upload)."""
    return Batch(f"{batch.name}-again", batch.reference, batch.body, batch.rows,
                 str(uuid.UUID(int=rng.getrandbits(128), version=4)), run, resubmission_of=batch.name)


async def upload(session: aiohttp.ClientSession, base_url: str, api_key: str, batch: Batch, deadline: float) -> None:
    """POST the file under its key until a 202 (the first, or its replay) or a refusal, as a client would."""
    headers = {"Authorization": f"Bearer {api_key}", "Content-Type": "text/csv", "Idempotency-Key": batch.key}
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        try:
            async with session.post(f"{base_url}/v1/payment-batches", params={"reference": batch.reference},
                                    data=batch.body, headers=headers) as r:
                status, text = r.status, await r.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            status, text = 0, ""
        if status == 202:
            batch.batch_id = json.loads(text)["id"]
            return
        if status and status not in RETRY_STATUSES:
            batch.refused = {"status": status, "body": text[:500]}
            return
        await asyncio.sleep(min(2.0, 0.1 * 2 ** min(attempt, 5)) * random.uniform(0.5, 1.0))
    batch.refused = {"status": None, "body": "no answer before the deadline"}


# Rows still to be paid: no key row for their natural key yet (on the broker), or one an attempt holds.
# A row of a file sent again counts by its key row too: its own message may have been dropped as a duplicate.
UNPAID_ROWS = """
    SELECT count(*) FROM payment_batch_row r
      LEFT JOIN idempotency_key k ON k.client_id = r.client_id AND k.key = CAST(r.row_key AS text)
     WHERE r.dead_lettered_at IS NULL AND (k.key IS NULL OR (k.state = 'started' AND k.parked_at IS NULL))
"""


async def upload_over(session: aiohttp.ClientSession, base_url: str, api_key: str, pending: list[Batch],
                      seconds: float, deadline: float) -> None:
    """Upload the files of `pending` spread over the run, taking each off the list (the chaos may take one
    sooner: rows_in_flight)."""
    start, files = time.monotonic(), len(pending)
    for i in range(files):
        await asyncio.sleep(max(0.0, start + i * seconds / max(1, files) - time.monotonic()))
        if not pending:
            return
        await upload(session, base_url, api_key, pending.pop(0), deadline)


async def unpaid_rows(database_url: str) -> int | None:
    """Batch rows still to be paid (None: the database did not answer, as while it restarts)."""
    try:
        db = await asyncpg.connect(database_url, timeout=2)
        try:
            return await db.fetchval(UNPAID_ROWS, timeout=2)
        finally:
            await db.close()
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
        return None


async def rows_in_flight(session: aiohttp.ClientSession, base_url: str, api_key: str, database_url: str,
                         pending: list[Batch], deadline: float, timeout: float = 5.0) -> None:
    """Before the chaos kills a broker node or a consumer: rows being paid, so the kill meets a batch in flight.

    If none is, the next new file of the run is uploaded now; then wait
    (bounded) until its first rows are paid and others are still to be.
    """
    first = await unpaid_rows(database_url)
    if not first:
        fresh = next((b for b in pending if b.resubmission_of is None), None)
        if fresh is None:
            return
        pending.remove(fresh)
        await upload(session, base_url, api_key, fresh, deadline)
        first = len(fresh.rows)  # all of them unpaid at its 202: the consumers may be quick to start
    until = time.monotonic() + timeout
    while first and time.monotonic() < until:
        now = await unpaid_rows(database_url)
        if now is not None and 0 < now < first:
            return
        await asyncio.sleep(0.1)


async def rows_settled(database_url: str, batch_ids: list[str], timeout: float, *, completed: bool) -> float:
    """Wait until no row of these batches is still to be paid (`completed`: until every batch completed);
    how long it took (the timeout if never)."""
    start = time.monotonic()
    ids = [uuid.UUID(b) for b in batch_ids]
    query = ("SELECT count(*) FROM payment_batch WHERE id = ANY($1::uuid[]) AND completed_at IS NULL" if completed
             else UNPAID_ROWS + " AND r.batch_id = ANY($1::uuid[])")
    db = await asyncpg.connect(database_url)
    try:
        while time.monotonic() - start < timeout:
            if await db.fetchval(query, ids) == 0:
                return time.monotonic() - start
            await asyncio.sleep(0.5)
    finally:
        await db.close()
    return timeout


async def batch_reports(session: aiohttp.ClientSession, base_url: str, api_key: str, batches: list[Batch]) -> None:
    """What each client is finally told about its batch: GET /v1/payment-batches/{id}."""
    for batch in batches:
        if batch.batch_id is None:
            continue
        async with session.get(f"{base_url}/v1/payment-batches/{batch.batch_id}",
                               headers={"Authorization": f"Bearer {api_key}"}) as r:
            batch.report = await r.json() if r.status == 200 else {"status_code": r.status}


def row_answers(batches: list[Batch]) -> dict[str, dict[str, Any]]:
    """Each row's answer as its client reads it in its batch's report, by the row's payment reference.

    A failed row is listed with its state; a row not listed in a completed
    batch succeeded; in a batch not completed its state is not told row by
    row (`indeterminate`: not known to the client). A resubmitted file's rows
    are the first upload's payments: answered once, under the first.
    """
    answers: dict[str, dict[str, Any]] = {}
    for batch in (b for b in batches if b.resubmission_of is None):
        report = batch.report or {}
        failed = {f["row"]: f["state"] for f in report.get("failed_rows", [])}
        done = report.get("status") == "completed"
        for row in batch.rows:
            state = failed.get(row["row"], "succeeded" if done else None)
            answers[row["payment_reference"]] = {
                "final_status": state, "first_status": state or "indeterminate",
                "refused": batch.refused, "gave_up": False, "kind": f"batch-{row['kind']}", "statuses": {},
            }
    return answers


async def batch_evidence(database_url: str, batches: list[Batch]) -> list[dict[str, Any]]:
    """Each batch's rows as our database holds them (the row's payment, from its link or its key row), its
    completion and its batch.completed events; with the resubmissions named."""
    db = await asyncpg.connect(database_url)
    try:
        out = []
        for batch in batches:
            if batch.batch_id is None:
                out.append({"name": batch.name, "batch_id": None, "refused": batch.refused})
                continue
            bid = uuid.UUID(batch.batch_id)
            completed_at = await db.fetchval("SELECT completed_at FROM payment_batch WHERE id = $1", bid)
            events = await db.fetchval("SELECT count(*) FROM event WHERE type = 'batch.completed'"
                                       " AND data::jsonb ->> 'id' = $1", batch.batch_id)
            rows = [dict(r) for r in await db.fetch(
                "SELECT r.row_number, CAST(r.row_key AS text) AS row_key, coalesce(r.payment_id, k.payment_id) AS payment_id,"
                " r.dead_lettered_at IS NOT NULL AS dead, p.reference AS payment_reference, p.status"
                "  FROM payment_batch_row r"
                "  LEFT JOIN idempotency_key k ON k.client_id = r.client_id AND k.key = CAST(r.row_key AS text)"
                "  LEFT JOIN payment p ON p.id = coalesce(r.payment_id, k.payment_id)"
                " WHERE r.batch_id = $1 ORDER BY r.row_number", bid)]
            planned = {row["row"]: row["payment_reference"] for row in batch.rows}
            for row in rows:
                row["planned_reference"] = planned.get(row["row_number"])
                row["payment_id"] = str(row["payment_id"]) if row["payment_id"] else None
            out.append({"name": batch.name, "batch_id": batch.batch_id, "resubmission_of": batch.resubmission_of,
                        "refused": batch.refused, "completed": completed_at is not None, "events": events,
                        "rows": rows, "planned_rows": len(batch.rows)})
        return out
    finally:
        await db.close()


# -- the chaos -----------------------------------------------------------------


@dataclass
class Cluster:
    system: System
    apis: list[Process]
    workers: list[Process]
    balancer: Process
    server: embedded_db.EmbeddedServer | None  # ours, restartable; None on DATABASE_URL's server
    database_url: str
    rails_url: str
    api_key: str
    frozen: set[int] = field(default_factory=set)
    # Payment batches (--batch-rows): the NATS cluster's nodes, the consumers, the client's id (for the
    # rows' natural keys). Empty for a soak that starts no broker (soak_ha's).
    brokers: list[Process] = field(default_factory=list)
    consumers: list[Process] = field(default_factory=list)
    client_id: int | None = None


class Chaos:
    """The seeded chaos loop; every action it takes is recorded in `events`."""

    def __init__(self, cluster: Cluster, rng: random.Random, reject_refs: list[str], console: Console) -> None:
        self.c, self.rng, self.console = cluster, rng, console
        self.reject_refs = reject_refs
        self.events: list[dict[str, Any]] = []
        self.http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self.restarted_postgres = False
        self.skipped: list[str] = []
        self.before_batch_kill: Any = None  # a coroutine function, set by the soak when it uploads batches

    def record(self, action: str, **details: Any) -> dict[str, Any]:
        event = {"action": action, "at": time.time(), **details}
        self.events.append(event)
        self.console.print(f"  chaos: {action} " + " ".join(f"{k}={v}" for k, v in details.items()), highlight=False)
        return event

    async def kill_api(self) -> None:
        api = self.rng.choice(self.c.apis)
        await asyncio.to_thread(api.kill)
        self.record("kill_api", target=api.name, addr=f"127.0.0.1:{api.port}")
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(api.start)

    async def kill_worker(self) -> None:
        worker = self.rng.choice(self.c.workers)
        await asyncio.to_thread(worker.kill)
        self.record("kill_worker", target=worker.name)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(worker.start)

    async def freeze_api(self) -> None:
        """SIGSTOP past the lease, then SIGCONT: a GC pause or a frozen VM."""
        api = self.rng.choice(self.c.apis)
        if not api.running:
            return
        os.kill(api.pid, signal.SIGSTOP)
        self.c.frozen.add(api.pid)
        seconds = LEASE_SECONDS + self.rng.uniform(1.0, 3.0)
        self.record("freeze_api", target=api.name, addr=f"127.0.0.1:{api.port}", seconds=round(seconds, 1))
        await asyncio.sleep(seconds)
        os.kill(api.pid, signal.SIGCONT)
        self.c.frozen.discard(api.pid)

    async def restart_postgres(self) -> None:
        self.restarted_postgres = True
        if self.c.server is None:
            reason = "DATABASE_URL names a server this soak did not start, so it cannot restart it"
            self.skipped.append(f"restart_postgres: {reason}")
            self.console.print(f"  chaos: restart_postgres skipped: {reason}")
            return
        self.record("restart_postgres")
        await asyncio.to_thread(embedded_db.stop, self.c.server)
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(embedded_db.start, self.c.server)

    async def kill_broker(self) -> None:
        """SIGKILL one node of the NATS cluster; start it again on its store 0.5-2 s later.

        The rows' stream is on all three nodes: the two left elect a leader (if
        the dead one led) and carry on; publishes and acks in flight to the dead
        node are lost, so rows are published again (same message id) or
        delivered again (answered from their key rows).
        """
        node = self.rng.choice(self.c.brokers)
        await self.batch_in_flight()
        await asyncio.to_thread(node.kill)
        self.record("kill_broker", target=node.name, rows_unpaid=await unpaid_rows(self.c.database_url))
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(node.start)

    async def kill_consumer(self) -> None:
        """SIGKILL one `payments consume`; restart it. Its unacknowledged rows are delivered again after the ack wait."""
        consumer = self.rng.choice(self.c.consumers)
        await self.batch_in_flight()
        await asyncio.to_thread(consumer.kill)
        self.record("kill_consumer", target=consumer.name, rows_unpaid=await unpaid_rows(self.c.database_url))
        await asyncio.sleep(self.rng.uniform(0.5, 2.0))
        await asyncio.to_thread(consumer.start)

    async def batch_in_flight(self) -> None:
        """What the soak set to run before a broker or consumer kill (soak: rows_in_flight); nothing by default."""
        if self.before_batch_kill is not None:
            await self.before_batch_kill()

    def _faults(self, operations: list[str | None], extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
        faults = []
        for _ in range(self.rng.randint(1, 3)):
            action = self.rng.choice(("error_before", "error_after", "hang_after", "delay", "rate_limit", *extra))
            fault: dict[str, Any] = {"action": action, "operation": self.rng.choice(operations),
                                     "times": self.rng.randint(1, 10)}
            if action == "hang_after":
                fault["seconds"] = round(self.rng.uniform(3.0, 6.0), 1)
            if action == "delay":
                fault["seconds"] = round(self.rng.uniform(0.2, 3.0), 1)
            faults.append(fault)
        return faults

    async def psp_faults(self) -> None:
        faults = self._faults(["charge", "refund", None])
        await self.put_faults(self.c.system.psp, faults)
        self.record("psp_faults", faults=[f["action"] for f in faults])

    async def rail_faults(self) -> None:
        faults = self._faults(["transfer"], ("reject",))
        await self.put_faults(self.c.system.rail, self.rejections() + faults)
        self.record("rail_faults", faults=[f["action"] for f in faults])

    def rejections(self) -> list[dict[str, Any]]:
        """The payouts planned to be rejected: first in every rail plan, so a random fault never shadows them."""
        return [{"action": "reject", "reference": ref, "times": None} for ref in self.reject_refs]

    async def put_faults(self, service: Process, faults: list[dict[str, Any]]) -> None:
        async with self.http.put(service.url + "/_admin/faults", json={"faults": faults}) as r:
            r.raise_for_status()

    async def clear_faults(self) -> None:
        async with self.http.delete(self.c.system.psp.url + "/_admin/faults") as r:
            r.raise_for_status()
        await self.put_faults(self.c.system.rail, self.rejections())

    def first_actions(self) -> list[Any]:
        """One of each kind, taken first."""
        return [self.kill_api, self.kill_worker, self.freeze_api, self.restart_postgres, self.psp_faults,
                self.rail_faults] + self.batch_actions()

    def weighted_actions(self) -> list[Any]:
        """What is chosen from at random after the first ones (a kind twice as often is there twice)."""
        return [self.kill_api] * 3 + [self.kill_worker] * 2 + [self.freeze_api] * 2 + \
               [self.psp_faults] * 3 + [self.rail_faults] * 3 + self.batch_actions() * 2

    def batch_actions(self) -> list[Any]:
        """The broker's and the consumers' deaths, when the soak runs them (--batch-rows)."""
        return [self.kill_broker, self.kill_consumer] if self.c.brokers else []

    async def run(self, until: asyncio.Event) -> None:
        """One action at a time: first one of each kind (in a seeded order), then a weighted random choice."""
        first = self.first_actions()
        self.rng.shuffle(first)
        weighted = self.weighted_actions()
        # One of each is taken even if the load ends first, so a short run meets every kind.
        while first or not until.is_set():
            action = first.pop(0) if first else self.rng.choice(weighted)
            try:
                await action()
            except Exception as exc:  # a chaos action that failed is a finding to show, not a reason to stop
                self.record("action_failed", failed=action.__name__, error=repr(exc)[:300])
            pause = self.rng.uniform(1.0, 3.0)
            if first:
                await asyncio.sleep(pause)
                continue
            try:
                await asyncio.wait_for(until.wait(), pause)
            except TimeoutError:
                pass

    def counts(self) -> dict[str, int]:
        return dict(Counter(e["action"] for e in self.events))


# -- the calm phase ------------------------------------------------------------


async def everything_up(cluster: Cluster) -> None:
    for pid in list(cluster.frozen):
        os.kill(pid, signal.SIGCONT)
    cluster.frozen.clear()
    if cluster.server is not None and not embedded_db.is_accepting(cluster.server.port):
        await asyncio.to_thread(embedded_db.start, cluster.server)
    for process in [*cluster.apis, *cluster.workers, *cluster.brokers, *cluster.consumers]:
        if not process.running:
            await asyncio.to_thread(process.start)


async def unfinished(db: asyncpg.Connection) -> int:
    return await db.fetchval("SELECT count(*) FROM idempotency_key WHERE state = 'started' AND parked_at IS NULL")


async def drain(database_url: str, timeout: float) -> float:
    """Wait until every key is finished or parked; how long it took (the timeout if it never was)."""
    start = time.monotonic()
    # A connection of its own, opened now: one held through the chaos would
    # have been cut by the database's restart.
    db = await asyncpg.connect(database_url)
    try:
        while time.monotonic() - start < timeout:
            if await unfinished(db) == 0:
                return time.monotonic() - start
            await asyncio.sleep(0.5)
    finally:
        await db.close()
    return timeout


async def close_days_and_reconcile(cluster: Cluster, first_day: date, console: Console) -> list[str]:
    """Close today and the booking horizon on the rail (statements final), then reconcile each day."""
    today = datetime.now(UTC).date()
    async with aiohttp.ClientSession() as http:
        horizon = (today + timedelta(days=BOOKING_DAYS)).isoformat()
        async with http.post(cluster.system.rail.url + "/_admin/close-day", json={"date": horizon}) as r:
            r.raise_for_status()
    outputs = []
    day = first_day
    while day <= today:
        result = await asyncio.to_thread(
            subprocess.run, [str(BIN / "payments"), "reconcile", "--date", day.isoformat()],
            env=cluster.system.service_env(), capture_output=True, text=True, timeout=300)
        line = (result.stdout.strip().splitlines() or [f"exit {result.returncode}"])[-1]
        console.print(f"  payments reconcile --date {day}: {line}", highlight=False)
        outputs.append(line)
        day += timedelta(days=1)
    return outputs


# -- the evidence and the figures ----------------------------------------------


async def collect(cluster: Cluster, payments: list[Payment], first_day: date) -> audit.Evidence:
    db = await asyncpg.connect(cluster.database_url)
    rails = await asyncpg.connect(cluster.rails_url)
    try:
        rows = [dict(r) for r in await db.fetch("SELECT * FROM payment")]
        keys = {str(r["payment_id"]): dict(r) for r in await db.fetch(
            "SELECT key, state, parked_at, finished_at, payment_id, attempts FROM idempotency_key")}
        ledger: dict[str, list] = {}
        for r in await db.fetch("SELECT payment_id, posting, account, debit_minor, credit_minor FROM ledger_entry"):
            ledger.setdefault(str(r["payment_id"]), []).append(dict(r))
        charges = await rails.fetch("SELECT id, reference, status, amount FROM fake_psp.charge")
        refunds = await rails.fetch("SELECT id, reference, amount, charge_id FROM fake_psp.refund")
        transfers = await rails.fetch(
            "SELECT id, reference, status, amount, end_to_end_reference, legacy FROM fake_rail.transfer")
    finally:
        await db.close()
        await rails.close()
    statements = {}
    async with aiohttp.ClientSession() as http:
        day, last = first_day, datetime.now(UTC).date() + timedelta(days=BOOKING_DAYS + 1)
        while day <= last:
            async with http.get(f"{cluster.system.rail.url}/v1/statements/{day.isoformat()}") as r:
                statements[day.isoformat()] = await r.json()
            day += timedelta(days=1)

    def by_reference(records: list) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for r in records:
            out.setdefault(r["reference"], []).append(dict(r))
        return out

    answers = {p.reference: {"final_status": p.final_status, "first_status": p.first_status,
                             "refused": p.refused, "gave_up": p.gave_up, "kind": p.kind,
                             "statuses": dict(p.statuses)} for p in payments}
    return audit.Evidence(answers, by_reference(rows), keys, ledger, by_reference(charges),
                          by_reference(refunds), by_reference(transfers), statements, BOOKING_DAYS)


LOG_LINE = re.compile(r'^(\S+) (\S+) (\S+) "([^"]*)" "([^"]*)" (\S+) "([^"]*)"$')


def key_hash(key: str) -> str:
    """An Idempotency-Key as nginx's access log records it (compose/idempotency_key_hash.js): its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()


def stranded(access_log: Path, events: list[dict[str, Any]], finished: dict[str, float],
             parked: set[str]) -> dict[str, Any]:
    """For each replica killed (or frozen): the payments it was serving then, from nginx's log, and the
    seconds from that moment to their key's finish (our database's finished_at).

    The log holds each key's hash, never the key: `finished` and `parked` (by
    key) are looked up by hash."""
    finished = {key_hash(key): at for key, at in finished.items()}
    parked = {key_hash(key) for key in parked}
    requests = []
    for line in access_log.read_text(errors="replace").splitlines():
        m = LOG_LINE.match(line)
        if not m or m.group(6) != "POST" or m.group(7) in ("", "-"):
            continue
        end, took = float(m.group(1)), float(m.group(2))
        requests.append((end - took, end, m.group(4), m.group(7)))
    figures: dict[str, Any] = {}
    for action in ("kill_api", "freeze_api"):
        recoveries, left = [], 0
        for event in (e for e in events if e["action"] == action):
            t, addr = event["at"], event["addr"]
            keys = {key for start, end, upstreams, key in requests
                    if start <= t <= end and addr in upstreams.split(", ")[0:1]}
            for key in keys:
                if key in parked:
                    left += 1
                elif key in finished:
                    recoveries.append(max(0.0, finished[key] - t))
            event["stranded"] = len(keys)
        figures[action] = {
            "stranded_payments": len(recoveries) + left,
            "parked_then_settled": left,
            "median_seconds": round(statistics.median(recoveries), 2) if recoveries else None,
            "max_seconds": round(max(recoveries), 2) if recoveries else None,
        }
    return figures


# -- the soak ------------------------------------------------------------------


class Hooks:
    """What a variant of the soak adds (devtools/soak_ha.py); these defaults are `make soak`'s."""

    ask_again = False  # after everything, ask every final answer again: it must be the same, byte for byte

    def chaos(self, cluster: Cluster, rng: random.Random, reject_refs: list[str], console: Console) -> Chaos:
        return Chaos(cluster, rng, reject_refs, console)

    async def during_chaos(self, clients: Clients, load_done: asyncio.Event) -> None:
        """Runs beside the chaos loop while the chaos run's load lasts; the load waits for it to end."""

    async def everything_up(self, cluster: Cluster) -> None:
        await everything_up(cluster)

    def figures(self, payments: list[Payment]) -> dict[str, Any]:
        """More figures for the report."""
        return {}

    def extra_payments(self) -> list[Payment]:
        """Payments the variant made itself during the chaos run, to be audited with the rest."""
        return []

    def judge(self, report: audit.Report) -> None:
        """More violations, of what the variant checks itself."""


# The consumers' settings in the soak: a short ack wait, so a row whose ack
# died with a broker node or a consumer is delivered again within the run.
BATCH_SETTINGS = {"BATCH_ACK_WAIT_SECONDS": "10"}


def start_cluster(results: Path, replicas: int, console: Console, *, nats_nodes: int = 0,
                  consumers: int = 2) -> Cluster:
    """The soak's system; with `nats_nodes`, a NATS cluster of that many nodes and `consumers` consumers too."""
    system = System(results / "logs", settings=SETTINGS, environ=child_env())
    database_url = os.environ.get("DATABASE_URL")
    try:
        server = None
        name = f"soak_{os.getpid()}"
        if database_url:
            system.start_postgres(server_url=database_url)
            rails_url = system.create_database(f"{name}_rails", drop_at_end=True, migrate=False)
            system.create_database(name, drop_at_end=True)
        else:
            # Private servers (not .data/'s), so a restart disturbs nobody; not
            # under /tmp/pytest-of-*, whose mode other sessions reset.
            root = Path(tempfile.mkdtemp(prefix="payments-soak-pg-"))
            system.defer(shutil.rmtree, root, True)
            server = embedded_db.EmbeddedServer(root / "ours", free_port())
            rails_server = embedded_db.EmbeddedServer(root / "rails", free_port())
            with console.status("starting two private embedded PostgreSQL servers"):
                embedded_db.start(rails_server)
                system.defer(embedded_db.stop, rails_server)
                embedded_db.create_database(rails_server.url(), "rails")
                rails_url = rails_server.url("rails")
                system.start_postgres(server)
                system.create_database("payments")
        client_id, api_key = system.create_client("soak")
        system.start_fakes(records_url=rails_url,
                           rail_args=("--legacy-accounts", LEGACY_IBAN, "--cutoff", "24:00"))
        apis = [system.start_api(f"api-{n}") for n in range(1, replicas + 1)]
        workers = [system.start_worker(f"worker-{n}") for n in (1, 2)]
        balancer = system.start_nginx(apis, results / "nginx")
        brokers: list[Process] = []
        batch_consumers: list[Process] = []
        if nats_nodes:
            with console.status(f"starting a {nats_nodes}-node NATS JetStream cluster and {consumers} consumers"):
                nats = system.start_nats_cluster(results / "nats", nats_nodes)
                brokers = [node.process for node in nats.nodes]
                batch_consumers = [system.start_consumer(f"consumer-{n}", **BATCH_SETTINGS)
                                   for n in range(1, consumers + 1)]
    except BaseException:
        system.stop()
        raise
    return Cluster(system, apis, workers, balancer, server, system.database_url, rails_url, api_key,
                   brokers=brokers, consumers=batch_consumers, client_id=client_id)


async def soak(args: argparse.Namespace, cluster: Cluster, results: Path, console: Console,
               hooks: Hooks | None = None) -> dict[str, Any]:
    hooks = hooks or Hooks()
    rng = random.Random(args.seed)
    calm = plan_payments(rng, "calm", args.seed, args.payments)
    chaotic = plan_payments(rng, "chaos", args.seed, args.payments)
    everyone = calm + chaotic
    reject_refs = [p.reference for p in everyone if p.kind == "reject"]
    # Payment batches, when the cluster has a broker: files spread over each
    # run, and in the chaos run the calm run's first file again under a new key.
    calm_batches: list[Batch] = []
    chaos_batches: list[Batch] = []
    if cluster.brokers and getattr(args, "batch_rows", 0) > 0:
        brng = random.Random(args.seed + 2)  # its own, so the payments and the chaos are the seed's as before
        calm_batches = plan_batches(brng, "calm", args.seed, args.batch_files, args.batch_rows, cluster.client_id)
        chaos_batches = plan_batches(brng, "chaos", args.seed, args.batch_files, args.batch_rows, cluster.client_id)
        chaos_batches.insert(1, sent_again(calm_batches[0], brng, "chaos"))
        reject_refs += [r["payment_reference"] for b in calm_batches + chaos_batches if b.resubmission_of is None
                        for r in b.rows if r["kind"] == "reject"]
    all_batches = calm_batches + chaos_batches
    for_kills: list[Batch] = []
    batch_drain: list[float] = []
    first_day = datetime.now(UTC).date()
    journal = Journal(results / "client-keys.jsonl")
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        clients = Clients(session, cluster.balancer.url, cluster.api_key, journal, asyncio.Lock())
        chaos = hooks.chaos(cluster, random.Random(args.seed + 1), reject_refs, console)
        await chaos.clear_faults()  # the planned rejections only
        budget = args.seconds * 4 + 120  # a run that has not answered by then gives up: a violation

        console.rule(f"calm run: {args.payments} payments over {args.seconds:g} s"
                     + (f", {len(calm_batches)} batches of {args.batch_rows} rows" if calm_batches else ""))
        uploads = asyncio.create_task(upload_over(session, cluster.balancer.url, cluster.api_key, list(calm_batches),
                                                  args.seconds, time.monotonic() + budget))
        start, end = await offer(clients, calm, args.seconds, args.concurrency, time.monotonic() + budget)
        await uploads
        calm_rate = len(calm) / max(end - start, 1e-9)
        console.print(f"  {calm_rate:.1f} payments/s ({end - start:.1f} s)")

        console.rule(f"chaos run: {args.payments} payments over {args.seconds:g} s"
                     + (f", {len(chaos_batches)} batches (one the calm run's file again)" if chaos_batches else ""))
        load_done = asyncio.Event()
        chaos_task = asyncio.create_task(chaos.run(load_done))
        extra_task = asyncio.create_task(hooks.during_chaos(clients, load_done))
        # The first file and the file sent again go up at the start and half-way; the others wait for
        # the chaos's broker and consumer kills, each uploaded just before one (rows_in_flight), so
        # that each kill meets rows being paid; any left are uploaded once the load is over.
        for_kills = chaos_batches[2:]
        uploads = asyncio.create_task(upload_over(session, cluster.balancer.url, cluster.api_key,
                                                  chaos_batches[:2], args.seconds, time.monotonic() + budget))
        chaos.before_batch_kill = lambda: rows_in_flight(session, cluster.balancer.url, cluster.api_key,
                                                         cluster.database_url, for_kills, time.monotonic() + budget)
        try:
            start, end = await offer(clients, chaotic, args.seconds, args.concurrency, time.monotonic() + budget)
        finally:
            load_done.set()
            await chaos_task
            await extra_task
            await uploads
            while for_kills:
                await upload(session, cluster.balancer.url, cluster.api_key, for_kills.pop(0), time.monotonic() + budget)
        chaos_rate = len(chaotic) / max(end - start, 1e-9)
        console.print(f"  {chaos_rate:.1f} payments/s ({end - start:.1f} s)")
        everyone += hooks.extra_payments()

        console.rule("calm phase: faults cleared, everything up, drain, close the days, reconcile, drain")
        await chaos.clear_faults()
        await hooks.everything_up(cluster)
        first_drain = await drain(cluster.database_url, args.drain_seconds)
        console.print(f"  drained in {first_drain:.1f} s")
        uploaded = [b.batch_id for b in all_batches if b.batch_id]
        if uploaded:
            # Rows still on the broker have no key row yet, so the drain above does not wait for them.
            batch_drain.append(await rows_settled(cluster.database_url, uploaded, args.drain_seconds, completed=False))
            first_drain = max(first_drain, await drain(cluster.database_url, args.drain_seconds))
            console.print(f"  every batch row paid or parked {batch_drain[0]:.1f} s after that")
        reconciled = await close_days_and_reconcile(cluster, first_day, console)
        second_drain = await drain(cluster.database_url, args.drain_seconds)
        console.print(f"  drained again in {second_drain:.1f} s")
        if uploaded:
            batch_drain.append(await rows_settled(cluster.database_url, uploaded, args.drain_seconds, completed=True))
            console.print(f"  every batch completed {batch_drain[1]:.1f} s after that")
            await batch_reports(session, cluster.balancer.url, cluster.api_key, all_batches)
        settle_by = time.monotonic() + args.drain_seconds
        await asyncio.gather(*(clients.settle(p, settle_by) for p in everyone))
        again = await asyncio.gather(*(clients.ask_again(p) for p in everyone)) if hooks.ask_again else []
        clients.done(everyone)
        await chaos.http.close()
    journal.close()

    evidence = await collect(cluster, everyone, first_day)
    if all_batches:
        evidence.answers |= row_answers(all_batches)
        evidence.batches = await batch_evidence(cluster.database_url, all_batches)
    if hooks.ask_again:
        evidence.asked_again = {p.reference: {"first": p.response, "again": a}
                                for p, a in zip(everyone, again, strict=True) if p.response is not None}
    report = audit.audit(evidence)
    hooks.judge(report)
    finished = {k["key"]: k["finished_at"].timestamp() for k in evidence.keys.values() if k["finished_at"]}
    # Answered `indeterminate`: parked, and finished later by a re-probe or by
    # reconciliation (which unparks the key), so counted apart.
    parked = {p.key for p in everyone if p.first_status == "indeterminate"}
    recovery = stranded(results / "nginx" / "access.log", chaos.events, finished, parked)
    return {
        "command": f"python -m devtools.soak --seed {args.seed} --payments {args.payments} "
                   f"--seconds {args.seconds:g} --replicas {args.replicas}"
                   + (f" --batch-rows {args.batch_rows} --batch-files {args.batch_files}" if all_batches else ""),
        "machine": f"{os.cpu_count()} CPUs",
        "settings": SETTINGS,
        "payments": len(everyone),
        "kinds": dict(Counter(p.kind for p in everyone)),
        "throughput": {"calm_payments_per_s": round(calm_rate, 2), "chaos_payments_per_s": round(chaos_rate, 2),
                       "ratio": round(chaos_rate / calm_rate, 3) if calm_rate else None,
                       "offered_payments_per_s": round(args.payments / args.seconds, 2)},
        "recovery": recovery,
        "lease_seconds": LEASE_SECONDS,
        "chaos_actions": chaos.counts(),
        "chaos_skipped": chaos.skipped,
        "drain_seconds": [round(first_drain, 2), round(second_drain, 2)],
        "reconcile": reconciled,
        "client_statuses": dict(sum((p.statuses for p in everyone), Counter())),
        "audit": {"checked": report.checked, "violations": len(report.violations),
                  "by_check": dict(report.by_check()), "outcomes": dict(report.outcomes),
                  "answers": dict(report.answers), "parked_left_for_a_person": report.parked_left,
                  "accounts": report.accounts, "details": report.violations},
        **hooks.figures(everyone),
        **({"batches": {
            "files": [{"name": b.name, "rows": len(b.rows), "batch_id": b.batch_id, "refused": b.refused,
                       "resubmission_of": b.resubmission_of,
                       "status": (b.report or {}).get("status"), "counts": (b.report or {}).get("counts")}
                      for b in all_batches],
            "rows": sum(len(b.rows) for b in all_batches if b.resubmission_of is None),
            "seconds_until_paid_then_completed": [round(t, 2) for t in batch_drain],
            "nats_nodes": len(cluster.brokers), "consumers": len(cluster.consumers),
        }} if all_batches else {}),
        "chaos_events": chaos.events,
        "payments_detail": [asdict(p) for p in everyone if p.refused or p.gave_up],
        "_report": report,
    }


def arguments(prog: str, description: str) -> argparse.ArgumentParser:
    """The options of `make soak` (and of the soaks built on it)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--payments", type=int, default=300, help="per run (calm, then chaos)")
    parser.add_argument("--seconds", type=float, default=60, help="each run offers its payments over this long")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32, help="unanswered payments at a time")
    parser.add_argument("--drain-seconds", type=float, default=180)
    parser.add_argument("--results", type=Path, default=None, help="default .data/soak/<seed>-<time>")
    parser.add_argument("--batch-rows", type=int, default=60,
                        help="rows per payment batch file, uploaded beside the payments over a three-node NATS "
                             "cluster (`make soak`; 0: no batches)")
    parser.add_argument("--batch-files", type=int, default=3, help="batch files per run (calm, then chaos)")
    return parser


def main() -> None:
    args = arguments("python -m devtools.soak", __doc__.splitlines()[0]).parse_args()
    nodes = 3 if args.batch_rows > 0 and args.batch_files > 0 else 0

    def start(results: Path, replicas: int, console: Console) -> Cluster:
        return start_cluster(results, replicas, console, nats_nodes=nodes)

    run(args, Console(width=120), start)


def run(args: argparse.Namespace, console: Console, start: Any, hooks: Hooks | None = None,
        print_more: Any = lambda console, figures: None) -> None:
    """Start the cluster (`start(results, replicas, console)`), soak it, print the audit and the figures
    (and `print_more`'s), write them to the results directory; exit 1 on any violation."""
    if nginx.find_nginx() is None:
        console.print(f"[red]{nginx.INSTALL_HINT}[/]")
        raise SystemExit(2)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    results = (args.results or Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")) / "soak" / f"{args.seed}-{stamp}")
    results = results.resolve()
    results.mkdir(parents=True, exist_ok=True)

    cluster = start(results, args.replicas, console)
    try:
        console.print(f"nginx {cluster.balancer.url} over {len(cluster.apis)} replicas; results in {results}")
        figures = asyncio.run(soak(args, cluster, results, console, hooks))
    finally:
        for pid in cluster.frozen:
            os.kill(pid, signal.SIGCONT)
        cluster.system.stop()
    report = figures.pop("_report")
    (results / "soak.json").write_text(json.dumps(figures, indent=2, default=str))

    audit.print_table(console, report)
    t = figures["throughput"]
    console.print(f"throughput: calm {t['calm_payments_per_s']}/s, chaos {t['chaos_payments_per_s']}/s, "
                  f"ratio {t['ratio']} (target >= 0.5; offered {t['offered_payments_per_s']}/s each)")
    for action, r in figures["recovery"].items():
        console.print(f"{action}: {r['stranded_payments']} stranded payments, median {r['median_seconds']} s, "
                      f"max {r['max_seconds']} s to finish (target median <= {LEASE_SECONDS + 5} s); "
                      f"{r['parked_then_settled']} parked and settled later (not counted)")
    console.print("chaos actions: " + ", ".join(f"{k}={v}" for k, v in sorted(figures["chaos_actions"].items())))
    for skipped in figures["chaos_skipped"]:
        console.print(f"skipped: {skipped}")
    if "batches" in figures:
        b = figures["batches"]
        console.print(f"batches: {len(b['files'])} uploads ({sum(1 for f in b['files'] if f['resubmission_of'])} "
                      f"a file sent again), {b['rows']} rows over {b['nats_nodes']} NATS nodes and {b['consumers']} "
                      f"consumers; " + ", ".join(f"{f['name']} {f['status']}" for f in b["files"]))
    print_more(console, figures)
    console.print(f"results: {results / 'soak.json'}")
    raise SystemExit(1 if report.violations else 0)

if __name__ == "__main__":
    main()
