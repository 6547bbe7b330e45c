"""`python -m demos.refund_race` (`make demo-refund-race`): fifty refunds of one payment at once, over two APIs.

    1. A client pays 10,000: the card is charged, the net paid out, `succeeded`.
    2. The PSP's own over-refund guard is switched off (its fault
       `allow_over_refund`): it would now record any refund we asked for,
       past the charge's balance, and flag it `over_refund`. Only our own
       reservation (app/payments/refunds/phases.py: a conditional write on
       the payment's refunded amount, under its row lock) stands between the
       race and an over-refund.
    3. Fifty refunds of 300 (15,000 in all), each with its own key and
       reference, fired at once, alternately at two API processes that share
       the database and nothing else. One line per refund: its number, the
       API it went to, the status code, the refund's status or the problem's
       type, its amount.
    4. The sums, from durable state: the PSP's refunds of the charge (and how
       many are `over_refund`), our refund rows, the ledger's refund
       postings, and the payment's refunded amount against its charge. 33
       refunds fit (9,900); the other 17 are refused with 409
       refund-exceeds-payment.

Everything runs as real processes (see demos.system). Exit status 0 on PASS, 1 on FAIL.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import typer

from demos.story import step, terminal
from demos.system import CheckedDemo, System, payment_body, run_demo

console = terminal()
AMOUNT, REFUND, REFUNDS = 10_000, 300, 50


async def race(urls: list[str], auth: dict[str, str], payment_id: str) -> list[tuple[int, str, httpx.Response]]:
    """Every refund at once, refund n at API n mod 2; (n, the API's name, the answer)."""
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=REFUNDS)) as http:
        async def one(n: int) -> tuple[int, str, httpx.Response]:
            api = urls[n % 2]
            response = await http.post(
                f"{api}/v1/payments/{payment_id}/refunds", json={"amount": REFUND, "reference": f"race-{n}"},
                headers={**auth, "Idempotency-Key": str(uuid.uuid4())},
            )
            return n, "api-a" if n % 2 == 0 else "api-b", response

        return list(await asyncio.gather(*(one(n) for n in range(REFUNDS))))


class Demo(CheckedDemo):
    def run(self) -> None:
        system, db = self.system, self.db
        apis = [system.api(name="api-a"), system.api(name="api-b")]
        auth = {"Authorization": f"Bearer {system.api_key}"}

        step(console, 1, f"a payment of {AMOUNT}")
        paid = self.http.post(apis[0].url + "/v1/payments", json=payment_body(amount=AMOUNT),
                              headers={**auth, "Idempotency-Key": str(uuid.uuid4())})
        payment = paid.json()
        console.print(f"POST /v1/payments -> {paid.status_code}, status [bold]{payment['status']}[/], "
                      f"payment {payment['id']}")
        self.checks.check("the payment", "succeeded", payment["status"])

        step(console, 2, "the PSP's own over-refund guard switched off")
        self.http.put(system.psp.url + "/_admin/faults", json={"faults": [
            {"action": "allow_over_refund", "operation": "refund", "times": None}]}).raise_for_status()
        console.print("fake-psp fault plan: allow_over_refund on every refund: it records whatever it is asked")

        step(console, 3, f"{REFUNDS} refunds of {REFUND} at once ({REFUNDS * REFUND} in all), over two APIs")
        answers = asyncio.run(race([api.url for api in apis], auth, payment["id"]))
        for n, api, response in answers:
            body = response.json()
            what = body["status"] if response.status_code in (201, 202) else body.get("type", "?")
            amount = body.get("amount", "-") if response.status_code in (201, 202) else "-"
            console.print(f"refund {n:2d}  {api}  {response.status_code}  {what:<36} {amount}")

        step(console, 4, "the sums, from durable state")
        pid = uuid.UUID(payment["id"])
        row = db.fetchrow("SELECT amount_minor, refunded_minor, psp_charge_id FROM payment WHERE id = $1", pid)
        at_psp = db.fetchrow(
            "SELECT count(*) AS n, coalesce(sum(amount), 0)::bigint AS total,"
            " count(*) FILTER (WHERE over_refund) AS over FROM fake_psp.refund WHERE charge_id = $1",
            row["psp_charge_id"])
        ours = db.fetchrow(
            "SELECT count(*) AS n, coalesce(sum(amount_minor), 0)::bigint AS total FROM refund"
            " WHERE payment_id = $1 AND status = 'succeeded'", pid)
        posted = db.fetchrow(
            "SELECT count(DISTINCT posting) AS n, coalesce(sum(debit_minor), 0)::bigint AS total"
            " FROM ledger_entry WHERE payment_id = $1 AND posting LIKE 'refund:%'", pid)
        unbalanced = db.fetchval(
            "SELECT count(*) FROM (SELECT payment_id FROM ledger_entry GROUP BY payment_id"
            " HAVING sum(debit_minor) <> sum(credit_minor)) AS u")
        console.print(f"at the PSP:      {at_psp['n']} refunds, {at_psp['total']} in all, "
                      f"{at_psp['over']} over_refund")
        console.print(f"our refund rows: {ours['n']} succeeded, {ours['total']} in all")
        console.print(f"the ledger:      {posted['n']} refund postings, {posted['total']} in all")
        console.print(f"the payment:     {row['refunded_minor']} refunded of its {row['amount_minor']} charge")

        fits = AMOUNT // REFUND
        codes = [(r.status_code, r.json().get("type") or r.json().get("status")) for _, _, r in answers]
        self.checks.check("answered 201 succeeded", fits, codes.count((201, "succeeded")))
        self.checks.check("answered 409 refund-exceeds-payment", REFUNDS - fits,
                          codes.count((409, "/problems/refund-exceeds-payment")))
        self.checks.check("refunded at the PSP", fits * REFUND, at_psp["total"])
        self.checks.check("refunds the PSP recorded past the balance (over_refund)", 0, at_psp["over"])
        self.checks.check("our succeeded refunds", (fits, fits * REFUND), (ours["n"], ours["total"]))
        self.checks.check("the ledger's refund postings", (fits, fits * REFUND), (posted["n"], posted["total"]))
        self.checks.check("the payment's refunded amount", fits * REFUND, row["refunded_minor"])
        self.checks.check("within the charge", True, row["refunded_minor"] <= row["amount_minor"])
        self.checks.check("unbalanced payments in the ledger", 0, unbalanced)
        console.print(self.checks.table("checks"))


def main() -> None:
    """Fifty refunds of one payment at once over two APIs, the PSP's guard off: never more than the charge."""
    run_demo(
        console, System(), Demo, name="refund race",
        starting="starting PostgreSQL, the payments_demo database and the fakes",
        passed=f"{REFUNDS} refunds raced over two APIs, {AMOUNT // REFUND} refunded, never past the charge",
        start_args=("--cutoff", "24:00"),
    )


if __name__ == "__main__":
    typer.run(main)
