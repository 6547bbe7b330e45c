"""The counter-example: the same crash, against the naive twin and the real service.

The naive twin (naive_twin/) does the same work with no keys, phases or
leases. A client whose first request died after the card was charged retries,
as any client must: the naive twin charges the card again, the real service
does not. This is the double charge the whole design exists to prevent.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from tests.crash.test_crash_matrix import lease_expired
from tests.support import charges, headers, payment_body, transfers


async def test_the_naive_twin_charges_twice_when_a_client_retries_after_a_crash(http, stack, db, acme, processes):
    body = payment_body()
    doomed = processes.api("naive-doomed", command="naive-twin", NAIVE_CRASH_AFTER_CHARGE="1")
    with pytest.raises(httpx.HTTPError):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=acme.auth)
    assert doomed.popen.wait(10) == 137

    naive = processes.api("naive", command="naive-twin")
    retry = await http.post(f"{naive.url}/v1/payments", json=body, headers=acme.auth)

    assert retry.status_code == 201
    assert len(await charges(db, body["reference"])) == 2, "charged twice for one order"
    assert await db.fetchval("SELECT count(*) FROM naive.payment WHERE reference = $1", body["reference"]) == 2


async def test_the_real_service_charges_once_after_the_same_crash(http, stack, db, acme, processes):
    key, body = str(uuid.uuid4()), payment_body()
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT="after-call-EXT1", LEASE_SECONDS="1")
    with pytest.raises(httpx.HTTPError):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137

    await lease_expired(db, acme.id, key)
    retry = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))

    assert retry.status_code == 201
    assert len(await charges(db, body["reference"])) == 1
    assert len(await transfers(db, body["reference"])) == 1
