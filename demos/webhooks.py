"""`python -m demos.webhooks` (`make demo-webhooks`): a payment's webhook, a dispatcher killed mid-delivery,
and the merchant's inbox applying it once.

    1. A client with a webhook endpoint at the fake merchant pays once. The
       phase that finishes the payment writes its event in the same
       statement; nothing else is written for the webhook, and nothing sent.
    2. A worker whose dispatcher dies at `webhook-after-delivery` leases the
       cursor, reads the event behind it, POSTs it signed, the merchant
       verifies and applies it ... and the worker dies before moving the
       cursor. Ours say: the cursor leased and not moved, no delivery row.
       The merchant's say: applied.
    3. A second worker, once the dead one's lease runs out, reads the same
       event and POSTs it again (the same webhook-id). The merchant's inbox
       has seen it: acknowledged (200) and dropped. The cursor moves past
       it, and its delivery row is written, delivered.
    4. The evidence: two POSTs received, one inbox row, the effect applied
       once; our delivery `delivered`, its one attempt row the second POST's.

Everything runs as real processes (see demos.system). Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import json
import uuid

import typer
from rich.panel import Panel
from rich.table import Table

from app.outbox.endpoints import new_secret
from demos.story import step, terminal
from demos.system import CheckedDemo, DemoError, System, payment_body, run_demo, wait_for

console = terminal()
POINT = "webhook-after-delivery"
# A claim lasts this long: the second worker may take over this soon after the crash.
LEASE_SECONDS = "3"
WORKER = {"WORKER_POLL_SECONDS": "0.2", "WEBHOOK_POLL_SECONDS": "0.2", "WEBHOOK_TIMEOUT_SECONDS": "2",
          "WEBHOOK_LEASE_SECONDS": LEASE_SECONDS}


class Demo(CheckedDemo):
    def cursor(self, event_id) -> tuple[bool, bool]:
        """Whether the dispatchers' cursor is past the event, and whether a dispatcher holds it now."""
        row = self.db.fetchrow(
            "SELECT (e.written_by, e.id) <= (c.written_by, c.event_id) AS past, c.lease_expires_at > now() AS leased "
            "FROM event e, webhook_cursor c WHERE e.id = $1", event_id)
        return bool(row["past"]), bool(row["leased"])

    def ours(self, event_id) -> Table:
        past, leased = self.cursor(event_id)
        d = self.db.fetchrow("SELECT * FROM webhook_delivery WHERE event_id = $1", event_id)
        table = Table(title="ours: webhook_cursor, webhook_delivery and webhook_attempt", title_justify="left")
        for column in ("cursor", "delivery", "attempts", "attempt", "outcome", "status", "latency"):
            table.add_column(column)
        where = ("past the event" if past else "before the event") + (", leased" if leased else "")
        state, attempts = (d["state"], str(d["attempts"])) if d else ("(no row yet)", "-")
        for a in self.db.fetch("SELECT * FROM webhook_attempt WHERE event_id = $1 ORDER BY attempt", event_id):
            table.add_row(where, state, attempts, f"#{a['attempt']}", a["outcome"] or "(none yet)",
                          str(a["status_code"] or "-"),
                          f"{a['latency_ms']:.0f} ms" if a["latency_ms"] is not None else "-")
        if table.row_count == 0:
            table.add_row(where, state, attempts, "-", "-", "-", "-")
        return table

    def theirs(self, event_id) -> Table:
        merchant = self.system.merchant.url
        received = self.http.get(merchant + "/_admin/received", params={"webhook_id": str(event_id)}).json()["items"]
        inbox = [m for m in self.http.get(merchant + "/_admin/inbox").json()["items"] if m["webhook_id"] == str(event_id)]
        payments = self.http.get(merchant + "/_admin/payments").json()["items"]
        table = Table(title="the merchant's: /_admin/received, /_admin/inbox, /_admin/payments", title_justify="left")
        for column in ("POST", "answered", "outcome", "inbox rows", "payment status", "events applied"):
            table.add_column(column)
        applied = payments[0] if payments else {}
        for r in received:
            table.add_row(f"#{r['seq']}", str(r["status_code"]), r["outcome"], str(len(inbox)),
                          str(applied.get("status", "-")), str(applied.get("events_applied", "-")))
        if not received:
            table.add_row("-", "-", "-", str(len(inbox)), "-", "-")
        return table

    def run(self) -> None:
        system, db = self.system, self.db
        secret = new_secret()
        merchant = system.start_merchant(secrets=[secret])
        webhook_url = merchant.url + "/webhooks"
        db.execute("INSERT INTO webhook_endpoint (client_id, url, secret_sealed) VALUES ($1, $2, $3)",
                   system.client_id, webhook_url, system.seal(secret))
        api = system.api()

        step(console, 1, "a payment, and its event written with it")
        body = payment_body()
        response = self.http.post(api.url + "/v1/payments", json=body, headers={
            "Authorization": f"Bearer {system.api_key}", "Idempotency-Key": str(uuid.uuid4())})
        payment = response.json()
        console.print(f"POST /v1/payments -> {response.status_code}, status [bold]{payment['status']}[/]")
        event = db.fetchrow("SELECT * FROM event WHERE payment_id = $1", uuid.UUID(payment["id"]))
        if event is None:
            raise DemoError("the payment has no event")
        event_id = event["id"]
        console.print(f"event [bold]{event['type']}[/] {event_id}: written by the statement that finished the "
                      "payment; nothing else is written for its webhook, and nothing has been sent yet")
        console.print(self.ours(event_id))
        self.checks.check("the decision and its event, together", "succeeded, 1 event", f"{payment['status']}, 1 event")

        step(console, 2, f"a worker's dispatcher delivers it, then dies ({POINT})")
        doomed = system.start_worker("doomed-worker", PAYMENTS_CRASH_AT=POINT, **WORKER)
        code = doomed.wait(30)
        console.print(f"worker exited with code {code}: the merchant answered, the cursor was never moved")
        self.checks.check("the dispatcher died at the crash point", 137, code)
        console.print(self.ours(event_id))
        console.print(self.theirs(event_id))
        past, leased = self.cursor(event_id)
        rows = db.fetchval("SELECT count(*) FROM webhook_delivery WHERE event_id = $1", event_id)
        self.checks.check("left behind: the cursor leased, not moved; no delivery row",
                          "leased, before the event, 0 rows",
                          f"{'leased' if leased else 'not leased'}, {'past' if past else 'before'} the event, {rows} rows")

        step(console, 3, f"another worker reads it again once the cursor's lease ({LEASE_SECONDS} s) runs out, "
                         "and POSTs it again")
        system.start_worker("worker", **WORKER)
        wait_for("the delivery to be recorded as delivered", lambda: db.fetchval(
            "SELECT state FROM webhook_delivery WHERE event_id = $1", event_id) == "delivered")
        console.print("the same webhook-id again: the merchant's inbox has it, so it answers 200 and applies nothing")
        console.print(self.ours(event_id))
        console.print(self.theirs(event_id))

        step(console, 4, "the evidence")
        received = self.http.get(merchant.url + "/_admin/received", params={"webhook_id": str(event_id)}).json()["items"]
        inbox = [m for m in self.http.get(merchant.url + "/_admin/inbox").json()["items"]
                 if m["webhook_id"] == str(event_id)]
        [applied] = self.http.get(merchant.url + "/_admin/payments").json()["items"]
        self.checks.check("POSTs the merchant received", 2, len(received))
        self.checks.check("their outcomes", "applied, duplicate", ", ".join(r["outcome"] for r in received))
        self.checks.check("rows in the merchant's inbox", 1, len(inbox))
        self.checks.check("times the merchant applied an event to the payment", 1, applied["events_applied"])
        self.checks.check("the merchant's view of the payment", "succeeded", applied["status"])
        outcomes = [a["outcome"] for a in db.fetch(
            "SELECT outcome FROM webhook_attempt WHERE event_id = $1 ORDER BY attempt", event_id)]
        self.checks.check("our attempts (the dead worker's left no row)", "['delivered']", str(outcomes))
        console.print(self.checks.table("checks"))
        console.print(Panel(json.dumps(json.loads(event["data"]), indent=1)[:600],
                            title=f"what the webhook carried (data), webhook-id {event_id}", border_style="blue"))


def main() -> None:
    """A payment's webhook, a dispatcher killed mid-delivery, and the merchant's inbox applying it once."""
    system = System()
    run_demo(
        console, system, Demo, name="webhooks",
        starting="starting PostgreSQL, the payments_demo database, the fakes and the fake merchant",
        passed="delivered twice across a crash, applied once by the merchant's inbox")


if __name__ == "__main__":
    typer.run(main)
