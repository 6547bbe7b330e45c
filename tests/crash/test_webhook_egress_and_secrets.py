"""The egress policy and the signing secrets on real processes: `payments worker`, the CLI, the fake merchant.

A worker under the strict policy reaches no loopback merchant (and records
one phrase for it); registration refuses what the policy refuses; secrets
are sealed at rest, opened only with WEBHOOK_SECRETS_KEY, resealed when the
key rotates; a rotated secret is still sent (a second signature) until its
overlap window ends, then dropped; the worker refuses to start without the
key, and the service refuses a weak notification secret.
"""

from __future__ import annotations

import re

import pytest

from app.outbox import egress
from app.outbox.sealing import SecretsKey, new_key
from tests.conftest import SECRETS_KEY
from tests.crash.test_webhook_delivery import FAST, assert_applied_once, attempts, in_state, pay, received
from tests.support import until

pytestmark = pytest.mark.usefixtures("stack")

STRICT = {"WEBHOOK_ALLOW_HTTP": "false", "WEBHOOK_ALLOWED_NETWORKS": ""}


async def test_a_worker_under_the_strict_policy_reaches_no_loopback_merchant(http, stack, db, shop, merchant,
                                                                              processes):
    payment, event_id = await pay(http, stack, shop, db)
    # http allowed, loopback not: the address alone is refused.
    processes.worker(**FAST, WEBHOOK_ALLOW_HTTP="true", WEBHOOK_ALLOWED_NETWORKS="")

    async def refused_twice() -> bool:
        return len([a for a in await attempts(db, event_id) if a["outcome"]]) >= 2

    await until(refused_twice, "two attempts recorded")
    tried = [a for a in await attempts(db, event_id) if a["outcome"]]
    assert {(a["status_code"], a["error_class"], a["error"]) for a in tried} == {
        (None, "refused_address", egress.REFUSED)}
    assert await received(db, event_id) == [], "the merchant on loopback was never reached"


async def test_a_worker_under_the_strict_policy_sends_nothing_over_http(http, stack, db, shop, merchant, processes):
    payment, event_id = await pay(http, stack, shop, db)
    processes.worker(**FAST, WEBHOOK_ALLOW_HTTP="false")  # loopback allowed, http not

    async def refused() -> bool:
        return any(a["outcome"] for a in await attempts(db, event_id))

    await until(refused, "an attempt recorded")
    tried = [a for a in await attempts(db, event_id) if a["outcome"]]
    assert {(a["error_class"], a["error"]) for a in tried} == {("refused_scheme", egress.NOT_HTTPS)}
    assert await received(db, event_id) == []


@pytest.mark.parametrize("url, says", [
    ("http://127.0.0.1:8103/webhooks", "https://"),
    ("https://127.0.0.1:8103/webhooks", "not a public address"),
    ("https://0x7f000001/webhooks", "not a public address"),
    ("https://169.254.169.254/latest/meta-data", "not a public address"),
    ("https://[::ffff:127.0.0.1]/webhooks", "not a public address"),
    ("https://user:pw@merchant.example/webhooks", "user:password"),
])
async def test_registration_refuses_what_the_policy_refuses(processes, db, url, says):
    code, output = await processes.cli("clients", "create", "egress-shop", "--webhook-url", url, **STRICT)
    assert code == 2 and says in output and "Traceback" not in output
    assert "pw@" not in output, "a password in a refused URL is not repeated"
    assert await db.fetchval("SELECT count(*) FROM client WHERE name = 'egress-shop'") == 0


def printed_secret(output: str) -> str:
    [secret] = re.findall(r"webhook signing secret: (whsec_\S+)", output)
    return secret


async def test_a_secret_is_sealed_at_rest_and_only_the_key_opens_it(processes, db, merchant, clean):
    code, output = await processes.cli("clients", "create", "sealed-shop", "--webhook-url", merchant.url + "/webhooks")
    assert code == 0, output
    secret = printed_secret(output)
    row = await db.fetchrow("SELECT w.* FROM webhook_endpoint w JOIN client c ON c.id = w.client_id "
                            "WHERE c.name = 'sealed-shop'")
    assert "secret" not in row.keys(), "no column holds it in the clear"
    assert secret not in row["secret_sealed"] and secret[6:] not in row["secret_sealed"]
    assert SecretsKey(SECRETS_KEY).open(row["secret_sealed"]) == secret
    assert SecretsKey(new_key()).open(row["secret_sealed"]) is None

    # The key rotates: the new one first, the old one after it, then a reseal; then the old one can go.
    rotated = new_key()
    code, output = await processes.cli("clients", "reseal-webhook-secrets",
                                       WEBHOOK_SECRETS_KEY=f"{rotated},{SECRETS_KEY}")
    assert code == 0 and "resealed" in output, output
    resealed = await db.fetchval("SELECT secret_sealed FROM webhook_endpoint WHERE client_id = $1", row["client_id"])
    assert SecretsKey(rotated).open(resealed) == secret and SecretsKey(SECRETS_KEY).open(resealed) is None
    # Resealing with a key that opens none of them changes nothing and says so.
    code, output = await processes.cli("clients", "reseal-webhook-secrets", WEBHOOK_SECRETS_KEY=new_key())
    assert code == 2 and "none of the keys" in output
    assert await db.fetchval("SELECT secret_sealed FROM webhook_endpoint WHERE client_id = $1",
                             row["client_id"]) == resealed


async def test_a_secret_the_key_cannot_open_is_recorded_as_such_and_nothing_sent(http, stack, db, shop, merchant,
                                                                                  processes):
    payment, event_id = await pay(http, stack, shop, db)
    processes.worker(**FAST, WEBHOOK_SECRETS_KEY=new_key())  # not the key the shop's secret was sealed with

    async def recorded() -> bool:
        return any(a["outcome"] for a in await attempts(db, event_id))

    await until(recorded, "an attempt recorded")
    assert {a["error_class"] for a in await attempts(db, event_id) if a["outcome"]} == {"sealed_secret"}
    assert await received(db, event_id) == []


async def test_a_rotated_secret_is_sent_beside_the_new_one_until_its_window_ends(http, stack, db, shop, merchant,
                                                                                  processes):
    code, output = await processes.cli("clients", "set-webhook", "shop", shop.webhook_url, "--rotate-secret",
                                       "--overlap-hours", "1")
    assert code == 0 and "1 h (both signatures)" in output, output
    new = printed_secret(output)
    assert new != shop.secret
    until_ = await db.fetchval("SELECT previous_secret_until - now() FROM webhook_endpoint WHERE client_id = $1",
                               shop.id)
    assert 3500 < until_.total_seconds() <= 3600

    # The merchant still verifies with the old secret only: within the window, it accepts.
    payment, event_id = await pay(http, stack, shop, db)
    processes.worker(**FAST)
    await in_state(db, event_id, "delivered")
    await assert_applied_once(db, payment, event_id)

    # The window ends: the old secret is no longer sent, so the old verifier refuses...
    await db.execute("UPDATE webhook_endpoint SET previous_secret_until = now() - interval '1 second' "
                     "WHERE client_id = $1", shop.id)
    later, later_event = await pay(http, stack, shop, db)

    async def refused() -> bool:
        return any(a["status_code"] == 401 for a in await attempts(db, later_event))

    await until(refused, "an attempt refused with 401 (signed with the new secret only)")
    # ...and the new one, once the merchant has it, accepts.
    (await http.post(merchant.url + "/_admin/secrets", json={"secret": new})).raise_for_status()
    await in_state(db, later_event, "delivered")
    await assert_applied_once(db, later, later_event)
    # The next change of the endpoint clears the expired secret's sealed copy.
    code, output = await processes.cli("clients", "set-webhook", "shop", shop.webhook_url)
    assert code == 0 and "unchanged" in output
    row = await db.fetchrow("SELECT * FROM webhook_endpoint WHERE client_id = $1", shop.id)
    assert row["previous_secret_sealed"] is None and row["previous_secret_until"] is None


async def test_the_worker_refuses_to_start_without_the_key_and_the_service_a_weak_notification_secret(processes):
    code, output = await processes.cli("worker", WEBHOOK_SECRETS_KEY="")
    assert code == 2 and "WEBHOOK_SECRETS_KEY is not set" in output and "Traceback" not in output
    assert len(output.strip().splitlines()) == 1, output
    code, output = await processes.cli("worker", RAIL_NOTIFICATION_SECRET="whsec_AAAA")
    assert code == 2 and "RAIL_NOTIFICATION_SECRET: its key is 3 bytes, at least 24" in output, output
    assert len(output.strip().splitlines()) == 1, output
