"""No card token, IBAN, beneficiary name or raw key in any log line; every payment's lines say which payment.

Payments with a distinctive card token, IBANs and name go through every
path that logs: success, a decline, a rejected payout refunded, a rail
error released and finished by the worker, a charge that parks and heals
on a re-probe, a crash taken over by the worker, a 409, a 422 and a 400.
Every process runs at LOG_LEVEL=DEBUG, so every line the service can write
on those paths is written. Then every log file they wrote is read: none may
hold the secrets, every line is one JSON object, and the lines are about the
payments they name (client, payment, key hash, recovery point, attempt,
lease token), which also proves the lines were written at all.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import pytest

from app.observability.logs import key_hash
from tests.support import claimed, headers, key_row, payment_body, until

SECRET = uuid.uuid4().hex[:10]
CARD_TOKEN = f"tok_secret_{SECRET}"
NAME = f"Zebedee Secretname {SECRET}"
# Valid IBANs nobody else's test uses; the print form too, as a client may send it.
IBANS = ["GB33BUKB20201555555555", "NL91ABNA0417164300", "FR1420041010050500013M02606"]
PRINT_FORMS = ["GB33 BUKB 2020 1555 5555 55", "NL91 ABNA 0417 1643 00", "FR14 2004 1010 0505 0001 3M02 606"]
DEBUG = {"LOG_LEVEL": "DEBUG", "LOG_FORMAT": "json"}
PAYMENT_FIELDS = {"client_id", "key_hash", "payment_id", "recovery_point", "attempt", "lease_token"}


def secret_body(n: int) -> dict:
    return payment_body(card_token=CARD_TOKEN, beneficiary={"name": NAME, "iban": PRINT_FORMS[n % len(IBANS)]})


async def set_faults(http, service, *faults) -> None:
    (await http.put(service.url + "/_admin/faults", json={"faults": list(faults)})).raise_for_status()


async def test_no_log_line_holds_a_card_token_iban_name_or_key_and_each_names_its_payment(
    http, stack, db, acme, processes, tmp_path
):
    api = processes.api("api", MAX_ATTEMPTS="2", **DEBUG)
    sent: dict[str, dict] = {}

    async def pay(body: dict, key: str | None = None, url: str = api.url) -> httpx.Response:
        key = key or f"secret-key-{uuid.uuid4().hex}"
        sent[key] = body
        return await http.post(url + "/v1/payments", json=body, headers=headers(acme, key))

    bodies = [secret_body(n) for n in range(7)]
    declined, rejected, rail_error, parks, crashed, slow = bodies[1:]
    await set_faults(http, stack.psp,
                     {"action": "decline", "reference": declined["reference"]},
                     # Two unknown charges: released, then parked on the worker's attempt.
                     {"action": "error_before", "reference": parks["reference"], "status": 502, "times": 2},
                     {"action": "delay", "reference": slow["reference"], "seconds": 1.5})
    await set_faults(http, stack.rail,
                     {"action": "reject", "reference": rejected["reference"]},
                     {"action": "error_before", "reference": rail_error["reference"], "status": 502})

    assert (await pay(bodies[0])).json()["status"] == "succeeded"
    assert (await pay(declined)).json()["status"] == "declined"
    assert (await pay(rejected)).json()["status"] == "failed"
    assert (await pay(rail_error)).status_code == 202
    assert (await pay(parks)).status_code == 202
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT="after-call-EXT2", LEASE_SECONDS="1", **DEBUG)
    with pytest.raises(httpx.HTTPError):
        await pay(crashed, url=doomed.url)
    # A 409 and a 422 on a payment in flight, and a 400 that carries the secrets in its body.
    slow_key = f"secret-key-{uuid.uuid4().hex}"
    first = asyncio.create_task(pay(slow, slow_key))
    await claimed(db, acme.id, slow_key)
    assert (await pay(slow, slow_key)).status_code == 409
    assert (await pay(slow | {"amount": 9999}, slow_key)).status_code == 422
    assert (await first).status_code == 201
    assert (await pay(secret_body(0) | {"amount": -1})).status_code == 400

    # The worker finishes the released, the parked (once a re-probe answers) and the crashed ones.
    processes.worker("worker", WORKER_MIN_AGE_SECONDS="0", WORKER_POLL_SECONDS="0.1", BACKOFF_BASE_SECONDS="0.1",
                     PARKED_RECHECK_SECONDS="1", MAX_ATTEMPTS="2", LEASE_SECONDS="1", **DEBUG)

    async def all_finished() -> bool:
        rows = [await key_row(db, acme.id, key) for key in sent]
        return all(r is None or r["state"] == "finished" for r in rows)

    await until(all_finished, "every payment to finish", timeout=60)
    parked_row = await key_row(db, acme.id, next(k for k, b in sent.items() if b is parks))
    timeline = parked_row["timeline"]
    timeline = json.loads(timeline) if isinstance(timeline, str) else timeline
    assert any(e["event"] == "parked" for e in timeline), "the park path was not taken"
    rows = {k: r for k in sent if (r := await key_row(db, acme.id, k)) is not None}  # not the 400's
    processes.stop_all()

    files = sorted(tmp_path.rglob("*.log"))
    assert len(files) >= 3, files  # the API, the crashed API, the worker
    text = "\n".join(f.read_text(errors="replace") for f in files)
    secrets = [CARD_TOKEN, NAME, SECRET, *IBANS, *PRINT_FORMS]
    leaked = [s for s in secrets if s in text] + [k for k in sent if k in text]
    assert leaked == [], f"logged: {leaked}"

    lines = []
    for line in text.splitlines():
        if not line.strip() or line.startswith("PAYMENTS_CRASH_AT="):  # the crash point's own farewell
            continue
        lines.append(json.loads(line))  # one JSON object per line, or this raises
    # Every payment and every key (by its hash) is named by the lines about it...
    assert {str(r["payment_id"]) for r in rows.values()} <= {line.get("payment_id") for line in lines}
    assert {key_hash(k) for k in rows} <= {line.get("key_hash") for line in lines}
    # ... and the runner's lines, on every path, carry all of the payment's fields.
    runner = [line for line in lines if line["logger"] == "app.machine.engine"]
    messages = {line["message"] for line in runner}
    for expected in ("payment finished: succeeded", "payment finished: declined", "payment finished: failed",
                     "released", "taken over at EXT2_SENT", "parked as indeterminate", "re-probe"):
        assert any(m.startswith(expected) for m in messages), (expected, messages)
    for line in runner:
        assert PAYMENT_FIELDS <= line.keys(), line
