"""One kill-between-phases story: crash at a named point, look, resume, prove.

`run_point` is shared by `demos.crash` (which shows every step) and
`demos.crash_all` (which writes each story to a file and prints a summary).
The steps are those of the crash matrix in tests/crash, told for a person:

    1. an API process started with PAYMENTS_CRASH_AT=<point> and a 2 s lease
    2. one payment through PaymentsClient: the API dies mid-request (exit 137)
    3. what is durable: key row, payment, PSP and rail records, ledger
    4. resume: the same client retries (same store, same key), or the recovery
       worker finishes it and the client's retry replays the stored response
    5. the timeline and the exactly-once evidence
"""

from __future__ import annotations

import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.columns import Columns
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from app.payments.crash_points import POINTS
from demos.evidence import Snapshot, relative_times, snapshot
from demos.system import DOOMED_LEASE_SECONDS, DemoError, System, payment_body
from payments_client import Event, PaymentsClient, PaymentsError, RetriesExhausted

# What a resumer must do from each point, and why it cannot pay twice.
RESUME = {
    "after-commit-EXT1_SENT": "The PSP has never seen K1. A resumer probes the PSP by K1, finds nothing, "
                              "and charges, with K1.",
    "after-call-EXT1": "The card is charged but our database does not know it. A resumer probes the PSP by "
                       "K1, finds this very charge and records it: it never charges again.",
    "after-commit-EXT2_SENT": "The charge is recorded (ledger: charge_captured). A resumer probes the rail "
                              "by end-to-end reference, finds nothing, and pays out with K2.",
    "after-call-EXT2": "The rail has the transfer; our database does not know it. A resumer probes the "
                       "rail by end-to-end reference and records the transfer it finds.",
    "after-commit-EXT3_SENT": "The rejection is recorded and the refund intended. A resumer probes the PSP "
                              "by K3, finds nothing, and refunds with K3.",
    "after-call-EXT3": "The PSP refunded; our database does not know it. A resumer probes the PSP by K3 "
                       "and records that refund: one refund, never two.",
    "after-commit-finished": "Everything is done and the response stored; only the client never heard. "
                             "A retry gets the stored response, byte for byte.",
}
MODES = {
    "retry": "the API is restarted (no crash point) and the same client retries with the same key",
    "worker": "nobody retries: the recovery worker (`payments worker`) finishes the payment, then the "
              "client's retry replays the stored response",
}


def terminal() -> Console:
    """The terminal's own width; 120 columns when the output goes to a file or a pipe."""
    return Console() if sys.stdout.isatty() else Console(width=120)


def on_request_path(point: str) -> bool:
    """Whether a payment request can reach `point` (others belong to, e.g., reconciliation runs)."""
    return point.startswith(("after-commit-", "after-call-"))


def left_behind(point: str) -> str:
    """The recovery point a crash at `point` leaves on the key row."""
    if point.startswith("after-commit-"):
        return point.removeprefix("after-commit-")
    return point.removeprefix("after-call-") + "_SENT"


@dataclass
class Outcome:
    point: str
    mode: str
    left: str = "?"
    resumed_by: str = "?"
    api_url: str | None = None  # the API that answered the resumed payment (its console shows it)
    final: Snapshot | None = None
    replay_identical: bool = False
    checks: list[tuple[str, str, str, bool]] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(ok for *_, ok in self.checks)

    def check(self, what: str, expected: object, actual: object, ok: bool | None = None) -> None:
        self.checks.append((what, str(expected), str(actual), expected == actual if ok is None else ok))


class ClientLog:
    """Collects the client's events and tells them, one line each."""

    def __init__(self, out: Console, store: Path) -> None:
        self.out, self.store, self.events, self.phase = out, store, [], ""

    def __call__(self, e: Event) -> None:
        self.events.append((self.phase, e))
        line = self.describe(e)
        if line:
            self.out.print("  [dim]client>[/] " + line)

    def describe(self, e: Event) -> str | None:
        if e.kind == "key-created":
            return (f"new operation [bold]{e.operation_id}[/]: key [cyan]{e.key}[/] generated and saved to "
                    f"{self.store.name} [i]before[/] the first attempt")
        if e.kind == "key-reused":
            return f"the store holds operation [bold]{e.operation_id}[/] ({e.detail}): reusing key [cyan]{e.key}[/]"
        if e.kind == "response":
            return (f"attempt {e.attempt}: [bold]{e.status}[/]" + (f" {e.problem}" if e.problem else "")
                    + (f"  Retry-After: {e.retry_after:g} s" if e.retry_after is not None else "")
                    + ("  [green]Idempotent-Replayed: true[/]" if e.replayed else ""))
        if e.kind == "transport-error":
            return f"attempt {e.attempt}: [yellow]{e.detail}[/]"
        if e.kind == "wait":
            return f"   waiting {e.seconds:.1f} s before the next attempt"
        if e.kind == "poll":
            return f"   polled the payment: {e.detail}"
        if e.kind == "gave-up":
            return "the client gives up for now; the operation stays [bold]pending[/] in its store"
        if e.kind == "done":
            return f"operation marked [bold]done[/] in the store (payment {e.detail})"
        return None

    def responses(self, phase: str) -> list[Event]:
        return [e for p, e in self.events if p == phase and e.kind in ("response", "transport-error")]


def step(out: Console, number: int, title: str) -> None:
    out.print()
    out.rule(f"[bold]{number} · {title}", align="left")


def run_point(system: System, point: str, mode: str, out: Console, store: Path) -> Outcome:
    """Crash at `point`, resume by `mode`, and return the evidence. Never raises for expected events."""
    started = time.monotonic()
    outcome = Outcome(point, mode)
    try:
        _run(system, point, mode, out, store, outcome)
    except (DemoError, PaymentsError, httpx.HTTPError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
        out.print(Panel(outcome.error, title="the demo could not go on", border_style="red"))
    outcome.seconds = time.monotonic() - started
    return outcome


def _run(system: System, point: str, mode: str, out: Console, store: Path, outcome: Outcome) -> None:
    reference = f"order-{uuid.uuid4().hex[:8]}"
    operation_id = f"checkout-{reference}"
    body = payment_body(reference)
    rejected = "EXT3" in point

    out.print(Panel(
        f"[bold]{POINTS[point]}[/]\n\nThe API process dies at [bold]{point}[/] (os._exit: no clean-up, no "
        f"response), exactly as a SIGKILL or a power cut would leave it.\nResume by [bold]{mode}[/]: {MODES[mode]}.",
        title=f"kill between phases: {point}", border_style="blue"))

    step(out, 1, "Start the system")
    if rejected:
        system.reject_payouts(reference)
    doomed = system.api(crash_at=point, name="api-doomed")
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_row("PostgreSQL", system.database_label)
    table.add_row("fake PSP", system.psp.url)
    table.add_row("fake rail", system.rail.url + (f"   fault: [bold]reject[/] transfers for {reference} "
                                                  "(to reach the refund, EXT3)" if rejected else ""))
    table.add_row("API", f"{doomed.url}   PAYMENTS_CRASH_AT={point}  LEASE_SECONDS={DOOMED_LEASE_SECONDS}")
    table.add_row("client store", str(store))
    out.print(table)

    step(out, 2, "One payment through PaymentsClient")
    log = ClientLog(out, store)
    log.phase = "first"
    out.print(f"  paying {body['amount']} {body['currency']} for [bold]{reference}[/] to {body['beneficiary']['name']}"
              " (this client gives up after one attempt, as if it crashed too)")
    with PaymentsClient(doomed.url, system.api_key, store, max_attempts=1, on_event=log) as client:
        try:
            answer = client.pay(operation_id, body)
            out.print(f"  [red]unexpected: the API answered ({answer.get('status')}) instead of dying[/]")
        except RetriesExhausted:
            pass
        key = client.key_for(operation_id)
    code = doomed.wait(10)
    if code is None:
        doomed.stop()
    out.print(Panel(
        f"API process exited with code [bold]{code}[/]" + (" (killed at the crash point, as expected)" if code == 137
                                                           else " [red](expected 137)[/]")
        + f"\n[dim]{doomed.tail(1)}[/]\nThe client's connection dropped with no response: it cannot know "
        "what happened, only that it must retry with the same key.",
        title="expected: the API died mid-request", border_style="yellow"))
    outcome.check("API died at the crash point", "exit 137", f"exit {code}")

    step(out, 3, "What is durable after the crash")
    after = snapshot(system, key, reference)
    outcome.left = after.key["recovery_point"] if after.key else "(no key row)"
    show_durable(out, after)
    out.print(Panel(RESUME.get(point, POINTS[point]), title="what a resumer must do", border_style="blue"))
    outcome.check("recovery point left behind", left_behind(point), outcome.left)

    step(out, 4, f"Resume ({mode})")
    if mode == "retry":
        api = system.api(port=doomed.port, name="api")
        out.print(f"  API restarted on the same port ({api.url}), without a crash point")
        out.print("  the client restarts too: a new PaymentsClient on the same store file")
        if after.lease_left and after.lease_left > 0:
            out.print(f"  [dim](the dead owner's lease had {after.lease_left:.1f} s left at step 3: until it "
                      "runs out a retry is answered 409 request-in-progress with Retry-After)[/]")
    else:
        if after.key and after.key["state"] == "finished":
            out.print("  the key row is already finished: the worker has nothing to do")
            outcome.resumed_by = "none needed; replay"
        else:
            worker = system.worker()
            out.print("  recovery worker started (WORKER_MIN_AGE_SECONDS=0, WORKER_POLL_SECONDS=0.2); "
                      "it may take over once the dead owner's lease has run out")
            waited = wait_finished(system, key, out)
            worker.stop()
            row = snapshot(system, key, reference).key
            out.print(f"  the worker finished it after {waited:.1f} s (attempt {row['attempts']}); worker stopped")
            outcome.resumed_by = "worker; replay"
        api = system.api(port=doomed.port, name="api")
        out.print(f"  API started on the same port ({api.url}) for the client's retry")
    outcome.api_url = api.url
    log.phase = "resume"
    with PaymentsClient(api.url, system.api_key, store, max_attempts=10, max_seconds=20, on_event=log) as client:
        result = client.pay(operation_id, body)
        record = client.store.get(operation_id)
    out.print(f"  final answer: payment [bold]{result['id']}[/] status [bold]{result['status']}[/]")
    if mode == "retry":
        tries = log.responses("resume")
        busy = sum(1 for e in tries if e.status == 409)
        last = tries[-1]
        outcome.resumed_by = "retry: " + (f"409 ×{busy}, " if busy else "") + (
            "replay" if last.replayed else str(last.status))

    step(out, 5, "Timeline and exactly-once evidence")
    final = outcome.final = snapshot(system, key, reference)
    show_timeline(out, final, log)
    replay = httpx.post(f"{api.url}/v1/payments", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {system.api_key}", "Idempotency-Key": key})
    stored = final.key["response_body"] if final.key else None
    outcome.replay_identical = (replay.headers.get("Idempotent-Replayed") == "true" and replay.text == stored
                                and record.get("response_text") == stored)
    ok_status = "failed" if rejected else "succeeded"
    outcome.check("payments for the reference", 1, len(final.payments))
    outcome.check("payment status", ok_status, final.payment["status"] if final.payment else "-")
    outcome.check("charges at the PSP", 1, len(final.charges))
    outcome.check("transfers at the rail", 1, len(final.transfers))
    outcome.check("refunds at the PSP", 1 if rejected else 0, len(final.refunds))
    outcome.check("ledger balanced (debits = credits)", "balanced",
                  f"{final.debits} = {final.credits}" if final.balanced else f"{final.debits} != {final.credits}",
                  final.balanced and bool(final.ledger))
    outcome.check("ledger entries", 6 if rejected else 5, len(final.ledger))
    outcome.check("key row", "finished, 201 stored",
                  f"{final.key['state']}, {final.key['response_code'] or '-'} stored" if final.key else "missing")
    outcome.check("replay of the same request", "201, replayed, byte-identical",
                  f"{replay.status_code}, " + ("replayed" if replay.headers.get("Idempotent-Replayed") == "true"
                                               else "not replayed") + ", "
                  + ("byte-identical" if outcome.replay_identical else "different bytes"))
    show_checks(out, outcome)


def wait_finished(system: System, key: str, out: Console, timeout: float = 60) -> float:
    started = time.monotonic()
    with out.status("waiting for the worker to finish the payment (polling the key row)"):
        while True:
            row = system.db.fetchrow("SELECT state, parked_at FROM idempotency_key WHERE client_id = $1 AND key = $2",
                                     system.client_id, key)
            if row and row["state"] == "finished":
                return time.monotonic() - started
            if row and row["parked_at"] is not None:
                raise DemoError("the operation was parked for reconciliation instead of finished")
            if time.monotonic() - started > timeout:
                raise DemoError(f"the worker did not finish the payment within {timeout:.0f} s")
            time.sleep(0.1)


def show_durable(out: Console, s: Snapshot) -> None:
    key = Table(title="key row (idempotency_key)", title_justify="left", show_header=False)
    if s.key:
        lease = f"live, {s.lease_left:.1f} s left" if s.lease_left and s.lease_left > 0 else (
            "expired" if s.key["lease_expires_at"] else "none")
        for name, value in (("state", s.key["state"]), ("recovery_point", f"[bold]{s.key['recovery_point']}[/]"),
                            ("attempts", s.key["attempts"]), ("lease", lease),
                            ("response stored", "yes" if s.key["response_body"] else "no")):
            key.add_row(name, str(value))
    else:
        key.add_row("(none)", "")
    pay = Table(title="payment row", title_justify="left", show_header=False)
    if s.payment:
        p = s.payment
        for name in ("status", "psp_charge_id", "rail_transfer_id", "reject_reason", "psp_refund_id"):
            pay.add_row(name, str(p[name] or "-"))
    else:
        pay.add_row("payments", str(len(s.payments)))
    ext = Table(title="what the PSP and the rail recorded", title_justify="left")
    ext.add_column("record")
    ext.add_column("n", justify="right")
    ext.add_column("details")
    for name, rows in (("PSP charges", s.charges), ("PSP refunds", s.refunds), ("rail transfers", s.transfers)):
        ext.add_row(name, str(len(rows)), ", ".join(f"{r['id'][:12]}… {r['status']}" for r in rows) or "-")
    out.print(Columns([key, pay], padding=(0, 4)))
    out.print(Group(ext, ledger_table(s, "ledger entries")))


def ledger_table(s: Snapshot, title: str) -> Table:
    ledger = Table(title=title, title_justify="left", show_footer=bool(s.ledger))
    for column in ("posting", "account", "debit", "credit"):
        right = column in ("debit", "credit")
        footer = {"account": "total", "debit": str(s.debits), "credit": str(s.credits)}.get(column, "")
        ledger.add_column(column, footer=footer, justify="right" if right else "left")
    for e in s.ledger:
        ledger.add_row(e["posting"], e["account"], str(e["debit_minor"] or ""), str(e["credit_minor"] or ""))
    if not s.ledger:
        ledger.add_row("(none)", "", "", "")
    return ledger


def show_timeline(out: Console, s: Snapshot, log: ClientLog) -> None:
    attempts = Table(title="the client's attempts (one key throughout)", title_justify="left")
    for column in ("when", "attempt", "answer", "Retry-After", "Idempotent-Replayed"):
        attempts.add_column(column)
    for phase, label in (("first", "first run"), ("resume", "after restart")):
        for e in log.responses(phase):
            answer = f"{e.status} {e.problem or ''}".strip() if e.kind == "response" else Text(
                (e.detail or "").split(":")[0], style="yellow")
            attempts.add_row(label, str(e.attempt), answer,
                             f"{e.retry_after:g} s" if e.retry_after is not None else "-",
                             "true" if e.replayed else "-")
    timeline = Table(title="the key row's timeline (database clock)", title_justify="left")
    for column in ("at", "event", "recovery point", "attempt"):
        timeline.add_column(column)
    for at, entry in zip(relative_times(s.timeline), s.timeline):
        timeline.add_row(at, entry["event"], entry["recovery_point"], str(entry["attempt"]))
    out.print(Group(attempts, timeline, ledger_table(s, "the ledger now")))


def show_checks(out: Console, outcome: Outcome) -> None:
    table = Table(title="exactly-once evidence", title_justify="left")
    for column in ("check", "expected", "actual", ""):
        table.add_column(column)
    for what, expected, actual, ok in outcome.checks:
        table.add_row(what, expected, actual, "[green]ok[/]" if ok else "[red]FAIL[/]")
    out.print(table)
