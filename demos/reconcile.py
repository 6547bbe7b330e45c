"""`python -m demos.reconcile` (`make demo-reconcile`): indeterminate payouts, settled by the statement.

This demo walks down the last branch of recovery: the outcome of a
payout is unknown, and an idempotent retry is not possible (the beneficiary's bank
sits behind a legacy rail: no idempotency keys, no status probe), so the
payment is parked as `indeterminate` and reconciliation against the rail's
statement settles it. See docs/reconciliation.md and docs/reference/runbook-indeterminate.md.

    (a) the rail books the transfer, then hangs (fault hang_after): we time out.
        The statement has it -> succeeded, one transfer, no refund.
    (b) the rail fails before booking (fault error_before 500).
        Both statements that could hold it are final and do not -> refunded once (K3): failed.
    (c) (--duplicate, on by default) the same transfer is posted to the legacy
        rail a second time, outside the service: booked twice -> a
        duplicate_booking break, listed by `payments breaks`, never auto-corrected.

Everything runs as real processes (see demos.system), `payments reconcile` and
`payments breaks` included. Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import httpx
import typer
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from app.idempotency.keys import derived_key
from app.payments.recovery_points import STEP_REFUND
from demos.evidence import Snapshot, relative_times, snapshot
from demos.story import ledger_table, step, terminal
from demos.system import BIN, CheckedDemo, DemoError, System, payment_body, run_demo

# The beneficiary bank behind the rail that is legacy (as in tests/conftest.py).
LEGACY_IBAN = "GB82WEST12345698765432"
RAIL_TIMEOUT_SECONDS = "2"
HANG_SECONDS = 5
JOB = "reconcile-rail"

console = terminal()


def short(value: str | None) -> str:
    return "-" if not value else value[:12] + "…"


@dataclass
class Legacy:
    """One payment to the legacy account, as the demo follows it."""

    label: str
    key: str
    body: dict[str, Any]
    payment_id: str = ""

    @property
    def reference(self) -> str:
        return self.body["reference"]


class Demo(CheckedDemo):
    def __init__(self, system: System, duplicate: bool) -> None:
        super().__init__(system)
        self.duplicate = duplicate
        self.today = datetime.now(UTC).date()
        self.api = None

    # -- plumbing -------------------------------------------------------------------------------------

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.system.api_key}", "Idempotency-Key": key}

    def pay(self, p: Legacy) -> httpx.Response:
        return self.http.post(f"{self.api.url}/v1/payments", json=p.body, headers=self.headers(p.key))

    def rail_fault(self, fault: dict[str, Any]) -> None:
        self.http.put(self.system.rail.url + "/_admin/faults", json={"faults": [fault]}).raise_for_status()

    def statement(self, day: date) -> dict[str, Any]:
        response = self.http.get(f"{self.system.rail.url}/v1/statements/{day.isoformat()}")
        response.raise_for_status()
        return response.json()

    def cli(self, *args: str) -> tuple[int, str]:
        """`payments <args>` as its own process, configured like a worker would be."""
        env = self.system.service_env(RAIL_LEGACY_ACCOUNTS=LEGACY_IBAN, RAIL_TIMEOUT_SECONDS=RAIL_TIMEOUT_SECONDS,
                                      RECONCILE_BOOKING_DAYS="1",
                                      COLUMNS="200")
        try:
            done = subprocess.run([str(BIN / "payments"), *args], env=env, capture_output=True, text=True,
                                  timeout=120, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as exc:
            raise DemoError(f"`payments {' '.join(args)}` did not finish within 120 s") from exc
        return done.returncode, (done.stderr + done.stdout).strip()

    def show_cli(self, args: list[str], code: int, output: str) -> None:
        console.print(f"  [bold]$ payments {' '.join(args)}[/]   (exit {code})")
        lines = Text()
        for line in output.splitlines() or ["(no output)"]:
            lines.append(line + "\n", style="dim" if " INFO " in line else "bold")
        console.print(Panel(lines, border_style="green" if code == 0 else "red", expand=True))

    def snap(self, p: Legacy) -> Snapshot:
        return snapshot(self.system, p.key, p.reference)

    # -- the story ------------------------------------------------------------------------------------

    def run(self) -> None:
        self.start()
        a = Legacy("(a)", str(uuid.uuid4()), self.body("a"))
        b = Legacy("(b)", str(uuid.uuid4()), self.body("b"))
        self.hang_after(a)
        self.error_before(b)
        self.statements_and_close(a, b)
        self.reconcile(a, b)
        self.outcome(a, b)
        self.rerun(a, b)
        if self.duplicate:
            self.duplicate_booking()

    def body(self, tag: str) -> dict[str, Any]:
        return payment_body(f"order-{tag}-{uuid.uuid4().hex[:8]}",
                            beneficiary={"name": "Old Bank Customer", "iban": LEGACY_IBAN})

    def start(self) -> None:
        step(console, 1, "Start the system: a rail with one legacy beneficiary bank")
        self.api = self.system.api(env={"RAIL_LEGACY_ACCOUNTS": LEGACY_IBAN,
                                        "RAIL_TIMEOUT_SECONDS": RAIL_TIMEOUT_SECONDS})
        config = self.http.get(self.system.rail.url + "/_admin/config").json()
        table = Table(show_header=False, box=None, padding=(0, 2))
        table.add_row("PostgreSQL", self.system.database_label)
        table.add_row("fake PSP", self.system.psp.url)
        table.add_row("fake rail", f"{self.system.rail.url}   --legacy-accounts {LEGACY_IBAN} --cutoff 24:00   "
                                   f"(/_admin/config: {json.dumps(config)})")
        table.add_row("API", f"{self.api.url}   RAIL_LEGACY_ACCOUNTS={LEGACY_IBAN}  "
                             f"RAIL_TIMEOUT_SECONDS={RAIL_TIMEOUT_SECONDS}")
        table.add_row("today (UTC)", self.today.isoformat())
        console.print(table)
        console.print(Panel(
            f"Payouts to [bold]{LEGACY_IBAN}[/] go through an old bank behind the rail: it ignores "
            "Idempotency-Key (a second POST is a second payout) and cannot be probed. So "
            "Rail.deduplicates() is False and the runner sends such a transfer [bold]once[/] "
            "(runner._call_once). If the answer is lost, no retry and no probe can learn more: the payment "
            "is parked as [bold]indeterminate[/] at once (runner._give_up(final=True)), and only the rail's "
            "statement can settle it.\nIdempotent retry possible? [bold]NO[/] -> reconcile.",
            title="the legacy path", border_style="blue"))
        self.checks.check("rail config: legacy account, no cut-off", ([LEGACY_IBAN], None),
                          (config.get("legacy_accounts"), config.get("cutoff")))

    def park(self, p: Legacy, fault: dict[str, Any], what: str) -> None:
        self.rail_fault({"operation": "transfer", "reference": p.reference, **fault})
        console.print(f"  rail fault for {p.reference}: [bold]{json.dumps(fault)}[/]  ({what})")
        console.print(f"  POST /v1/payments  Idempotency-Key [cyan]{p.key}[/]  1250 EUR -> {LEGACY_IBAN}")
        started = time.monotonic()
        response = self.pay(p)
        took = time.monotonic() - started
        view = response.json()
        p.payment_id = view.get("id", "")
        console.print(f"  -> [bold]{response.status_code}[/] after {took:.1f} s   status [bold]{view.get('status')}[/]"
                      f"   id {p.payment_id}   Location {response.headers.get('Location')}"
                      f"   Retry-After {response.headers.get('Retry-After')}")
        self.checks.check(f"{p.label} first answer", "202 indeterminate",
                          f"{response.status_code} {view.get('status')}")
        self.show_key(p)

    def show_key(self, p: Legacy) -> None:
        """The key row as an operator sees it: GET /v1/idempotency-keys/{key}, plus the payment."""
        key = self.http.get(f"{self.api.url}/v1/idempotency-keys/{p.key}", headers=self.headers(p.key)).json()
        s = self.snap(p)
        table = Table(title=f"{p.label} GET /v1/idempotency-keys/{p.key[:8]}… and the payment row",
                      title_justify="left", show_header=False)
        for name in ("state", "recovery_point", "parked", "lease_held", "attempts", "last_error"):
            table.add_row(name, str(key.get(name)))
        table.add_row("parked_at (db)", str(s.key["parked_at"]) if s.key else "-")
        if s.payment:
            table.add_row("payment status", s.payment["status"])
            table.add_row("end_to_end_reference", s.payment["end_to_end_reference"] or "-")
            table.add_row("net amount", f"{s.payment['net_minor']} {s.payment['currency']}")
        console.print(table)
        self.checks.check(f"{p.label} key row parked at EXT2_SENT", "started, EXT2_SENT, parked",
                          f"{key.get('state')}, {key.get('recovery_point')}, "
                          + ("parked" if key.get("parked") and s.key and s.key["parked_at"] else "not parked"))

    def show_transfers(self, p: Legacy, expected: int, why: str) -> Snapshot:
        s = self.snap(p)
        table = Table(title=f"{p.label} what the rail recorded (fake_rail.transfer, reference {p.reference})",
                      title_justify="left")
        for column in ("id", "status", "legacy", "presented key", "end_to_end_reference", "amount", "booking_date"):
            table.add_column(column)
        for t in s.transfers:
            table.add_row(t["id"], t["status"], str(t["legacy"]), short(t["presented_key"]),
                          t["end_to_end_reference"], str(t["amount"]), str(t["booking_date"]))
        if not s.transfers:
            table.add_row("(none)", "", "", "", "", "", "")
        console.print(table)
        self.checks.check(f"{p.label} transfers at the rail {why}", expected, len(s.transfers))
        return s

    def hang_after(self, a: Legacy) -> None:
        step(console, 2, "(a) The rail books the payout, but the answer never comes (hang_after)")
        self.park(a, {"action": "hang_after", "seconds": HANG_SECONDS},
                  f"book it, then hold the answer {HANG_SECONDS} s; we give up after {RAIL_TIMEOUT_SECONDS} s")
        s = self.show_transfers(a, 1, "(it was booked; we could not know)")
        e2e = s.payment["end_to_end_reference"] if s.payment else "?"
        probe = self.http.get(f"{self.system.rail.url}/v1/transfers/{e2e}")
        console.print(f"  the status probe a modern rail would answer: GET /v1/transfers/{e2e} -> "
                      f"[bold]{probe.status_code}[/] (a legacy transfer cannot be looked up)")
        self.checks.check("(a) legacy transfer cannot be probed", 404, probe.status_code)

        console.print("\n  The client did not learn the outcome either, so it retries with the [bold]same key[/]:")
        retry = self.pay(a)
        view = retry.json()
        console.print(f"  -> [bold]{retry.status_code}[/]   status [bold]{view.get('status')}[/]   id {view.get('id')}"
                      "   (parked: the API answers from the stored row and sends nothing)")
        self.checks.check("(a) client retry", f"202 indeterminate, payment {a.payment_id}",
                          f"{retry.status_code} {view.get('status')}, payment {view.get('id')}")
        self.checks.check("(a) transfers at the rail after the retry (no second payout)", 1,
                          len(self.snap(a).transfers))

    def error_before(self, b: Legacy) -> None:
        step(console, 3, "(b) The rail fails before booking anything (error_before 500)")
        self.park(b, {"action": "error_before", "status": 500},
                  "answer 500 at once; nothing is booked")
        self.show_transfers(b, 0, "(nothing was booked)")
        console.print(Panel(
            "A 500 from a legacy rail proves nothing: a lost response (error_after) looks the same. "
            "The service cannot tell (a) from (b); both are parked, and both answer 202 indeterminate. "
            "Nothing is reported failed, because nothing is known to have failed.",
            border_style="yellow"))

    def statement_table(self, statement: dict[str, Any], ours: dict[str, str]) -> Table:
        table = Table(title=f"statement {statement['date']}   final: {str(statement['final']).lower()}",
                      title_justify="left")
        for column in ("transfer_id", "end_to_end_reference", "amount", "currency", "booking_date", "ours"):
            table.add_column(column)
        for e in statement["entries"]:
            table.add_row(e["transfer_id"], e["end_to_end_reference"], str(e["amount"]), e["currency"],
                          e["booking_date"], ours.get(e["end_to_end_reference"], "-"))
        if not statement["entries"]:
            table.add_row("(no entries)", "", "", "", "", "")
        return table

    def ours(self, *payments: Legacy) -> dict[str, str]:
        refs = {}
        for p in payments:
            s = self.snap(p)
            if s.payment and s.payment["end_to_end_reference"]:
                refs[s.payment["end_to_end_reference"]] = f"{p.label} {p.reference}"
        return refs

    def statements_and_close(self, a: Legacy, b: Legacy) -> None:
        step(console, 4, "The rail's statements, and the day closing")
        tomorrow = self.today + timedelta(days=1)
        ours = self.ours(a, b)
        before = self.statement(self.today)
        console.print(self.statement_table(before, ours))
        self.checks.check("today's statement before the close", "final: false", f"final: {str(before['final']).lower()}")
        console.print(Panel(
            f"Absent from an open statement proves nothing, and a payout instructed on {self.today} is booked "
            f"on {self.today}'s statement, or on {tomorrow}'s if it reached the rail after the cut-off. So (b) can "
            "be settled as absent only when [bold]both[/] statements are final. (This demo's rail books within "
            "one day: RECONCILE_BOOKING_DAYS=1. The default, 3, also allows for weekends.)",
            border_style="blue"))
        closed = self.http.post(self.system.rail.url + "/_admin/close-day", json={"date": tomorrow.isoformat()})
        closed.raise_for_status()
        console.print(f"  [bold]POST /_admin/close-day {{\"date\": \"{tomorrow}\"}}[/] -> {closed.status_code} "
                      f"{closed.json()}  (moves the rail's calendar on: {self.today} and {tomorrow} close)")
        for day in (self.today, tomorrow):
            st = self.statement(day)
            console.print(self.statement_table(st, ours))
            self.checks.check(f"statement {day} after the close", "final: true", f"final: {str(st['final']).lower()}")

    def reconcile(self, a: Legacy, b: Legacy) -> None:
        step(console, 5, f"Reconcile {self.today}: payments reconcile --date {self.today}")
        args = ["reconcile", "--date", self.today.isoformat()]
        code, output = self.cli(*args)
        self.show_cli(args, code, output)
        self.checks.check("payments reconcile exit status", 0, code)
        self.checks.check("payments reconcile reports the window", f"reconciled {self.today}",
                          f"reconciled {self.today}" if f"reconciled {self.today}:" in output else output[-80:])

    def outcome(self, a: Legacy, b: Legacy) -> None:
        step(console, 6, "The outcome")
        start = len(self.checks.rows)
        sa, sb = self.snap(a), self.snap(b)
        tomorrow = self.today + timedelta(days=1)
        entries = self.statement(self.today)["entries"] + self.statement(tomorrow)["entries"]

        # (a): found on the statement, once, with our amount -> Handler3 ran.
        pa = sa.payment
        e2e_a = pa["end_to_end_reference"] if pa else None
        lines = [e for e in entries if e["end_to_end_reference"] == e2e_a]
        console.print(Text.from_markup(f"[bold](a) {a.reference}[/]: the statement line that decided it"))
        if lines:
            line = lines[0]
            console.print(f"  {line['transfer_id']}  e2e {line['end_to_end_reference']}  "
                          f"{line['amount']} {line['currency']}  booked {line['booking_date']}"
                          f"   vs ours: e2e {e2e_a}  net {pa['net_minor']} {pa['currency']}")
        console.print(f"  payment status [bold]{pa['status'] if pa else '-'}[/], rail_transfer_id "
                      f"{pa['rail_transfer_id'] if pa else '-'}")
        self.checks.check("(a) payment status", "succeeded", pa["status"] if pa else "-")
        self.checks.check("(a) booked once on the statements, amount matches", "1 line, amount = net",
                          f"{len(lines)} line{'' if len(lines) == 1 else 's'}, amount " + (
                              "= net" if lines and lines[0]["amount"] == pa["net_minor"]
                              and lines[0]["currency"] == pa["currency"] else "differs"))
        self.checks.check("(a) settled by that line (rail_transfer_id)", lines[0]["transfer_id"] if lines else "-",
                          pa["rail_transfer_id"] if pa else "-")
        self.checks.check("(a) transfers at the rail / refunds at the PSP", "1 / 0",
                          f"{len(sa.transfers)} / {len(sa.refunds)}")

        # (b): absent from both final statements -> refunded by K3.
        pb = sb.payment
        k3 = derived_key(self.system.client_id, b.key, STEP_REFUND)
        console.print(Text.from_markup(f"\n[bold](b) {b.reference}[/]: on neither final statement -> the charge "
                                       "is refunded, with the derived key K3"))
        refunds = Table(title="(b) the PSP's refund records (fake_psp.refund)", title_justify="left")
        for column in ("id", "charge_id", "amount", "idempotency_key (K3)", "status"):
            refunds.add_column(column)
        for r in sb.refunds:
            refunds.add_row(r["id"], r["charge_id"], str(r["amount"]), r["idempotency_key"], r["status"])
        if not sb.refunds:
            refunds.add_row("(none)", "", "", "", "")
        console.print(refunds)
        console.print(f"  K3 = derived_key(client {self.system.client_id}, key, 'refund') = {k3}")
        self.checks.check("(b) payment status, failure code", "failed, not_on_statement",
                          f"{pb['status']}, {pb['reject_reason']}" if pb else "-")
        self.checks.check("(b) refunds at the PSP", 1, len(sb.refunds))
        if sb.refunds and sb.charges:
            r, c = sb.refunds[0], sb.charges[0]
            self.checks.check("(b) the refund's key is K3", k3, r["idempotency_key"])
            self.checks.check("(b) refund = the whole charge", f"{c['id']} {c['amount']}",
                              f"{r['charge_id']} {r['amount']}")
        self.checks.check("(b) transfers at the rail", 0, len(sb.transfers))

        # The durable tick.
        run = self.system.db.fetchrow("SELECT * FROM scheduled_run WHERE job = $1 AND window_start = $2",
                                      JOB, self.today)
        self.show_run(run)
        counts = json.loads(run["counts"]) if run and isinstance(run["counts"], str) else (run["counts"] if run else {})
        self.checks.check("scheduled_run", "finished, attempt 1, settled 1 + 1",
                          f"{run['state']}, attempt {run['attempts']}, settled "
                          f"{counts.get('settled_succeeded', 0)} + {counts.get('settled_refunding', 0)}"
                          if run else "missing")

        # Ledgers, timelines, replays.
        for p, s, n in ((a, sa, 5), (b, sb, 6)):
            console.print(Group(ledger_table(s, f"{p.label} ledger ({p.reference})"), self.timeline_table(p, s)))
            self.checks.check(f"{p.label} ledger balanced, entries", f"balanced, {n}",
                              f"{'balanced' if s.balanced else 'UNBALANCED'} "
                              f"({s.debits} = {s.credits}), {len(s.ledger)}"
                              if s.balanced else f"{s.debits} != {s.credits}, {len(s.ledger)}",
                              s.balanced and len(s.ledger) == n)
        for p in (a, b):
            self.replay(p)
        console.print(self.checks.table("the outcome, checked", since=start))

    def show_run(self, run: Any) -> None:
        table = Table(title="scheduled_run: the durable tick (job + window), one row per window",
                      title_justify="left")
        for column in ("job", "window_start", "state", "attempts", "counts", "error", "lease"):
            table.add_column(column, overflow="fold")
        if run:
            counts = run["counts"] if isinstance(run["counts"], str) else json.dumps(run["counts"])
            table.add_row(run["job"], str(run["window_start"]), run["state"], str(run["attempts"]), counts,
                          run["error"] or "-", "released" if run["lease_token"] is None else "held")
        else:
            table.add_row("(none)", "", "", "", "", "", "")
        console.print(table)

    def timeline_table(self, p: Legacy, s: Snapshot) -> Table:
        table = Table(title=f"{p.label} the key row's timeline", title_justify="left")
        for column in ("at", "event", "recovery point", "attempt"):
            table.add_column(column)
        for at, entry in zip(relative_times(s.timeline), s.timeline):
            table.add_row(at, entry["event"], entry["recovery_point"], str(entry["attempt"]))
        return table

    def replay(self, p: Legacy) -> None:
        s = self.snap(p)
        response = self.pay(p)
        stored = s.key["response_body"] if s.key else None
        replayed = response.headers.get("Idempotent-Replayed") == "true"
        identical = response.text == stored
        console.print(f"  {p.label} replay POST /v1/payments (same key, same body) -> [bold]{response.status_code}[/]"
                      f"  Idempotent-Replayed: {response.headers.get('Idempotent-Replayed', '-')}"
                      f"  status {response.json().get('status')}  "
                      + ("byte-identical to the stored response" if identical else "[red]different bytes[/]"))
        self.checks.check(f"{p.label} replay", "201, replayed, byte-identical",
                          f"{response.status_code}, {'replayed' if replayed else 'not replayed'}, "
                          f"{'byte-identical' if identical else 'different bytes'}")

    def rerun(self, a: Legacy, b: Legacy) -> None:
        step(console, 7, "Run it again: the window is done, nothing happens twice")
        start = len(self.checks.rows)
        args = ["reconcile", "--date", self.today.isoformat()]
        code, output = self.cli(*args)
        self.show_cli(args, code, output)
        self.checks.check("second run: exit status, message", "0, already reconciled",
                          f"{code}, " + ("already reconciled" if "already reconciled" in output else output[-60:]))
        run = self.system.db.fetchrow("SELECT attempts, state FROM scheduled_run WHERE job = $1 AND window_start = $2",
                                      JOB, self.today)
        self.checks.check("scheduled_run after the second run", "finished, attempt 1",
                          f"{run['state']}, attempt {run['attempts']}" if run else "missing")
        self.checks.check("refunds / transfers after the second run", "1 / 1",
                          f"{len(self.snap(b).refunds)} / {len(self.snap(a).transfers)}")
        code, output = self.cli("breaks")
        self.show_cli(["breaks"], code, output)
        self.checks.check("payments breaks", "0, no breaks", f"{code}, {output.strip()[-40:]}")
        console.print(self.checks.table("nothing twice, checked", since=start))

    def duplicate_booking(self) -> None:
        step(console, 8, "(c) The same payout booked twice: a break, left for a person")
        start = len(self.checks.rows)
        c = Legacy("(c)", str(uuid.uuid4()), self.body("c"))
        self.park(c, {"action": "hang_after", "seconds": HANG_SECONDS},
                  "booked, answer lost, parked, exactly like (a)")
        [first] = self.snap(c).transfers or [None]
        if first is None:
            raise DemoError("(c) the rail recorded no transfer")
        console.print("\n  Then someone (an old batch job, a person re-sending a payment file) posts the same "
                      "transfer straight to the rail. A legacy rail cannot tell it is the same one:")
        again = self.http.post(self.system.rail.url + "/v1/transfers", json={
            k: first[k] for k in ("end_to_end_reference", "amount", "currency", "beneficiary_iban",
                                  "beneficiary_name", "reference")})
        console.print(f"  POST /v1/transfers (same end_to_end_reference {first['end_to_end_reference']}) -> "
                      f"[bold]{again.status_code}[/] {again.json().get('id')}")
        s = self.show_transfers(c, 2, "(paid twice)")
        booked_on = s.transfers[0]["booking_date"]
        console.print(Panel(
            f"{self.today} and {self.today + timedelta(days=1)} are closed now, so the rail booked both on "
            f"[bold]{booked_on}[/], its first open day. Reconcile that day's window.",
            border_style="blue"))
        args = ["reconcile", "--date", str(booked_on)]
        code, output = self.cli(*args)
        self.show_cli(args, code, output)
        self.checks.check(f"payments reconcile --date {booked_on}", 0, code)
        code, listing = self.cli("breaks")
        self.show_cli(["breaks"], code, listing)
        breaks = self.system.db.fetch("SELECT * FROM reconciliation_break ORDER BY id")
        self.checks.check("breaks recorded", "1: duplicate_booking for (c)",
                          f"{len(breaks)}: " + ", ".join(f"{r['kind']} for " + ("(c)" if str(r["payment_id"]) == c.payment_id else
                                                          str(r["payment_id"])) for r in breaks) or "none")
        self.checks.check("payments breaks lists it", "duplicate_booking + e2e + payment id",
                          "duplicate_booking + e2e + payment id" if "duplicate_booking" in listing
                          and first["end_to_end_reference"] in listing and c.payment_id in listing else listing[-60:])
        after = self.snap(c)
        retry = self.pay(c)
        self.checks.check("(c) payment after reconciliation (never auto-corrected)", "indeterminate, parked",
                          f"{after.payment['status'] if after.payment else '-'}, "
                          + ("parked" if after.key and after.key["parked_at"] else "not parked"))
        self.checks.check("(c) a client retry", "202 indeterminate", f"{retry.status_code} {retry.json().get('status')}")
        self.checks.check("(c) refunds at the PSP / transfers at the rail", "0 / 2",
                          f"{len(after.refunds)} / {len(after.transfers)}")
        console.print(Panel(
            "Nothing here can be settled by a rule: the beneficiary was paid twice, and whether to recall the "
            "second payout, or to keep it and charge again, is a business decision. The service records the "
            "break and leaves the payment indeterminate; a person asks the rail for a recall of the duplicate "
            f"({again.json().get('id')}) and settles the payment by the book. See docs/reference/runbook-indeterminate.md.",
            title="why it is not auto-corrected", border_style="yellow"))
        console.print(self.checks.table("(c) checked", since=start))


def main(
    duplicate: bool = typer.Option(True, "--duplicate/--no-duplicate",
                                   help="Also show (c): a payout booked twice, and its break."),
) -> None:
    """Park two legacy payouts as indeterminate, then settle them against the rail's statement."""
    run_demo(
        console, System(), lambda system: Demo(system, duplicate), name="reconciliation",
        starting="starting PostgreSQL, the payments_demo database, the fake PSP and the legacy rail",
        passed="(a) settled succeeded by its statement line, (b) refunded once by K3, a rerun did nothing, "
               + ("(c) left as a duplicate_booking break" if duplicate else "no breaks"),
        start_args=("--legacy-accounts", LEGACY_IBAN, "--cutoff", "24:00"),
    )


if __name__ == "__main__":
    typer.run(main)
