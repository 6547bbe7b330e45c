"""`python -m demos.client_bug`: the classic client bug, and the client that does not have it.

Part 1: the API dies at after-call-EXT1 (card charged, response lost) and
`buggy_pay` retries with a *fresh* key and the same reference. The server
cannot see a retry in that; what saves the payer is the per-client reference
uniqueness: 409 duplicate-payment, naming the first payment, and still one
charge. The client is wrong all the same: its merchant is told "error" for an
order whose card was charged, and the key that could say what happened is lost.

Part 2: the same crash with `PaymentsClient`: its key was saved before the
first attempt, the restarted client resends it, and the payment completes once.

Epilogue: the recovery worker finishes part 1's stranded payment server-side.
"""

from __future__ import annotations

import json
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import typer
from rich.panel import Panel
from rich.table import Table

from demos.evidence import snapshot
from demos.story import ClientLog, show_durable, step, terminal, wait_finished
from demos.system import DemoError, Proc, System, free_port, payment_body, session
from payments_client import Event, PaymentsClient, ProblemError, RetriesExhausted, buggy_pay

POINT = "after-call-EXT1"
console = terminal()


def crashed(doomed: Proc) -> int | None:
    code = doomed.wait(10)
    console.print(Panel(
        f"API process exited with code [bold]{code}[/]: it died at {POINT} (the PSP charged the card; "
        f"the charge is not recorded, and no response was sent)\n[dim]{doomed.tail(1)}[/]",
        title="expected: the API died mid-request", border_style="yellow"))
    return code


def part1(system: System, port: int, checks: list[tuple[str, bool]]) -> tuple[str, str, Proc]:
    """The buggy client; returns the first attempt's key, the payment it made, and the live API."""
    reference = f"order-{uuid.uuid4().hex[:8]}"
    body = payment_body(reference)
    step(console, 1, "The bug: a fresh Idempotency-Key inside the retry loop (payments_client.buggy_pay)")
    doomed = system.api(crash_at=POINT, port=port, name="api-doomed")
    console.print(f"  API {doomed.url} with PAYMENTS_CRASH_AT={POINT}; paying 1250 EUR for [bold]{reference}[/]")
    keys: list[str] = []
    live: list[Proc] = []

    def on_event(e: Event) -> None:
        if e.kind == "key-created":
            keys.append(e.key)
            console.print(f"  [dim]buggy>[/] attempt {e.attempt}: new key [cyan]{e.key}[/] "
                          + ("[red](THE BUG: a different key for the same payment)[/]" if e.attempt > 1 else ""))
        elif e.kind == "transport-error":
            console.print(f"  [dim]buggy>[/] attempt {e.attempt}: [yellow]{e.detail}[/]")
            checks.append(("the API died at the crash point (137)", crashed(doomed) == 137))
            live.append(system.api(port=port, name="api"))
            console.print(f"  the API is restarted on the same port ({port}), without a crash point")
        elif e.kind == "response":
            console.print(f"  [dim]buggy>[/] attempt {e.attempt}: [bold]{e.status}[/] {e.problem or ''}")
        elif e.kind == "wait":
            console.print(f"  [dim]buggy>[/]    waiting {e.seconds:.0f} s, then retrying (with yet another key)")

    try:
        result = buggy_pay(f"http://127.0.0.1:{port}", system.api_key, body, attempts=3, wait=1.0,
                           on_event=on_event)
        raise DemoError(f"buggy_pay unexpectedly succeeded: {result.get('status')}")
    except ProblemError as exc:
        console.print(Panel(json.dumps(exc.problem, indent=2), title=f"buggy_pay raised: {exc.status} {exc.type}",
                            border_style="red"))
        problem = exc
    if not live:
        raise DemoError("the API never died, so there was nothing to retry")
    s = snapshot(system, keys[0], reference)
    payment_id = str(s.payment["id"]) if s.payment else ""
    rows = Table(title="the keys buggy_pay sent, as the key table knows them", title_justify="left")
    for column in ("attempt", "key", "key row"):
        rows.add_column(column)
    for n, key in enumerate(keys, 1):
        row = system.db.fetchrow("SELECT state, recovery_point FROM idempotency_key WHERE client_id = $1 AND key = $2",
                                 system.client_id, key)
        rows.add_row(str(n), key, f"{row['state']} at {row['recovery_point']}" if row else
                     "none (refused as a duplicate: nothing was stored)")
    console.print(rows)
    show_durable(console, s)
    console.print(Panel(
        f"The PSP holds [bold]{len(s.charges)}[/] charge for {reference}. Attempt 2 was a new key, so the server could "
        "not know it was a retry: it would have been a new payment and a second charge. What saved the payer is "
        "the second guard, per-client [bold]reference[/] uniqueness: 409 duplicate-payment, naming payment "
        f"{problem.problem.get('payment_id')}.\nThe client is still wrong: it reports an error for an order whose "
        "card was charged, and it threw away the only key that could have told it the outcome.",
        title="what happened", border_style="blue"))
    checks.append(("buggy retry refused as 409 duplicate-payment", problem.type == "duplicate-payment"))
    checks.append(("the problem names the first payment", problem.problem.get("payment_id") == payment_id))
    checks.append(("the PSP has exactly one charge for the order", len(s.charges) == 1))
    checks.append(("one payment for the order", len(s.payments) == 1))
    return keys[0], reference, live[0]


def part2(system: System, port: int, api: Proc, checks: list[tuple[str, bool]]) -> None:
    step(console, 2, "The fix: one key per operation, persisted before the first attempt (PaymentsClient)")
    api.stop()
    reference = f"order-{uuid.uuid4().hex[:8]}"
    operation_id, body = f"checkout-{reference}", payment_body(reference)
    store = Path(tempfile.mkdtemp(prefix="client-")) / "store.json"
    doomed = system.api(crash_at=POINT, port=port, name="api-doomed")
    console.print(f"  the same crash again: API {doomed.url} with PAYMENTS_CRASH_AT={POINT}; "
                  f"paying 1250 EUR for [bold]{reference}[/]")
    log = ClientLog(console, store)
    with PaymentsClient(doomed.url, system.api_key, store, max_attempts=1, on_event=log) as client:
        try:
            client.pay(operation_id, body)
        except RetriesExhausted:
            pass
        key = client.key_for(operation_id)
    checks.append(("the API died at the crash point again (137)", crashed(doomed) == 137))
    record = client.store.get(operation_id)
    console.print(f"  the client process dies too (here: it gives up); its store keeps the key: [dim]{store}[/]\n"
                  f"  {json.dumps({operation_id: {'key': record['key'], 'state': record['state']}})}")
    api = system.api(port=port, name="api")
    console.print("  the API is restarted on the same port; the client restarts and reads its store")
    log.phase = "resume"
    with PaymentsClient(api.url, system.api_key, store, max_seconds=20, on_event=log) as client:
        result = client.pay(operation_id, body)
        stored_text = client.store.get(operation_id)["response_text"]
    s = snapshot(system, key, reference)
    replay = httpx.post(f"{api.url}/v1/payments", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {system.api_key}", "Idempotency-Key": key})
    identical = (replay.headers.get("Idempotent-Replayed") == "true" and replay.text == stored_text
                 == s.key["response_body"])
    table = Table(title="exactly-once evidence", title_justify="left", show_header=False)
    for what, ok in (
        (f"payment {result['id']} status {result['status']}", result["status"] == "succeeded"),
        (f"{len(s.charges)} charge at the PSP, {len(s.transfers)} transfer at the rail",
         len(s.charges) == 1 and len(s.transfers) == 1 and not s.refunds),
        (f"ledger balanced: debits {s.debits} = credits {s.credits}", s.balanced and bool(s.ledger)),
        ("replay: Idempotent-Replayed: true, byte-identical to the stored response", identical),
    ):
        table.add_row(what, "[green]ok[/]" if ok else "[red]FAIL[/]")
        checks.append((what, ok))
    console.print(table)


def epilogue(system: System, key: str, reference: str, checks: list[tuple[str, bool]]) -> None:
    step(console, 3, "Epilogue: the buggy client's order")
    console.print("  its payment is stranded at EXT1_SENT under a key only the server still knows; "
                  "the recovery worker finds it")
    worker = system.worker()
    try:
        waited = wait_finished(system, key, console)
    finally:
        worker.stop()
    s = snapshot(system, key, reference)
    status = s.payment["status"] if s.payment else "-"
    console.print(f"  the worker finished it after {waited:.1f} s: payment status [bold]{status}[/], "
                  f"{len(s.charges)} charge, {len(s.transfers)} transfer")
    checks.append(("the worker completed the buggy client's payment once",
                   status == "succeeded" and len(s.charges) == 1 and len(s.transfers) == 1))
    summary = Table(title="the two clients, same crash", title_justify="left")
    for column in ("", "buggy_pay (key per attempt)", "PaymentsClient (key per operation)"):
        summary.add_column(column)
    summary.add_row("keys sent for one payment", "one per attempt", "one, reused after a restart")
    summary.add_row("what the merchant was told", "[red]409 duplicate-payment (an error)[/]", "201, succeeded")
    summary.add_row("charges at the PSP", "1 (only thanks to reference uniqueness)", "1")
    summary.add_row("how the payment finished", "server-side, by the recovery worker", "by the client's retry")
    console.print(summary)


def main() -> None:
    """Show the fresh-key-per-retry bug next to the client that persists its key."""
    system = System()
    checks: list[tuple[str, bool]] = []
    started = time.monotonic()
    with session(console, system):
        port = free_port()  # the API's port: every restart reuses it, so the clients keep one URL
        key, reference, api = part1(system, port, checks)
        part2(system, port, api, checks)
        epilogue(system, key, reference, checks)
    failed = [what for what, ok in checks if not ok]
    if failed:
        console.print(f"[bold red]FAIL[/] {'; '.join(failed)}")
        raise typer.Exit(1)
    console.print(f"[bold green]PASS[/] the buggy client was refused without a second charge; the correct client "
                  f"finished its payment once ({time.monotonic() - started:.1f} s)")


if __name__ == "__main__":
    typer.run(main)
