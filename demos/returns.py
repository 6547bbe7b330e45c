"""`python -m demos.returns` (`make demo-return`): a payout returned days later, through our inbox.

    1. A client with a webhook endpoint at the fake merchant pays once: the
       card is charged, the net amount paid out over the rail, `succeeded`.
    2. Days later (the rail's calendar is moved on by closing days), the
       beneficiary's bank sends the payout back: `POST /_admin/return` with
       reason AC04, account closed. The rail books a return line and notifies
       us, signed; under its fault plan (`duplicate`) it delivers the
       notification twice.
    3. Our inbox: the first delivery is recorded with its whole effect in one
       transaction (the payment `returned`, the ledger's `payout_returned`,
       the `payment.returned` event, the compensation's own operation); the
       second finds the inbox key and is acknowledged and dropped.
    4. The compensation, driven by the same runner as every payment step:
       the card refunded in full with a new derived key (K4), the payment
       `refunded`, its ledger back to zero on every account.
    5. The merchant hears it all by webhook (`payment.returned`, then
       `payment.refunded`), applied once each by its own inbox.
    6. A POST replay of the original payment still answers the response
       first stored (`succeeded`); GET shows the payment as it is now.

Everything runs as real processes (see demos.system). Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from datetime import UTC, datetime, timedelta

import typer
from rich.table import Table

from app.outbox.endpoints import new_secret
from demos.story import step, terminal
from demos.system import CheckedDemo, System, payment_body, run_demo, wait_for

console = terminal()
DAYS_LATER = 3


class Demo(CheckedDemo):
    def rail_notifications(self) -> list[dict]:
        return self.http.get(self.system.rail.url + "/_admin/notifications").json()["items"]

    def deliveries(self) -> Table:
        table = Table(title="the rail's: /_admin/notifications (each delivery attempt)", title_justify="left")
        for column in ("message", "attempt", "outcome", "HTTP status"):
            table.add_column(column)
        for n in self.rail_notifications():
            for d in n["deliveries"]:
                table.add_row(n["id"], f"#{d['attempt']}", d["outcome"], str(d["status_code"] or "-"))
        return table

    def inbox(self) -> Table:
        table = Table(title="ours: rail_message (the inbox)", title_justify="left")
        for column in ("inbox key", "source", "message id", "outcome", "duplicates dropped"):
            table.add_column(column)
        for m in self.db.fetch("SELECT * FROM rail_message ORDER BY received_at"):
            table.add_row(m["inbox_key"], m["source"], m["message_id"] or "-", m["outcome"], str(m["duplicates"]))
        return table

    def ledger(self, payment_id: uuid.UUID) -> Table:
        table = Table(title="ours: ledger_entry", title_justify="left")
        for column in ("posting", "account", "debit", "credit"):
            table.add_column(column)
        for e in self.db.fetch(
            "SELECT posting, account, debit_minor, credit_minor FROM ledger_entry WHERE payment_id = $1 ORDER BY id",
            payment_id,
        ):
            table.add_row(e["posting"], e["account"], str(e["debit_minor"] or ""), str(e["credit_minor"] or ""))
        return table

    def run(self) -> None:
        system, db = self.system, self.db
        secret = new_secret()
        merchant = system.start_merchant(secrets=[secret])
        db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                   system.client_id, merchant.url + "/webhooks", system.seal(secret))
        api = system.api()
        system.worker()  # dispatches the webhooks; would finish a compensation whose owner died
        rail = system.rail.url
        self.http.put(rail + "/_admin/notify", json={
            "url": api.url + "/v1/rail/notifications", "secret": system.settings["RAIL_NOTIFICATION_SECRET"],
        }).raise_for_status()

        step(console, 1, "a payment, paid out")
        body = payment_body()
        key = str(uuid.uuid4())
        auth = {"Authorization": f"Bearer {system.api_key}"}
        first = self.http.post(api.url + "/v1/payments", json=body, headers={**auth, "Idempotency-Key": key})
        payment = first.json()
        payment_id = uuid.UUID(payment["id"])
        console.print(f"POST /v1/payments -> {first.status_code}, status [bold]{payment['status']}[/], "
                      f"{payment['net_amount']} paid out as {payment['end_to_end_reference']}")
        self.checks.check("the payout went out", "succeeded", payment["status"])

        step(console, 2, f"{DAYS_LATER} days later, the beneficiary's bank returns it (AC04, account closed)")
        today = datetime.now(UTC).date()
        self.http.post(rail + "/_admin/close-day",
                       json={"date": str(today + timedelta(days=DAYS_LATER - 1))}).raise_for_status()
        self.http.put(rail + "/_admin/faults", json={"faults": [
            {"action": "duplicate", "operation": "notification", "times": 1}]}).raise_for_status()
        returned = self.http.post(rail + "/_admin/return", json={
            "end_to_end_reference": payment["end_to_end_reference"], "reason_code": "AC04"}).json()
        console.print(f"the rail: return {returned['return_id']}, booked on {returned['booking_date']} "
                      f"(days up to then closed), notification {returned['notification_id']}, "
                      "to be delivered twice (fault plan: duplicate)")
        self.checks.check("the return is booked days later", str(today + timedelta(days=DAYS_LATER)),
                          returned["booking_date"])

        step(console, 3, "our inbox: the first delivery recorded with its effect, the second dropped")
        wait_for("two deliveries", lambda: [d["outcome"] for n in self.rail_notifications()
                                            for d in n["deliveries"]] == ["delivered", "delivered"])
        console.print(self.deliveries())
        console.print(self.inbox())
        [message] = db.fetch("SELECT * FROM rail_message")
        self.checks.check("deliveries the rail made (both answered 200)", 2,
                          sum(len(n["deliveries"]) for n in self.rail_notifications()))
        self.checks.check("inbox rows", 1, len(db.fetch("SELECT 1 FROM rail_message")))
        self.checks.check("duplicates dropped", 1, message["duplicates"])

        step(console, 4, "the compensation: the card refunded in full (K4), the payment refunded")
        wait_for("the payment to be refunded", lambda: db.fetchval(
            "SELECT status FROM payment WHERE id = $1", payment_id) == "refunded")
        console.print(self.ledger(payment_id))
        refunds = self.http.get(system.psp.url + "/_admin/refunds", params={"reference": body["reference"]})
        refunds.raise_for_status()
        items = refunds.json()["items"]
        comp = db.fetchrow("SELECT * FROM idempotency_key WHERE client_id = $1 AND key = $2",
                           system.client_id, f"@return:{returned['return_id']}")
        console.print(f"the compensation's own operation {comp['key']!r}: {comp['state']}, timeline: "
                      + " -> ".join(e["event"] for e in json.loads(comp["timeline"])))
        self.checks.check("refunds at the PSP", 1, len(items))
        self.checks.check("refunded amount", body["amount"], items[0]["amount"] if items else None)
        balance = db.fetch(
            "SELECT account, sum(debit_minor) - sum(credit_minor) AS net FROM ledger_entry "
            "WHERE payment_id = $1 GROUP BY account HAVING sum(debit_minor) <> sum(credit_minor)", payment_id)
        self.checks.check("accounts of this payment not back to zero", 0, len(balance))

        step(console, 5, "the merchant's webhooks: returned, then refunded, applied once each")
        merchant_url = merchant.url
        wait_for("the merchant to hear of the refund", lambda: any(
            p["status"] == "refunded" for p in self.http.get(merchant_url + "/_admin/payments").json()["items"]))
        [theirs] = self.http.get(merchant_url + "/_admin/payments").json()["items"]
        types = [e["type"] for e in db.fetch("SELECT type FROM event WHERE payment_id = $1 ORDER BY id", payment_id)]
        console.print(f"our events: {', '.join(types)}; the merchant: status {theirs['status']}, "
                      f"{theirs['events_applied']} events applied")
        self.checks.check("our events", "payment.succeeded, payment.returned, payment.refunded", ", ".join(types))
        self.checks.check("the merchant's view of the payment", "refunded", theirs["status"])

        step(console, 6, "a POST replay still answers the original response; GET answers the present")
        replay = self.http.post(api.url + "/v1/payments", json=body, headers={**auth, "Idempotency-Key": key})
        now = self.http.get(f"{api.url}/v1/payments/{payment_id}", headers=auth).json()
        console.print(f"POST replay -> {replay.status_code}, Idempotent-Replayed: "
                      f"{replay.headers.get('Idempotent-Replayed')}, status {replay.json()['status']}")
        console.print(f"GET -> status {now['status']}, failure {now['failure']}")
        self.checks.check("the replay is the stored response, byte for byte", True, replay.text == first.text)
        self.checks.check("GET now", "refunded (AC04)", f"{now['status']} ({now['failure']['code']})")
        console.print(self.checks.table("checks"))


def main() -> None:
    """A payout returned days later: the duplicate notification dropped, the compensation, the merchant's webhook."""
    system = System()
    system.settings["RAIL_NOTIFICATION_SECRET"] = "whsec_" + base64.b64encode(os.urandom(32)).decode()
    run_demo(
        console, system, Demo, name="returns",
        starting="starting PostgreSQL, the payments_demo database, the fakes and the fake merchant",
        passed="the return applied once through our inbox, refunded once, the merchant told",
        start_args=("--cutoff", "24:00"),
    )


if __name__ == "__main__":
    typer.run(main)
