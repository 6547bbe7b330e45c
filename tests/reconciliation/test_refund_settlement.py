"""A slow PSP: a client's refund polled a bounded number of times, parked, then settled from the PSP's report.

Real processes: the API, the fake PSP (whose `pending` fault holds a refund
unsettled for an hour), `payments worker` polling it, and `payments
settle-refunds` reading the PSP's daily settlement report. The worker is
stopped once it has parked the refund, so whatever settles it afterwards is
the report and nothing else (the worker's re-probe would also heal it:
that is app/machine/engine.py::heal, tested for payments elsewhere).
"""

from __future__ import annotations

import asyncio
import signal
import uuid

import pytest

from devtools.processes import BIN
from tests.crash.test_crash_matrix import set_faults
from tests.integration.test_refunds import paid
from tests.support import event_types, headers, key_row, ledger, refunds, requests_at, unbalanced_payments, until

pytestmark = pytest.mark.usefixtures("stack")

AMOUNT = 2500
ATTEMPTS = 3  # the API's send, then two polls by the worker
# The worker polls quickly and parks after ATTEMPTS. Its re-probe of the
# parked refund and its next reading of the report are an hour away (it
# reads the report once as it starts, when nothing is parked yet).
POLLING_WORKER = {
    "MAX_ATTEMPTS": str(ATTEMPTS), "BACKOFF_BASE_SECONDS": "0.05", "PARKED_RECHECK_SECONDS": "3600",
    "RECONCILE_EVERY_SECONDS": "3600", "WORKER_MIN_AGE_SECONDS": "0", "WORKER_POLL_SECONDS": "0.1",
}


def counts(output: str) -> str:
    """The command's answer: its last line (the log lines before it go to stderr, merged here)."""
    return output.strip().splitlines()[-1]


def refund_url(api: str, payment: dict) -> str:
    return f"{api}/v1/payments/{payment['id']}/refunds"


async def parked_refund(http, stack, db, acme, processes, settles_as: str = "succeeded"):
    """A refund the PSP holds pending, polled by the worker until it parked it; the worker stopped."""
    payment = await paid(http, stack, acme)
    key, body = str(uuid.uuid4()), {"amount": AMOUNT, "reference": f"rma-{uuid.uuid4()}"}
    await set_faults(http, stack.psp,
                     {"action": "pending", "operation": "refund", "seconds": 3600, "settles_as": settles_as})
    first = await http.post(refund_url(stack.api, payment), json=body, headers=headers(acme, key))
    assert first.status_code == 202 and first.json()["status"] == "pending", first.text

    worker = processes.worker(**POLLING_WORKER)

    async def parked() -> bool:
        return (await key_row(db, acme.id, key))["parked_at"] is not None

    await until(parked, "the worker to park the refund after its last poll")
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(10) == 0
    return payment, key, body


async def state(db, acme, payment, key) -> dict:
    """Everything a settlement may change, to compare before and after."""
    pid = uuid.UUID(payment["id"])
    return {
        "refunds": [dict(r) for r in await db.fetch("SELECT * FROM refund WHERE payment_id = $1", pid)],
        "refunded_minor": await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid),
        "ledger": await ledger(db, pid),
        "events": await event_types(db, pid),
        "key_row": dict(await key_row(db, acme.id, key)),
    }


async def settle_at_psp(http, stack, db, body, status: str) -> None:
    """The PSP decides the refund now (its admin endpoint): it is on today's settlement report."""
    [at_psp] = await refunds(db, body["reference"])
    settled = await http.post(f"{stack.psp.url}/_admin/refunds/{at_psp['id']}/settle", json={"status": status})
    assert settled.status_code == 200 and settled.json()["status"] == status, settled.text


async def test_a_pending_refund_is_polled_by_probes_only_and_parked_after_the_last_attempt(
    http, stack, db, acme, processes
):
    payment, key, body = await parked_refund(http, stack, db, acme, processes)

    row = await key_row(db, acme.id, key)
    assert row["state"] == "started" and row["recovery_point"] == "EXT5_SENT" and row["attempts"] == ATTEMPTS
    [refund] = (await state(db, acme, payment, key))["refunds"]
    assert refund["status"] == "pending"
    assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", uuid.UUID(payment["id"])) == AMOUNT
    assert await event_types(db, uuid.UUID(payment["id"])) == ["payment.succeeded", "refund.pending"]
    polls = [("POST", "/v1/refunds")] + [("GET", "/v1/refunds")] * (ATTEMPTS - 1)
    assert await requests_at(db, "psp", idempotency_key=refund["psp_refund_key"]) == polls, "sent once, then probed"

    # A client retry while parked hears `pending` and asks the PSP nothing.
    retry = await http.post(refund_url(stack.api, payment), json=body, headers=headers(acme, key))
    assert retry.status_code == 202 and retry.json()["status"] == "pending", retry.text
    assert await requests_at(db, "psp", idempotency_key=refund["psp_refund_key"]) == polls


@pytest.mark.parametrize("status", ["succeeded", "failed"])
async def test_a_parked_refund_the_psp_settled_is_settled_once_from_its_report(
    status, http, stack, db, acme, processes
):
    payment, key, body = await parked_refund(http, stack, db, acme, processes, settles_as=status)
    pid = uuid.UUID(payment["id"])
    k5 = await db.fetchval("SELECT psp_refund_key FROM refund WHERE payment_id = $1", pid)
    asked = await requests_at(db, "psp", idempotency_key=k5)
    await settle_at_psp(http, stack, db, body, status)

    code, output = await processes.cli("settle-refunds")

    assert code == 0, output
    assert counts(output) == f"refund settlement: parked=1, settled_{status}=1"
    [refund] = (await state(db, acme, payment, key))["refunds"]
    [at_psp] = await refunds(db, body["reference"])
    assert refund["status"] == status and refund["psp_refund_id"] == at_psp["id"]
    posting = f"refund:{refund['id']}"
    if status == "succeeded":
        assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == AMOUNT
        assert [e for e in await ledger(db, pid) if e[0].startswith("refund:")] == [
            (posting, "client_receivable", AMOUNT, 0), (posting, "psp_receivable", 0, AMOUNT),
        ]
    else:
        assert await db.fetchval("SELECT refunded_minor FROM payment WHERE id = $1", pid) == 0, "given back"
        assert [e for e in await ledger(db, pid) if e[0].startswith("refund:")] == []
    assert await unbalanced_payments(db) == []
    assert await event_types(db, pid) == ["payment.succeeded", "refund.pending", f"refund.{status}"]
    row = await key_row(db, acme.id, key)
    assert row["state"] == "finished" and row["response_code"] == 201 and row["parked_at"] is None
    assert await requests_at(db, "psp", idempotency_key=k5) == asked, "settled from the report: no probe, no send"
    replay = await http.post(refund_url(stack.api, payment), json=body, headers=headers(acme, key))
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert replay.text == row["response_body"] and replay.json()["status"] == status

    # The same report read again settles nothing more: the refund is no longer parked.
    settled = await state(db, acme, payment, key)
    code, output = await processes.cli("settle-refunds")
    assert code == 0 and counts(output) == "refund settlement: parked=0", output
    assert await state(db, acme, payment, key) == settled


async def test_a_parked_refund_still_pending_at_the_psp_stays_parked(http, stack, db, acme, processes):
    payment, key, body = await parked_refund(http, stack, db, acme, processes)
    before = await state(db, acme, payment, key)

    code, output = await processes.cli("settle-refunds")

    assert code == 0 and counts(output) == "refund settlement: parked=1, still_pending=1", output
    assert await state(db, acme, payment, key) == before, "absent from the report is not failed: nothing written"


async def cli_streams(processes, *args: str, **env: str) -> tuple[int, str, str]:
    """Run `payments <args>` to completion: its exit code, stdout and stderr apart."""
    process = await asyncio.create_subprocess_exec(
        str(BIN / "payments"), *args, env=processes.system.service_env(**env),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await process.communicate()
    return process.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("psp", ["stopped", "without a report"])
async def test_a_settlement_report_that_is_unavailable_exits_1_with_one_line_and_changes_nothing(
    psp, http, stack, db, acme, processes
):
    payment, key, body = await parked_refund(http, stack, db, acme, processes)
    await settle_at_psp(http, stack, db, body, "succeeded")  # the report would settle it, could it be read
    before = await state(db, acme, payment, key)
    if psp == "stopped":
        gone = processes.fake("psp")
        gone.stop()
        url = gone.url  # nothing listens there
    else:
        url = stack.rail.url  # a server that answers, 404, for a report it does not have

    code, out, err = await cli_streams(processes, "settle-refunds", PSP_URL=url)

    # One line on stderr, as every error of the CLI, whatever the reason's length.
    assert code == 1 and out == "", (code, out, err)
    [line] = err.splitlines()
    assert line.startswith("the PSP's settlement report is unavailable (psp: ") and line.endswith("try again"), line
    assert await state(db, acme, payment, key) == before

    # Once the report can be read, the same run settles it.
    code, output = await processes.cli("settle-refunds")
    assert code == 0 and counts(output) == "refund settlement: parked=1, settled_succeeded=1", output
