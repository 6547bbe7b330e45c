"""`python -m demos.naive_crash`: the same crash, against the naive twin and the real service.

The card is charged and then the process dies before answering: the classic
"debited, then crashed" moment. The client does what every client must do with
no answer: it retries the same payment.

    the naive twin (naive_twin/)   no key, no recovery point: the retry is a new
                                   payment, and the PSP charges the card again.
    the real service               the retry carries the same Idempotency-Key;
                                   the resumer probes the PSP by K1, finds the
                                   charge, records it, and pays out once.

Exit code 0 when the story came out as told (the twin charged twice, the
service once), 1 otherwise.
"""

from __future__ import annotations

import time
import uuid

import httpx
import typer
from rich.panel import Panel
from rich.table import Table

from demos.story import step, terminal
from demos.system import DemoError, System, payment_body, session

console = terminal()


def charges(system: System, reference: str) -> list:
    return system.db.fetch(
        "SELECT id, idempotency_key, amount, status, created_at FROM fake_psp.charge WHERE reference = $1 "
        "ORDER BY created_at", reference,
    )


def charge_table(rows, title: str) -> Table:
    table = Table(title=title)
    for column in ("charge", "idempotency key sent", "amount", "status"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["id"], r["idempotency_key"][:24] + "…", str(r["amount"]), r["status"])
    return table


def first_attempt_dies(system: System, url: str, headers: dict[str, str], body: dict) -> None:
    try:
        httpx.post(f"{url}/v1/payments", json=body, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        console.print(f"  client> attempt 1: [yellow]no answer[/] ({type(exc).__name__}): the process died")
    else:
        raise DemoError("the first attempt was answered; the crash did not happen")


def retry_until_answered(url: str, body: dict, headers: dict[str, str], attempt: int = 1) -> httpx.Response:
    """Retry as a client is told to: while the answer is a 409, wait its Retry-After and try again (a minute at most)."""
    deadline = time.monotonic() + 60
    while True:
        attempt += 1
        retry = httpx.post(f"{url}/v1/payments", json=body, headers=headers, timeout=30)
        console.print(f"  client> attempt {attempt}: {retry.status_code}"
                      + (f"  Retry-After: {retry.headers['Retry-After']} s" if retry.status_code == 409 else ""))
        if retry.status_code != 409 or time.monotonic() > deadline:
            return retry
        time.sleep(float(retry.headers.get("Retry-After", "1")))  # what a client is told to do


def charges_now(system: System, reference: str, said: str, *, safe: bool) -> int:
    """The PSP's charges for `reference` now, and what they mean (`said`), in green if `safe`, else red; how many."""
    rows = charges(system, reference)
    console.print(charge_table(rows, "the PSP now"))
    colour = "green" if safe else "red"
    console.print(Panel(f"[bold {colour}]{len(rows)} charge{'' if len(rows) == 1 else 's'}[/]{said}",
                        border_style=colour))
    return len(rows)


def verdict(twin: str, twin_charges: int, real_charges: int) -> None:
    """PASS (exit 0) if the twin charged twice and the service once for the same crash, else FAIL (exit 1)."""
    ok = twin_charges == 2 and real_charges == 1
    console.print(("[green]PASS[/]" if ok else "[red]FAIL[/]") + f" the {twin} charged {twin_charges} times, "
                  f"the real service {real_charges} time(s), for the same crash")
    raise typer.Exit(0 if ok else 1)


def naive_story(system: System) -> int:
    step(console, 1, "THE NAIVE TWIN: charge, then crash")
    reference = f"order-{uuid.uuid4().hex[:8]}"
    body = payment_body(reference)
    auth = {"Authorization": f"Bearer {system.api_key}"}
    doomed = system.naive_api(name="naive-doomed", env={"NAIVE_CRASH_AFTER_CHARGE": "1"})
    first_attempt_dies(system, doomed.url, auth, body)
    console.print(f"  naive twin exited with code {doomed.wait(10)}")
    console.print(charge_table(charges(system, reference), "the PSP after the crash: the card is charged"))

    step(console, 2, "THE NAIVE TWIN: the client retries the same payment")
    naive = system.naive_api()
    retry = httpx.post(f"{naive.url}/v1/payments", json=body, headers=auth, timeout=30)
    console.print(f"  client> attempt 2: {retry.status_code} {retry.json().get('status')}")
    return charges_now(system, reference, " for one order. Each attempt sent the PSP a fresh idempotency key, "
                       "so the PSP could not see a retry; and the twin kept no key of its own, so neither could it.",
                       safe=False)


def service_story(system: System) -> int:
    step(console, 3, "THE REAL SERVICE: the same crash (PAYMENTS_CRASH_AT=after-call-EXT1)")
    reference = f"order-{uuid.uuid4().hex[:8]}"
    body = payment_body(reference)
    headers = {"Authorization": f"Bearer {system.api_key}", "Idempotency-Key": str(uuid.uuid4())}
    doomed = system.api(crash_at="after-call-EXT1", name="api-doomed")
    first_attempt_dies(system, doomed.url, headers, body)
    console.print(f"  API exited with code {doomed.wait(10)}")
    console.print(charge_table(charges(system, reference), "the PSP after the crash: the card is charged"))

    step(console, 4, "THE REAL SERVICE: the client retries with the same key")
    retry_until_answered(system.api().url, body, headers)
    return charges_now(system, reference, ". The retry took the dead attempt's place, probed the PSP by K1, "
                       "found the charge it had made, recorded it and paid out: once.", safe=True)


def main() -> None:
    with session(console, System()) as system:
        naive = naive_story(system)
        real = service_story(system)
    verdict("naive twin", naive, real)


if __name__ == "__main__":
    typer.run(main)
