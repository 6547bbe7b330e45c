"""The exactly-once check, after every run: a fast wrong answer does not pass.

What the databases say happened must be what exactly-once promises, for the
payments of the run just measured (each has a reference of its own, and a
card that is never declined, so a second charge or transfer for a reference
is a duplicate):

    every 201 has its payment row, and it says succeeded;
    payments = PSP charges = rail transfers, over every reference sent;
    no reference charged twice, none paid out twice;
    the amounts charged and paid out are the payment's;
    every payment's ledger entries balance;
    (phased) every 201 is stored with its key, finished, byte for byte,
    and after the replays: every replay got those bytes back, and no replay
    charged or paid out anything.

After the refund round, for the refunds sent (each has a reference of its
own, so a second PSP refund for a reference is a duplicate):

    every 201 `succeeded` has its refund row, succeeded, for that payment
    and amount;
    refunds recorded = PSP refunds = refunds answered, none twice;
    the amounts the PSP refunded are the refunds';
    every refund has its `refund:<id>` posting, and it balances;
    each refunded payment's refunded amount is its refunds' sum;
    every 201 is stored with its key, finished, byte for byte.

The naive twin is checked the same way, in its own tables (`naive.payment`,
`naive.ledger_entry`). It passes too: in a run without faults nothing is
retried, so even code with no protection charges once. Its failures need a
crash or a lost response (`make demo-naive-crash`); the bench checks it so
that its figures, too, are of work actually done.

The fakes keep their records in another database, so the comparison is made
here, from both. Any FAIL makes the bench exit with status 1.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import asyncpg

from bench.load import Paid, Refunded, RunResult
from bench.system import NAIVE


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


async def _fetch(url: str, *queries: tuple[str, tuple]) -> list[list[asyncpg.Record]]:
    conn = await asyncpg.connect(url)
    try:
        return [await conn.fetch(sql, *args) for sql, args in queries]
    finally:
        await conn.close()


async def _charges_and_transfers(rails_url: str, references: list[str]) -> tuple[Counter, Counter, list, list]:
    charges, transfers = await _fetch(
        rails_url,
        ("SELECT c.reference, c.amount FROM fake_psp.charge c "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference)", (references,)),
        ("SELECT t.reference, t.amount FROM fake_rail.transfer t "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference)", (references,)),
    )
    return Counter(r["reference"] for r in charges), Counter(r["reference"] for r in transfers), charges, transfers


async def exactly_once(variant: str, service_url: str, rails_url: str, client_id: int, run: RunResult) -> list[Check]:
    schema = "naive" if variant == NAIVE else "public"  # the phased service, watched or not: public
    answered = {p.reference: p for p in run.paid}
    sent = run.references
    payments, ledger, stored = await _fetch(
        service_url,
        (f"SELECT p.reference, p.id, p.status, p.amount_minor, p.net_minor FROM {schema}.payment p "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference) WHERE p.client_id = $2", (sent, client_id)),
        (f"SELECT l.payment_id, sum(l.debit_minor) AS debits, sum(l.credit_minor) AS credits "
         f"FROM {schema}.ledger_entry l JOIN {schema}.payment p ON p.id = l.payment_id "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference) WHERE p.client_id = $2 GROUP BY l.payment_id",
         (sent, client_id)),
        ("SELECT k.key, k.state, k.response_code, k.response_body FROM idempotency_key k "
         "JOIN unnest($1::text[]) AS r(key) USING (key) WHERE k.client_id = $2",
         ([p.key for p in run.paid], client_id)) if variant != NAIVE else ("SELECT 1 WHERE false", ()),
    )
    charged, paid_out, charges, transfers = await _charges_and_transfers(rails_url, sent)

    succeeded = {r["reference"] for r in payments if r["status"] == "succeeded"}
    found = sum(1 for ref in answered if ref in succeeded)
    payment_of = {r["reference"]: r for r in payments}
    wrong_amounts = sum(1 for c in charges if c["reference"] in payment_of
                        and c["amount"] != payment_of[c["reference"]]["amount_minor"])
    wrong_amounts += sum(1 for t in transfers if t["reference"] in payment_of
                         and t["amount"] != payment_of[t["reference"]]["net_minor"])
    balanced = {r["payment_id"] for r in ledger if r["debits"] == r["credits"]}
    unbalanced = len(ledger) - len(balanced)
    posted = {row["payment_id"] for row in ledger}
    unposted = sum(1 for r in payments if r["id"] not in posted)
    by_status = dict(Counter(r["status"] for r in payments))

    checks = [
        Check("every 201 has its payment, succeeded", found == len(answered) == run.succeeded,
              f"{run.succeeded} answered 201, {found} found succeeded"),
        Check("payments = PSP charges = rail transfers", len(payments) == len(charges) == len(transfers),
              f"{len(payments)} = {len(charges)} = {len(transfers)} for {len(sent)} requests sent; {by_status}"),
        Check("no reference charged twice", all(n == 1 for n in charged.values()),
              f"{sum(1 for n in charged.values() if n > 1)} references"),
        Check("no reference paid out twice", all(n == 1 for n in paid_out.values()),
              f"{sum(1 for n in paid_out.values() if n > 1)} references"),
        Check("amounts charged and paid out are the payment's", wrong_amounts == 0, f"{wrong_amounts} differ"),
        Check("ledger balances per payment", unbalanced == 0 and unposted == 0,
              f"{unbalanced} unbalanced, {unposted} payments without entries"),
    ]
    if variant != NAIVE:
        by_key = {p.key: p for p in run.paid}
        kept = sum(1 for r in stored if r["state"] == "finished" and r["response_code"] == 201
                   and r["response_body"].encode() == by_key[r["key"]].response)
        checks.append(Check("every 201 stored with its key, finished, byte for byte", kept == len(by_key),
                            f"{kept} of {len(by_key)}"))
    return checks


async def replays_check(rails_url: str, replays: RunResult, replayed: list[Paid]) -> list[Check]:
    references = [p.reference for p in replayed]
    charged, paid_out, _, _ = await _charges_and_transfers(rails_url, references)
    wrong = replays.requests - replays.succeeded
    once = all(charged[r] == 1 and paid_out[r] == 1 for r in references)
    return [
        Check("every replay got the stored 201 back, byte for byte", wrong == 0 and replays.succeeded > 0,
              f"{replays.succeeded} replayed, {wrong} did not: {dict(replays.statuses)}"),
        Check("replays charged and paid out nothing", once,
              f"{len(references)} keys replayed; each still has exactly one charge and one transfer: {once}"),
    ]


async def refunds_check(service_url: str, rails_url: str, client_id: int, run: RunResult) -> list[Check]:
    """The refund round's durable outcome, from the service's database and the fake PSP's."""
    sent = run.references
    refunds, postings, payments, stored = await _fetch(
        service_url,
        ("SELECT f.reference, f.id, f.payment_id::text, f.status, f.amount_minor FROM refund f "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference) WHERE f.client_id = $2", (sent, client_id)),
        ("SELECT l.posting, sum(l.debit_minor) AS debits, sum(l.credit_minor) AS credits FROM ledger_entry l "
         "JOIN refund f ON l.posting = 'refund:' || f.id::text AND l.payment_id = f.payment_id "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference) WHERE f.client_id = $2 GROUP BY l.posting",
         (sent, client_id)),
        # Every refund of the payments refunded, not only this run's: the
        # refunded amount must be all of them, and nothing else.
        ("SELECT p.id::text, p.refunded_minor, coalesce(sum(f.amount_minor) FILTER (WHERE f.status <> 'failed'), 0) "
         "AS refunds_minor FROM payment p LEFT JOIN refund f ON f.payment_id = p.id "
         "WHERE p.id = ANY($1::uuid[]) GROUP BY p.id", (sorted({r.payment_id for r in run.refunded}),)),
        ("SELECT k.key, k.state, k.response_code, k.response_body FROM idempotency_key k "
         "JOIN unnest($1::text[]) AS r(key) USING (key) WHERE k.client_id = $2",
         ([r.key for r in run.refunded], client_id)),
    )
    (psp,) = await _fetch(
        rails_url,
        ("SELECT f.reference, f.amount, f.status FROM fake_psp.refund f "
         "JOIN unnest($1::text[]) AS r(reference) USING (reference)", (sent,)),
    )
    return refund_checks(run.refunded, len(sent), refunds, postings, payments, stored, psp)


def refund_checks(answered: list[Refunded], sent: int, refunds: list, postings: list, payments: list,
                  stored: list, psp: list) -> list[Check]:
    """The refund checks, from the rows found: `refunds` (reference, id, payment_id, status,
    amount_minor), `postings` (posting, debits, credits), `payments` (id, refunded_minor, refunds_minor),
    `stored` key rows (key, state, response_code, response_body), `psp` (reference, amount, status)."""
    by_reference = {r["reference"]: r for r in refunds}
    found = sum(1 for a in answered if (r := by_reference.get(a.reference)) is not None and r["status"] == "succeeded"
                and r["payment_id"] == a.payment_id and r["amount_minor"] == a.amount)
    at_psp = Counter(p["reference"] for p in psp)
    psp_wrong = sum(1 for p in psp if p["reference"] in by_reference
                    and (p["amount"] != by_reference[p["reference"]]["amount_minor"] or p["status"] != "succeeded"))
    balanced = {p["posting"] for p in postings if p["debits"] == p["credits"]}
    unposted = sum(1 for r in refunds if r["status"] == "succeeded" and f"refund:{r['id']}" not in balanced)
    off = sum(1 for p in payments if p["refunded_minor"] != p["refunds_minor"])
    by_key = {a.key: a for a in answered}
    refunded = {a.payment_id for a in answered}
    kept = sum(1 for k in stored if k["state"] == "finished" and k["response_code"] == 201
               and k["key"] in by_key and k["response_body"].encode() == by_key[k["key"]].response)
    by_status = dict(Counter(r["status"] for r in refunds))
    return [
        Check("every refund's 201 has its refund, succeeded, of that payment and amount",
              found == len(answered) and bool(answered), f"{len(answered)} answered 201 succeeded, {found} found"),
        Check("refunds = PSP refunds = refunds answered", len(refunds) == sum(at_psp.values()) == len(answered),
              f"{len(refunds)} = {sum(at_psp.values())} = {len(answered)} for {sent} sent; {by_status}"),
        Check("no reference refunded twice at the PSP", all(n == 1 for n in at_psp.values()),
              f"{sum(1 for n in at_psp.values() if n > 1)} references"),
        Check("amounts the PSP refunded are the refunds'", psp_wrong == 0, f"{psp_wrong} differ or not succeeded"),
        Check("ledger: every refund posted once, balanced", unposted == 0 and len(balanced) == len(postings),
              f"{unposted} succeeded refunds without a balanced posting, "
              f"{len(postings) - len(balanced)} unbalanced postings"),
        Check("each payment's refunded amount is its refunds' sum", off == 0 and len(payments) == len(refunded),
              f"{off} of {len(payments)} payments differ; {len(refunded)} payments refunded"),
        Check("every refund's 201 stored with its key, finished, byte for byte", kept == len(by_key),
              f"{kept} of {len(by_key)}"),
    ]
