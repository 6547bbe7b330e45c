"""Refunds racing each other, a returned payout's compensation and their own payment's recovery.

Real processes: the session's two API processes, sharing one database and
nothing else, the fake PSP, the fake rail and (for the recovery) a worker.
Every refund of a race is fired at once (asyncio.gather), spread over both
APIs. The one rule under test is the reservation in claim_refund
(app/payments/refunds/phases.py): a conditional write on the payment's
refunded amount under its row lock. The PSP's own over-refund guard is
switched off in every test (fault `allow_over_refund`), so it cannot hide a
refund we should never have asked for: the PSP records it, flagged
`over_refund`, and the test sees it.

The evidence is durable: our refund rows, the payment's refunded amount, the
key rows, the ledger, and the PSP's own refunds of the charge. Where a test
needs to know whether a refund was answered before or after a fact (the
return recorded, the payment succeeded), a `Watch` polls that fact in the
database and the test classifies each answer only where the polls prove the
order; the rest may land either way and must be consistent.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, replace

import asyncpg
import pytest

from tests.crash.test_crash_matrix import FAST_WORKER
from tests.integration.test_refunds import paid, psp_refunds_of, refund
from tests.integration.test_returns import return_payout, set_faults
from tests.support import headers, key_row, payment_body, requests_at, unbalanced_payments, until

pytestmark = pytest.mark.usefixtures("stack")

# The PSP records every refund, even past the charge's balance: nothing but
# our own reservation keeps the refunds within the charge.
PSP_GUARD_OFF = {"action": "allow_over_refund", "operation": "refund", "times": None}

EXCEEDS = "/problems/refund-exceeds-payment"
IN_PROGRESS = "/problems/request-in-progress"
NOT_REFUNDABLE = "/problems/payment-not-refundable"


@dataclass
class Answer:
    """One refund of a race: what was sent, where, when, and what came back."""

    n: int
    api: str
    key: str
    body: dict
    sent_at: float
    answered_at: float
    status_code: int
    content: bytes

    @property
    def json(self) -> dict:
        return json.loads(self.content)

    @property
    def kind(self) -> str:
        """`succeeded` (201), `pending` (202) or the problem's type."""
        if self.status_code == 201:
            return self.json["status"]
        if self.status_code == 202:
            return "pending"
        return self.json.get("type", str(self.status_code))


async def fire(http, stack, acme, payment_id: str, bodies: list[dict], *, first: int = 0) -> list[Answer]:
    """Every body as a refund at once, with a key of its own, alternately at the first and the second API."""

    async def one(n: int, body: dict) -> Answer:
        api, key = stack.apis[n % 2].url, str(uuid.uuid4())
        sent_at = time.monotonic()
        response = await refund(http, api, acme, payment_id, body, key)
        return Answer(n, api, key, body, sent_at, time.monotonic(), response.status_code, response.content)

    return list(await asyncio.gather(*(one(first + i, body) for i, body in enumerate(bodies))))


async def to_the_end(http, acme, payment_id: str, answers: list[Answer]) -> list[Answer]:
    """`answers` with every 202 retried under its own key, as its client would, until it is final.

    On a loaded machine a refund's call to the PSP can outlast the tests'
    PSP_TIMEOUT_SECONDS: that refund is answered 202 (pending), its
    reservation kept, and a retry of its key finishes it by probing the PSP.
    The race's verdict is about final answers, so it is judged on them.
    """
    final = []
    for answer in answers:
        if answer.kind == "pending":
            retried: list[Answer] = []

            async def finished(a: Answer = answer, out: list[Answer] = retried) -> bool:
                response = await refund(http, a.api, acme, payment_id, a.body, a.key)
                out[:] = [replace(a, answered_at=time.monotonic(), status_code=response.status_code,
                                  content=response.content)]
                return response.status_code not in (202, 409) or out[0].kind not in ("pending", IN_PROGRESS)

            await until(finished, f"refund {answer.key} to be final", timeout=60)
            answer = retried[0]
        final.append(answer)
    return final


def partial(amount: int, count: int, prefix: str, first: int = 0) -> list[dict]:
    return [{"amount": amount, "reference": f"{prefix}-{first + i}"} for i in range(count)]


class Watch:
    """Polls a durable fact that, once true, stays true, on a connection of its own.

    `not_yet` is when the latest poll that found it false began: the fact
    certainly did not hold at any moment up to then. `held_from` is when the
    first poll that found it true ended: it certainly held from then on.
    Between the two, nothing is proven either way.
    """

    def __init__(self, conn: asyncpg.Connection, query: str, *args) -> None:
        self.conn, self.query, self.args = conn, query, args
        self.not_yet = float("-inf")
        self.held_from: float | None = None
        self.task: asyncio.Task | None = None

    async def _poll(self) -> None:
        while self.held_from is None:
            began = time.monotonic()
            if await self.conn.fetchval(self.query, *self.args):
                self.held_from = time.monotonic()
            else:
                self.not_yet = began
                await asyncio.sleep(0.005)  # the polling interval, not a synchronisation

    def answered_before(self, answer: Answer) -> bool:
        return answer.answered_at <= self.not_yet

    def sent_after(self, answer: Answer) -> bool:
        return self.held_from is not None and answer.sent_at >= self.held_from

    async def __aenter__(self) -> Watch:
        self.task = asyncio.create_task(self._poll())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self.task is not None
        if exc[0] is not None:
            self.task.cancel()
        await asyncio.wait_for(self.task, 30)


class Gate:
    """The payment's row lock, held by the test, so that the claims of a race all queue on it at once.

    A claim lasts a few milliseconds: left alone, a race's claims may happen
    not to overlap, and a missing lock would go unseen. Held here until
    `queued` claims wait on it, then let go, every one of them reads the
    payment only after the one before it committed (with the lock), or all
    from the same moment (without it).
    """

    def __init__(self, database_url: str, payment_id: str) -> None:
        self.database_url, self.payment_id = database_url, uuid.UUID(payment_id)

    async def __aenter__(self) -> Gate:
        self.conn = await asyncpg.connect(self.database_url)
        self.transaction = self.conn.transaction()
        await self.transaction.start()
        await self.conn.execute("SELECT 1 FROM payment WHERE id = $1 FOR UPDATE", self.payment_id)
        return self

    async def hold_until(self, db, queued: int) -> None:
        """Until `queued` sessions of this database wait on a row lock (ours, or a waiter's ahead of them)."""

        async def waiting() -> bool:
            return await db.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock' AND wait_event IN ('tuple', 'transactionid')"
            ) >= queued

        await until(waiting, f"{queued} claims to queue on the payment's lock")

    async def __aexit__(self, *exc) -> None:
        await self.transaction.rollback()
        await self.conn.close()


async def gated(db, database_url: str, payment_id: str, queued: int, race) -> list[Answer]:
    """Run `race` (a coroutine firing refunds) with the payment's lock held until `queued` claims wait on it."""
    async with Gate(database_url, payment_id) as gate:
        answers = asyncio.ensure_future(race)
        await gate.hold_until(db, queued)
    return await answers


# --- Reading the evidence ---------------------------------------------------------------------------


async def payment_row(db, payment_id: str) -> asyncpg.Record:
    return await db.fetchrow("SELECT * FROM payment WHERE id = $1", uuid.UUID(payment_id))


async def our_refunds(db, payment_id: str) -> list[asyncpg.Record]:
    return await db.fetch("SELECT * FROM refund WHERE payment_id = $1 ORDER BY id", uuid.UUID(payment_id))


async def unbalanced_accounts(db, payment_id: str) -> list[asyncpg.Record]:
    """The accounts of this payment whose entries do not sum to zero (after a full refund there must be none)."""
    return await db.fetch(
        "SELECT account, sum(debit_minor) - sum(credit_minor) AS net FROM ledger_entry WHERE payment_id = $1 "
        "GROUP BY account HAVING sum(debit_minor) <> sum(credit_minor)", uuid.UUID(payment_id),
    )


async def refund_postings(db, payment_id: str) -> list[str]:
    return [r["posting"] for r in await db.fetch(
        "SELECT DISTINCT posting FROM ledger_entry WHERE payment_id = $1 AND posting LIKE 'refund:%'",
        uuid.UUID(payment_id),
    )]


async def assert_within_the_charge(db, payment: dict, succeeded: list[asyncpg.Record], *, total: int) -> None:
    """The PSP refunded `total` of the charge, nothing it would have refused; each refund of ours posted once."""
    at_psp = await psp_refunds_of(db, payment)
    assert [r["id"] for r in at_psp if r["over_refund"]] == [], "we asked the PSP for more than was left"
    assert sum(r["amount"] for r in at_psp) == total
    assert sorted(await refund_postings(db, payment["id"])) == sorted(f"refund:{r['id']}" for r in succeeded)
    assert await unbalanced_payments(db) == []


async def assert_stored_and_replayed(http, stack, db, acme, payment_id: str, answer: Answer) -> None:
    """A refusal decided after the claim is the key's result: finished, 409, replayed byte for byte on both APIs."""
    row = await key_row(db, acme.id, answer.key)
    assert row is not None and row["state"] == "finished" and row["response_code"] == 409, answer
    for api in stack.apis:
        replay = await refund(http, api.url, acme, payment_id, answer.body, answer.key)
        assert replay.status_code == 409 and replay.content == answer.content
        assert replay.headers["Idempotent-Replayed"] == "true"


# --- Refunds racing each other ----------------------------------------------------------------------


async def test_fifty_partial_refunds_at_once_on_two_apis_refund_no_more_than_the_charge(
    http, stack, db, database_url, acme
):
    payment = await paid(http, stack, acme, amount=10_000)
    await set_faults(http, stack.psp, PSP_GUARD_OFF)
    fits = 10_000 // 300  # 33: the 34th would need 10,200

    # At least one more than fits queued together on the payment's lock (the
    # two APIs' pools hold 40 connections; the rest follow as they free).
    answers = await to_the_end(http, acme, payment["id"], await gated(
        db, database_url, payment["id"], fits + 1, fire(http, stack, acme, payment["id"], partial(300, 50, "race"))))

    kinds = [a.kind for a in answers]
    assert kinds.count("succeeded") == fits and kinds.count(EXCEEDS) == 50 - fits, kinds
    # A refusal is decided only once 33 reservations were made: 100 is left then.
    assert {a.json["amount_refundable"] for a in answers if a.kind == EXCEEDS} == {10_000 - fits * 300}
    assert {a.api for a in answers if a.kind == "succeeded"} == {api.url for api in stack.apis}

    rows = await our_refunds(db, payment["id"])
    succeeded = [r for r in rows if r["status"] == "succeeded"]
    assert len(rows) == len(succeeded) == fits
    assert sorted(str(r["id"]) for r in succeeded) == sorted(a.json["id"] for a in answers if a.kind == "succeeded")
    assert (await payment_row(db, payment["id"]))["refunded_minor"] == fits * 300
    await assert_within_the_charge(db, payment, succeeded, total=fits * 300)
    for answer in answers:
        if answer.kind == EXCEEDS:
            await assert_stored_and_replayed(http, stack, db, acme, payment["id"], answer)


async def test_ten_full_refunds_at_once_on_two_apis_refund_the_charge_once(http, stack, db, database_url, acme):
    payment = await paid(http, stack, acme, amount=10_000)
    await set_faults(http, stack.psp, PSP_GUARD_OFF)

    race = fire(http, stack, acme, payment["id"], [{"reference": f"all-{i}"} for i in range(10)])
    answers = await to_the_end(http, acme, payment["id"], await gated(db, database_url, payment["id"], 10, race))

    [won] = [a for a in answers if a.kind == "succeeded"]
    assert won.json["amount"] == 10_000
    refused = [a for a in answers if a is not won]
    assert [a.kind for a in refused] == [EXCEEDS] * 9
    assert {a.json["amount_refundable"] for a in refused} == {0}
    [row] = await our_refunds(db, payment["id"])
    assert row["status"] == "succeeded" and row["amount_minor"] == 10_000 and str(row["id"]) == won.json["id"]
    assert (await payment_row(db, payment["id"]))["refunded_minor"] == 10_000
    await assert_within_the_charge(db, payment, [row], total=10_000)
    for answer in refused:
        await assert_stored_and_replayed(http, stack, db, acme, payment["id"], answer)


# --- Refunds racing a returned payout's compensation ----------------------------------------------------


RETURN_RECORDED = "SELECT return_id IS NOT NULL FROM payment WHERE id = $1"


async def test_refunds_racing_a_returned_payouts_compensation_refund_the_charge_exactly_once(
    http, stack, db, database_url, acme
):
    key, body, created = await paid_out_for(http, stack, acme, 10_000)
    payment_id = created["id"]
    await set_faults(http, stack.psp, PSP_GUARD_OFF)
    # Twenty refunds of 3,000 ask for six times the charge: three fit, and
    # the return's compensation takes what the client's refunds left. The
    # rail returns the payout as soon as the first of them is claimed, so the
    # return lands among them: some before it, some after.
    bodies = partial(3_000, 20, "rma")
    conn = await asyncpg.connect(database_url)
    try:
        async with Watch(conn, RETURN_RECORDED, uuid.UUID(payment_id)) as recorded:
            async def one_claimed() -> bool:
                return await db.fetchval("SELECT count(*) FROM refund WHERE payment_id = $1",
                                         uuid.UUID(payment_id)) > 0

            async def return_once_claimed() -> dict:
                await until(one_claimed, "a client refund to be claimed")
                return await return_payout(http, stack, created["end_to_end_reference"])

            answers, returned = await asyncio.gather(fire(http, stack, acme, payment_id, bodies), return_once_claimed())

            async def return_recorded() -> bool:
                return await db.fetchval(RETURN_RECORDED, uuid.UUID(payment_id))

            await until(return_recorded, "the rail's notification to be recorded")
            # And refunds that certainly come after it: nothing is refundable then.
            late = await fire(http, stack, acme, payment_id, partial(3_000, 4, "late"), first=20)
    finally:
        await conn.close()

    async def settled() -> bool:
        payment = await payment_row(db, payment_id)
        pending = await db.fetchval("SELECT count(*) FROM refund WHERE payment_id = $1 AND status = 'pending'",
                                    payment["id"])
        return payment["status"] == "refunded" and pending == 0

    await until(settled, "the compensation and every client refund to finish")
    payment = await payment_row(db, payment_id)
    rows = await our_refunds(db, payment_id)
    succeeded = [r for r in rows if r["status"] == "succeeded"]
    assert len(rows) == len(succeeded), "no client refund failed or is left pending"
    client_total = sum(r["amount_minor"] for r in succeeded)
    assert client_total <= 10_000 and len(succeeded) <= 10_000 // 3_000
    assert sorted(str(r["id"]) for r in succeeded) == sorted(a.json["id"] for a in answers if a.kind == "succeeded")

    assert payment["return_refund_minor"] == 10_000 - client_total > 0
    assert payment["refunded_minor"] == 10_000
    at_psp = await psp_refunds_of(db, {"id": payment_id})
    [compensation] = [r for r in at_psp if r["idempotency_key"] == payment["psp_refund_key"]]
    assert compensation["amount"] == payment["return_refund_minor"]
    await assert_within_the_charge(db, {"id": payment_id}, succeeded, total=10_000)
    assert await unbalanced_accounts(db, payment_id) == []
    comp_row = await key_row(db, acme.id, f"@return:{returned['return_id']}")
    assert comp_row["state"] == "finished"

    for answer in answers + late:
        assert answer.kind in ("succeeded", EXCEEDS, NOT_REFUNDABLE), answer
        if recorded.sent_after(answer):
            assert answer.kind == NOT_REFUNDABLE, f"refund {answer.n} was sent after the return was recorded"
        if answer.kind == NOT_REFUNDABLE:
            assert answer.json["payment_status"] in ("returned", "refunded")
            # Refused by the pre-check (nothing stored) or after the claim (stored).
            row = await key_row(db, acme.id, answer.key)
            if row is not None:
                await assert_stored_and_replayed(http, stack, db, acme, payment_id, answer)
        if answer.kind == EXCEEDS:
            await assert_stored_and_replayed(http, stack, db, acme, payment_id, answer)
    assert [a.kind for a in late] == [NOT_REFUNDABLE] * 4
    # The payment's own key row is untouched: its replay is the response first stored.
    replay = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert replay.headers["Idempotent-Replayed"] == "true" and replay.json()["status"] == "succeeded"


async def test_client_refunds_that_took_everything_before_the_return_leave_it_nothing_to_send(
    http, stack, db, database_url, acme
):
    _, _, created = await paid_out_for(http, stack, acme, 1_000)
    payment_id = created["id"]
    await set_faults(http, stack.psp, PSP_GUARD_OFF)
    # Eight refunds of 250 at once ask for twice the charge: four fit exactly.
    answers = await gated(db, database_url, payment_id, 8, fire(http, stack, acme, payment_id, partial(250, 8, "all")))
    kinds = [a.kind for a in answers]
    assert kinds.count("succeeded") == 4 and kinds.count(EXCEEDS) == 4, kinds
    assert (await payment_row(db, payment_id))["refunded_minor"] == 1_000

    returned = await return_payout(http, stack, created["end_to_end_reference"])

    async def refunded() -> bool:
        return (await payment_row(db, payment_id))["status"] == "refunded"

    await until(refunded, "the return to be recorded")
    payment = await payment_row(db, payment_id)
    assert payment["return_refund_minor"] == 0 and payment["refunded_minor"] == 1_000
    assert payment["return_id"] == returned["return_id"]
    assert await key_row(db, acme.id, f"@return:{returned['return_id']}") is None, "no compensation to drive"
    succeeded = [r for r in await our_refunds(db, payment_id) if r["status"] == "succeeded"]
    at_psp = await psp_refunds_of(db, {"id": payment_id})
    assert len(at_psp) == len(succeeded) == 4, "the return sent the PSP nothing more"
    assert payment["psp_refund_key"] not in {r["idempotency_key"] for r in at_psp}
    await assert_within_the_charge(db, {"id": payment_id}, succeeded, total=1_000)
    assert await unbalanced_accounts(db, payment_id) == []
    for answer in answers:
        if answer.kind == EXCEEDS:
            await assert_stored_and_replayed(http, stack, db, acme, payment_id, answer)
    [after] = await fire(http, stack, acme, payment_id, partial(250, 1, "after"))
    assert after.kind == NOT_REFUNDABLE and after.json["payment_status"] == "refunded"
    assert await key_row(db, acme.id, after.key) is None


async def paid_out_for(http, stack, acme, amount: int) -> tuple[str, dict, dict]:
    key, body = str(uuid.uuid4()), payment_body(amount=amount)
    response = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert response.status_code == 201 and response.json()["status"] == "succeeded", response.text
    return key, body, response.json()


# --- Refunds racing their own payment's recovery ---------------------------------------------------------


SUCCEEDED = "SELECT status = 'succeeded' FROM payment WHERE id = $1"


async def test_refunds_racing_their_payments_recovery_are_refused_until_it_succeeded(
    http, stack, db, database_url, acme, processes
):
    key, body = str(uuid.uuid4()), payment_body(amount=1_000)
    # The rail answers 500 before doing anything: the payout's outcome is
    # unknown, the payment stays processing, the worker is to finish it.
    await set_faults(http, stack.rail, {"action": "error_before", "status": 500, "reference": body["reference"]})
    await set_faults(http, stack.psp, PSP_GUARD_OFF)
    pending = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert pending.status_code == 202 and pending.json()["status"] == "processing", pending.text
    payment_id = pending.json()["id"]

    # No worker yet: nothing can finish the payment, so every refund is refused, and nothing stored.
    waiting = await fire(http, stack, acme, payment_id, partial(300, 6, "early"))
    assert [(a.kind, a.json["payment_status"]) for a in waiting] == [(NOT_REFUNDABLE, "processing")] * 6

    # The worker's payout is held a second at the rail, so that refunds meet
    # the payment while its recovery is under way.
    await set_faults(http, stack.rail, {"action": "delay", "seconds": 1.0, "reference": body["reference"]})
    processes.worker(**FAST_WORKER)

    async def payout_resent() -> bool:
        sent = await requests_at(db, "rail", reference=body["reference"])
        return sent.count(("POST", "/v1/transfers")) == 2

    await until(payout_resent, "the worker to send the payout again")
    conn = await asyncpg.connect(database_url)
    racing: list[Answer] = []
    try:
        async with Watch(conn, SUCCEEDED, uuid.UUID(payment_id)) as succeeded_watch:
            while succeeded_watch.held_from is None:
                racing += await fire(http, stack, acme, payment_id, partial(300, 4, "race", len(racing)),
                                     first=len(racing))
            # Then more than fits, fired at once, certainly after the payment succeeded.
            after = await gated(db, database_url, payment_id, 8,
                                fire(http, stack, acme, payment_id, partial(300, 8, "after"), first=len(racing)))
    finally:
        await conn.close()

    assert (await key_row(db, acme.id, key))["state"] == "finished"
    for answer in waiting + racing + after:
        assert answer.kind in ("succeeded", EXCEEDS, NOT_REFUNDABLE), answer
        if answer in waiting or succeeded_watch.answered_before(answer):
            assert answer.kind == NOT_REFUNDABLE, f"refund {answer.n} answered before the payment succeeded"
        if succeeded_watch.sent_after(answer):
            assert answer.kind in ("succeeded", EXCEEDS), f"refund {answer.n} sent after the payment succeeded"
        if answer.kind == NOT_REFUNDABLE:
            assert answer.json["payment_status"] == "processing"
            assert await key_row(db, acme.id, answer.key) is None, "a refusal before the claim stores nothing"
        if answer.kind == EXCEEDS:
            await assert_stored_and_replayed(http, stack, db, acme, payment_id, answer)
    assert any(succeeded_watch.answered_before(a) for a in racing), "no refund met the recovery under way"

    kinds = [a.kind for a in racing + after]
    fits = 1_000 // 300
    assert kinds.count("succeeded") == fits, kinds
    rows = await our_refunds(db, payment_id)
    succeeded = [r for r in rows if r["status"] == "succeeded"]
    assert len(rows) == len(succeeded) == fits
    assert (await payment_row(db, payment_id))["refunded_minor"] == fits * 300
    await assert_within_the_charge(db, {"id": payment_id}, succeeded, total=fits * 300)
