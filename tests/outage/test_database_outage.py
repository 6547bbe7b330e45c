"""The database goes away under real processes, and every payment still happens exactly once.

On a private stack (conftest.py: a PostgreSQL server of its own, two APIs, a
recovery worker, the fake PSP and rail), these tests stop the server while
payments are running, cut the API's connections between a PSP call and the
statement that records it, and stop an API with SIGTERM in the middle of a
payment. The evidence is durable: our key rows, payments and ledger, and the
fake PSP's and rail's own records, read after the fact.
"""

from __future__ import annotations

import asyncio
import collections
import signal
import time
import uuid

import asyncpg
import httpx

from devtools import embedded_db
from tests.conftest import Process, make_client
from tests.support import claimed, headers, key_row, payment_body, unbalanced_payments, until

CUSTOMERS = 30  # concurrent clients, each paying one payment after another
OUTAGE_SECONDS = 5.0  # how long the server stays stopped, at least
DEADLINE_SECONDS = 90.0  # every payment started must have its final answer by then


class Customers:
    """Clients that pay, each with its own keys, and retry the same key until a final 201.

    They behave as the shipped client does: on 409, 503 or 202 they wait the
    Retry-After they were sent and retry with the same key and body; on a
    connection error, a moment. Every status they see is counted.
    """

    def __init__(self, apis: list[str], client, deadline: float) -> None:
        self.apis, self.client, self.deadline = apis, client, deadline
        self.statuses: collections.Counter[int | str] = collections.Counter()
        self.unavailable: list[httpx.Response] = []
        self.started: list[tuple[str, dict]] = []  # (key, body) of every payment begun
        self.stop = asyncio.Event()

    async def pay(self, http: httpx.AsyncClient, n: int, key: str, body: dict) -> None:
        attempt = 0
        while True:
            assert time.monotonic() < self.deadline, f"no final answer for key {key} before the deadline"
            api = self.apis[(n + attempt) % len(self.apis)]
            attempt += 1
            try:
                response = await http.post(f"{api}/v1/payments", json=body, headers=headers(self.client, key))
            except httpx.HTTPError:
                self.statuses["no response"] += 1
                await asyncio.sleep(0.2)  # the client's own pause before retrying, not a synchronisation
                continue
            self.statuses[response.status_code] += 1
            if response.status_code == 201:
                return
            if response.status_code == 503:
                self.unavailable.append(response)
            # A 500 is counted (and fails the test) but retried, so the test still learns what became of it.
            await asyncio.sleep(float(response.headers.get("Retry-After", "1")))

    async def customer(self, http: httpx.AsyncClient, n: int) -> None:
        while not self.stop.is_set():
            key, body = str(uuid.uuid4()), payment_body()
            self.started.append((key, body))
            await self.pay(http, n, key, body)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=CUSTOMERS * 2)) as http:
            await asyncio.gather(*(self.customer(http, n) for n in range(CUSTOMERS)))


async def health(http: httpx.AsyncClient, api: str) -> tuple[int, dict] | None:
    try:
        response = await http.get(f"{api}/healthz", timeout=5)
    except httpx.HTTPError:
        return None
    return response.status_code, response.json()


async def assert_each_paid_exactly_once(ours: asyncpg.Connection, theirs: asyncpg.Connection, client, started):
    keys = [key for key, _ in started]
    references = [body["reference"] for _, body in started]
    rows = await ours.fetch(
        "SELECT k.state, k.response_code, p.status, p.reference, "
        "       (SELECT count(*) FROM ledger_entry l WHERE l.payment_id = p.id) AS entries "
        "FROM idempotency_key k JOIN payment p ON p.id = k.payment_id "
        "WHERE k.client_id = $1 AND k.key = ANY($2)", client.id, keys,
    )
    assert len(rows) == len(keys), "one key row and one payment for every payment started"
    assert {(r["state"], r["response_code"], r["status"], r["entries"]) for r in rows} == {("finished", 201, "succeeded", 5)}
    assert await ours.fetchval("SELECT count(*) FROM payment WHERE reference = ANY($1)", references) == len(keys)
    assert await unbalanced_payments(ours) == []
    for table in ("fake_psp.charge", "fake_rail.transfer"):
        counts = dict(
            await theirs.fetch(f"SELECT reference, count(*) FROM {table} WHERE reference = ANY($1) GROUP BY reference", references)
        )
        assert counts == {ref: 1 for ref in references}, f"exactly one record in {table} for each payment"


async def test_payments_under_load_survive_a_database_restart_exactly_once(private_stack, ours, theirs):
    stack = private_stack
    client = await make_client(ours, "outage")
    await ours.close()  # the restart will cut it; assertions use a new one
    customers = Customers([api.url for api in stack.apis], client, time.monotonic() + DEADLINE_SECONDS)
    load = asyncio.create_task(customers.run())
    healthz: dict[str, list] = {"during": [], "after": []}

    def paid(n: int):
        async def enough() -> bool:
            if load.done():
                load.result()  # a customer that failed: its error, now
            return customers.statuses[201] >= n
        return enough

    async def outage(http: httpx.AsyncClient) -> Process:
        await until(paid(CUSTOMERS), "the load to be under way", timeout=30)

        await stack.stop_database()
        stopped = time.monotonic()
        assert not embedded_db.is_accepting(stack.server.port), "the server is down"
        # A worker started into the outage must wait for the database, not exit.
        late_worker = await asyncio.to_thread(stack.start_worker, "worker-started-during-the-outage")

        async def outage_seen() -> bool:
            if load.done():
                load.result()  # a customer that failed: its error, now
            seen = await health(http, stack.api)
            healthz["during"].append(seen)
            return customers.statuses[503] > 0 and seen is not None and seen[0] == 503

        try:
            await until(outage_seen, "an API to answer 503 and /healthz to report the database down", timeout=20)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: statuses {customers.statuses}, /healthz {healthz['during'][-3:]}") from None
        # The outage lasts a while, whatever the polling above took: the
        # worker must fail several sweeps in a row, and back off.
        await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - stopped)))
        await stack.start_database()

        async def healthy_again() -> bool:
            healthz["after"].append(await health(http, stack.api))
            return healthz["after"][-1] is not None and healthz["after"][-1][0] == 200

        await until(healthy_again, "/healthz to report the database back", timeout=20)
        await until(paid(customers.statuses[201] + CUSTOMERS), "payments to flow again", timeout=30)
        customers.stop.set()
        await load
        return late_worker

    async with httpx.AsyncClient() as http:
        try:
            late_worker = await outage(http)
        finally:
            load.cancel()  # a failed test leaves no customers paying into the next one
            await stack.start_database()  # nor a stopped server (a no-op when it is up)

    assert customers.statuses[500] == 0, customers.statuses
    assert customers.statuses[503] > 0, customers.statuses
    for response in customers.unavailable:
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["type"] == "/problems/service-unavailable"
        assert int(response.headers["Retry-After"]) >= 1
    down = [h for h in healthz["during"] if h is not None and h[0] == 503]
    assert down and down[-1][1]["checks"] == {"database": "down"}
    assert healthz["after"][-1][1] == {"status": "ok", "database": "ok"}
    assert stack.worker.popen.poll() is None, "the worker outlived the outage"
    assert late_worker.popen.poll() is None, "a worker started during the outage waited for the database"

    ours = await asyncpg.connect(stack.database_url)
    try:
        await assert_each_paid_exactly_once(ours, theirs, client, customers.started)
    finally:
        await ours.close()
    assert len(customers.started) >= 2 * CUSTOMERS


async def key_row_update_waiting(conn: asyncpg.Connection) -> bool:
    """Is an UPDATE of a key row waiting for a row lock in our database?"""
    return await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
        "AND wait_event_type = 'Lock' AND query LIKE '%UPDATE idempotency_key%'"
    ) > 0


async def pay_until_final(http, api: str, client, key: str, body: dict, timeout: float = 30) -> httpx.Response:
    deadline = time.monotonic() + timeout
    while True:
        response = await http.post(f"{api}/v1/payments", json=body, headers=headers(client, key))
        if response.status_code == 201:
            return response
        assert response.status_code in (202, 409, 503), response.text
        assert time.monotonic() < deadline, f"no final answer: {response.status_code} {response.text}"
        await asyncio.sleep(float(response.headers.get("Retry-After", "1")))  # as the client is told


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def test_a_connection_cut_between_the_psp_call_and_its_record_is_never_a_500_and_pays_once(
    private_stack, ours, theirs
):
    stack = private_stack
    client = await make_client(ours, "cut")
    key, body = str(uuid.uuid4()), payment_body()
    async with httpx.AsyncClient(timeout=30) as http:
        await set_faults(http, stack.psp, {"action": "delay", "seconds": 2, "times": 1, "reference": body["reference"]})
        first = asyncio.create_task(
            http.post(f"{stack.api}/v1/payments", json=body, headers=headers(client, key))
        )
        await claimed(ours, client.id, key)
        # The charge is on its way (the PSP holds it 2 s); every connection
        # the API holds to our database is cut before it can record it. (The
        # fakes keep their records elsewhere: their connections are untouched.)
        cut = await ours.fetchval(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"
        )
        answer = await first

        assert cut > 0
        # No connection is held during the PSP call, so the cut hits only idle
        # pooled connections, which are replaced at checkout
        # (app/db/engine.py::_replace_if_closed): the payment goes on, 201.
        # Only a cut that lands on a statement in flight interrupts it: then
        # 202 (booked as an attempt) or 503. Never a 500.
        assert answer.status_code in (201, 202, 503), answer.text
        if answer.status_code == 503:
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"] == "/problems/service-unavailable"
        if answer.status_code != 201:
            row = await key_row(ours, client.id, key)
            # Released on a fresh connection (or already taken over by the worker,
            # which it could not be while the lease lived): nobody waits out the lease.
            assert row["lease_token"] is None or row["attempts"] >= 2, "released, not left to its lease"
        final = await pay_until_final(http, stack.apis[1].url, client, key, body)

    assert final.json()["status"] == "succeeded"
    [payment] = await ours.fetch("SELECT * FROM payment WHERE reference = $1", body["reference"])
    assert await ours.fetchval("SELECT count(*) FROM ledger_entry WHERE payment_id = $1", payment["id"]) == 5
    assert await unbalanced_payments(ours) == []
    assert await theirs.fetchval("SELECT count(*) FROM fake_psp.charge WHERE reference = $1", body["reference"]) == 1
    assert await theirs.fetchval("SELECT count(*) FROM fake_rail.transfer WHERE reference = $1", body["reference"]) == 1
    assert stack.worker.popen.poll() is None, "the worker's connections were cut too; it carried on"


async def test_an_api_stopped_with_sigterm_gives_back_the_lease_of_a_payment_it_cannot_finish(
    private_stack, ours, theirs
):
    stack = private_stack
    # A long PSP timeout, so the charge is still in flight when the grace runs out.
    stopping = stack.start_api("stopping", SHUTDOWN_GRACE_SECONDS="1", LEASE_SECONDS="30", PSP_TIMEOUT_SECONDS="30")
    client = await make_client(ours, "sigterm")
    key, body = str(uuid.uuid4()), payment_body()
    delay = 10
    async with httpx.AsyncClient(timeout=30) as http:
        await set_faults(http, stack.psp, {"action": "delay", "seconds": delay, "times": 1, "reference": body["reference"]})
        sent = time.monotonic()
        first = asyncio.create_task(
            http.post(f"{stopping.url}/v1/payments", json=body, headers=headers(client, key))
        )
        await claimed(ours, client.id, key)
        claimed_at = time.monotonic()

        async def release_waiting() -> bool:
            if stopping.popen.poll() is not None:
                return True  # gone already: the assertions below say whether it released
            return await key_row_update_waiting(ours)

        # A database under load makes the release slow. Here the test holds
        # the key row's lock (from another connection) while the API stops,
        # so its release waits a second; uvicorn has long since run the app's
        # shutdown by then. Unless the shutdown waits for it, the process
        # exits first and the release never commits.
        locker = await asyncpg.connect(stack.database_url)
        try:
            async with locker.transaction():
                await locker.execute(
                    "SELECT 1 FROM idempotency_key WHERE client_id = $1 AND key = $2 FOR UPDATE", client.id, key
                )
                stopping.popen.send_signal(signal.SIGTERM)
                await until(release_waiting, "the stopping API's release to wait on the row lock", timeout=10)
                await asyncio.sleep(1.0)  # the slow database of this scenario, not a synchronisation
        finally:
            await locker.close()
        exit_code = await asyncio.to_thread(stopping.popen.wait, 15)
        stopped_in = time.monotonic() - claimed_at

        # uvicorn exits by re-raising the SIGTERM it caught, once it is done.
        assert exit_code in (0, -signal.SIGTERM)
        assert stopped_in < 1 + 5 + 2, "the grace (1 s), then at most 5 s to release, then gone"
        row = await key_row(ours, client.id, key)
        # Released: no owner now, or already a new one (the worker may take a
        # released operation over at once; it could not while the lease lived).
        assert row["lease_token"] is None or row["attempts"] >= 2, "released, not left to a 30 s lease"
        try:
            await first
        except httpx.HTTPError:
            pass  # the request was cut off: its client learns nothing and retries

        # The retry takes it over at once; or the worker got there first (it
        # may: the operation is free), and the retry gets 409 until the
        # worker finishes. Either way, well before the 30 s lease would have run out.
        retry = await pay_until_final(
            http, stack.apis[1].url, client, key, body, timeout=30 - (time.monotonic() - claimed_at) - 5
        )
        assert retry.json()["status"] == "succeeded"

    # The stopped API's charge is still held at the PSP; when it lands it
    # finds the retry's charge under the same key K1 and adds nothing. The
    # fake leaves no trace of a replay, so the test waits for its moment.
    async def landed() -> bool:
        return time.monotonic() > sent + delay + 1

    await until(landed, "the delayed charge to land", timeout=delay + 5)
    assert await theirs.fetchval("SELECT count(*) FROM fake_psp.charge WHERE reference = $1", body["reference"]) == 1
    assert await theirs.fetchval("SELECT count(*) FROM fake_rail.transfer WHERE reference = $1", body["reference"]) == 1
    assert await unbalanced_payments(ours) == []


async def commits_wait_for_a_standby(database_url: str) -> bool:
    """Does a new session of the server see synchronous_standby_names set (the reload reached it)?"""
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval("SHOW synchronous_standby_names") == "nobody"
    finally:
        await conn.close()


async def test_with_no_synchronous_standby_a_payment_is_a_503_within_the_bound_and_is_made_once_when_one_returns(
    private_stack, ours, theirs
):
    """Catches: a commit waiting for a synchronous standby that never comes holding its request until the
    balancer gives up (a 504), and a bound enforced with a cancel request, which leaves that commit visible on
    the primary before any standby has it (PostgreSQL's warning "canceling wait for synchronous replication").

    One server stands for a primary in strict synchronous mode whose standbys are both gone: with
    synchronous_standby_names naming a standby that does not exist, every commit waits (docs/failover.md)."""
    stack = private_stack
    client = await make_client(ours, "standbys-gone")
    server_log = stack.server.data_dir / "server.log"
    async with httpx.AsyncClient(timeout=30) as http:
        earlier = (await pay_until_final(http, stack.api, client, str(uuid.uuid4()), payment_body())).json()
        log_from = server_log.stat().st_size
        key, body = str(uuid.uuid4()), payment_body()
        await ours.execute("ALTER SYSTEM SET synchronous_standby_names = 'nobody'")
        try:
            await ours.execute("SELECT pg_reload_conf()")
            await until(lambda: commits_wait_for_a_standby(stack.database_url), "the reload to reach new sessions")
            started = time.monotonic()
            refused = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(client, key))
            took = time.monotonic() - started
            # Reads wait for no standby: a client still reads its payments.
            read_back = await http.get(f"{stack.api}/v1/payments/{earlier['id']}", headers=client.auth)
            waiting = await ours.fetchval("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
            row_meanwhile = await key_row(ours, client.id, key)
        finally:
            await ours.execute("ALTER SYSTEM RESET synchronous_standby_names")
            await ours.execute("SELECT pg_reload_conf()")

        assert refused.status_code == 503, refused.text
        assert refused.headers["content-type"] == "application/problem+json" and "retry-after" in refused.headers
        assert took < 4.5, f"answered after {took:.1f} s: within the bound (2 s), below nginx's 5 s read timeout"
        assert read_back.status_code == 200
        assert waiting >= 1, "the claim's commit still waits for a standby: dropped, not cancelled"
        assert row_meanwhile is None, "and is visible nowhere until a standby has it"

        # A standby back (here: none required any more): the waiting commit completes; the retry finds it.
        await claimed(ours, client.id, key)
        final = await pay_until_final(http, stack.api, client, key, body)
    assert final.status_code == 201 and final.json()["status"] == "succeeded"
    assert await ours.fetchval("SELECT count(*) FROM payment WHERE reference = $1", body["reference"]) == 1
    for table in ("fake_psp.charge", "fake_rail.transfer"):
        assert await theirs.fetchval(f"SELECT count(*) FROM {table} WHERE reference = $1", body["reference"]) == 1
    assert stack.worker.running, "the worker backed off and carried on"
    with server_log.open("rb") as log:
        log.seek(log_from)
        assert b"canceling wait for synchronous replication" not in log.read()
