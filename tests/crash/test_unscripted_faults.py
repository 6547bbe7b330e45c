"""Faults nobody scripted: a PSP that answers garbage, a bug mid-payment, a PSP down for long, a rail refusing connections.

The fault plans of the fakes script the failures we thought of. These tests
meet the service with the ones an operations team meets unannounced, on real
processes, and check what must hold whatever happens, from durable state:
no 500, attempts bounded by MAX_ATTEMPTS with a backoff between them (no
tight loop), nothing stored as final that is not, a park that heals itself
once the PSP answers again, and in the end one charge, one payout, a
balanced ledger.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from tests.conftest import LEGACY_IBAN
from tests.support import charges, headers, key_row, payment_body, transfers, unbalanced_payments, until

pytestmark = pytest.mark.usefixtures("stack")

# Fast clocks for the runner and the worker, so that a whole outage, its
# attempts and its parking fit in a few seconds.
FAST = {
    "MAX_ATTEMPTS": "3",
    "BACKOFF_BASE_SECONDS": "0.2",
    "BACKOFF_CAP_SECONDS": "0.4",
    "PARKED_RECHECK_SECONDS": "0.5",
    "WORKER_POLL_SECONDS": "0.1",
    "WORKER_MIN_AGE_SECONDS": "0",
}


class GarbageServer:
    """Answers every connection with bytes that are not HTTP, and counts what it was sent."""

    def __init__(self) -> None:
        self.posts = 0
        self.gets = 0

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = await reader.readline()
        self.posts += request_line.startswith(b"POST")
        self.gets += request_line.startswith(b"GET")
        writer.write(b"220 mail.example ESMTP ready\r\n")
        await writer.drain()
        writer.close()


async def _parked(db, client_id: int, key: str) -> bool:
    row = await key_row(db, client_id, key)
    return row is not None and row["parked_at"] is not None


async def test_a_psp_that_answers_garbage_gets_bounded_attempts_and_a_park_never_a_500(http, db, acme, processes):
    garbage = GarbageServer()
    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    psp_url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        api = processes.api("garbage-psp", PSP_URL=psp_url, **FAST)
        key, body = str(uuid.uuid4()), payment_body()

        first = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))

        assert first.status_code == 202 and first.json()["status"] == "processing", first.text
        processes.worker(PSP_URL=psp_url, **FAST)
        await until(lambda: _parked(db, acme.id, key), "the payment to be parked")
        parked = await key_row(db, acme.id, key)
        assert parked["attempts"] == 3 and parked["state"] == "started" and parked["response_body"] is None
        assert parked["last_error"] == "psp: no valid HTTP answer"
        # Two entries per attempt (owned, released or parked): the timeline
        # grows with the attempts, which are bounded, never with time.
        assert len(json.loads(parked["timeline"])) == 2 * 3
        posts_when_parked = garbage.posts

        # Parked, it is re-probed every PARKED_RECHECK_SECONDS; the garbage
        # answers teach nothing, so nothing about the row grows.
        gets_when_parked = garbage.gets
        await until(lambda: _probed_again(garbage, gets_when_parked + 2), "two re-probes")
        again = await key_row(db, acme.id, key)
        assert (again["attempts"], again["timeline"], again["parked_at"]) == (
            parked["attempts"], parked["timeline"], parked["parked_at"],
        )
        assert garbage.posts == posts_when_parked, "a re-probe that learns nothing sends nothing"
        assert garbage.posts <= 3, "at most one charge request per attempt"
        shown = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))
        assert shown.status_code == 202 and shown.json()["status"] == "indeterminate"
    finally:
        server.close()


async def _probed_again(garbage: GarbageServer, gets: int) -> bool:
    return garbage.gets >= gets


async def test_an_unexpected_error_mid_payment_answers_202_and_a_later_retry_pays_once(http, stack, db, acme):
    key, body = str(uuid.uuid4()), payment_body()
    # A stand-in for a bug: the statement that records the charge fails.
    await db.execute(
        f"""
        CREATE FUNCTION pg_temp_fail() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.reference = '{body["reference"]}' AND NEW.psp_charge_id IS NOT NULL THEN
                RAISE EXCEPTION 'injected bug';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER injected_bug BEFORE UPDATE ON payment FOR EACH ROW EXECUTE FUNCTION pg_temp_fail();
        """
    )
    try:
        first = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    finally:
        await db.execute("DROP TRIGGER injected_bug ON payment; DROP FUNCTION pg_temp_fail()")

    assert first.status_code == 202 and first.json()["status"] == "processing", first.text
    row = await key_row(db, acme.id, key)
    assert row["state"] == "started" and row["response_body"] is None, "nothing stored as final"
    assert row["recovery_point"] == "EXT1_SENT" and row["lease_token"] is None, "the lease was released"
    assert row["attempts"] == 1 and row["last_error"].startswith("interrupted by ")
    assert await db.fetchval("SELECT $1 > now()", row["next_attempt_at"]), "the worker waits a backoff"
    assert "injected bug" not in row["last_error"]
    assert len(await charges(db, body["reference"])) == 1, "the PSP did charge"

    retry = await http.post(f"{stack.apis[1].url}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 201 and retry.json()["status"] == "succeeded"
    assert len(await charges(db, body["reference"])) == 1, "found by its key, not charged again"
    assert len(await transfers(db, body["reference"])) == 1
    assert await unbalanced_payments(db) == []


async def test_a_psp_down_longer_than_the_attempts_allow_heals_by_itself_with_one_charge(http, db, acme, processes):
    psp = processes.fake("psp")
    psp.stop()  # down: every connection refused
    api = processes.api("psp-down", PSP_URL=psp.url, **FAST)
    key, body = str(uuid.uuid4()), payment_body()

    first = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))

    assert first.status_code == 202 and first.json()["status"] == "processing"
    processes.worker(PSP_URL=psp.url, **FAST)
    await until(lambda: _parked(db, acme.id, key), "the payment to be parked")
    parked = await key_row(db, acme.id, key)
    assert parked["attempts"] == 3 and parked["last_error"] == "psp: cannot connect"
    assert parked["not_sent"], "every attempt was refused before sending"
    # Still down: the worker's re-probes learn nothing and change nothing.
    await until(lambda: _recheck_claimed(db, acme.id, key, parked["next_attempt_at"], rounds=2), "two re-probes")
    still = await key_row(db, acme.id, key)
    assert (still["attempts"], still["timeline"]) == (parked["attempts"], parked["timeline"])

    processes.fake("psp", port=psp.port)  # back, on the same address

    await until(lambda: _finished(db, acme.id, key), "the payment to finish by itself", timeout=30)
    row = await key_row(db, acme.id, key)
    assert json.loads(row["response_body"])["status"] == "succeeded"
    events = [entry["event"] for entry in json.loads(row["timeline"])]
    assert "parked" in events and "re-probe answered" in events
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1
    assert await unbalanced_payments(db) == []
    replay = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))
    assert replay.status_code == 201 and replay.text == row["response_body"]


async def _recheck_claimed(db, client_id: int, key: str, parked_until, *, rounds: int) -> bool:
    """Whether `next_attempt_at` has moved on by at least `rounds` re-probe intervals since parking."""
    row = await key_row(db, client_id, key)
    return (row["next_attempt_at"] - parked_until).total_seconds() >= rounds * float(FAST["PARKED_RECHECK_SECONDS"])


async def _finished(db, client_id: int, key: str) -> bool:
    return (await key_row(db, client_id, key))["state"] == "finished"


async def test_a_refused_connection_to_a_legacy_rail_is_sent_later_and_paid_once(http, db, acme, processes):
    rail = processes.fake("rail", "--legacy-accounts", LEGACY_IBAN, "--cutoff", "24:00")
    rail.stop()
    api = processes.api("legacy-refused", RAIL_URL=rail.url)
    key = str(uuid.uuid4())
    body = payment_body(beneficiary={"name": "Legacy Bank Customer", "iban": LEGACY_IBAN})

    first = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))

    # Nothing reached the rail, so nothing was paid out: not parked for
    # reconciliation, but released, free to be sent again.
    assert first.status_code == 202 and first.json()["status"] == "processing"
    row = await key_row(db, acme.id, key)
    assert row["recovery_point"] == "EXT2_SENT" and row["parked_at"] is None and row["not_sent"]

    processes.fake("rail", "--legacy-accounts", LEGACY_IBAN, "--cutoff", "24:00", port=rail.port)
    retry = await http.post(f"{api.url}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 201 and retry.json()["status"] == "succeeded"
    assert len(await transfers(db, body["reference"])) == 1
    assert await unbalanced_payments(db) == []
