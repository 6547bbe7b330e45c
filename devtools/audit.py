"""Development tooling, not the payment path: the soak's audit of every cent, three ways.

Used by devtools/soak.py once its chaos is over and everything has drained
and been reconciled. For every payment a client started it puts side by
side:

1. what the client was finally told (its answer, kept by the soak's client);
2. what we recorded: the payment row, its idempotency key row, its ledger
   entries;
3. what the outside world recorded: the fake PSP's charges and refunds and
   the fake rail's transfers (their own tables, in their own database), and
   the rail's statements.

and lists every disagreement as a violation. `collect` reads the evidence,
`audit` judges it (a pure function of the evidence, so it can be tested on
made-up records), `print_table` shows the outcome.

The three external outcomes a payment can have, read from the PSP and the
rail alone:

    declined    one declined charge, no transfer, no refund
    succeeded   one succeeded charge, one accepted transfer of the net, no refund
    failed      one succeeded charge, no accepted transfer, one refund of the whole amount

Anything else (two charges, two accepted transfers, a refund beside an
accepted transfer, a transfer without a charge) is money moved wrongly.

Payment batches (when the soak uploads them): every row's payment is
audited like a client's payment, its answer being what the batch's report
told the client; and the batches themselves are judged: every row became
exactly the payment its natural key names, a file sent again created
nothing new, every batch reached `batch.completed` exactly once, no row was
left unpaid or dead-lettered.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import date, timedelta
from typing import Any

FINAL = ("succeeded", "declined", "failed")
POSTINGS = {
    "succeeded": {"charge_captured", "payout_sent"},
    "failed": {"charge_captured", "charge_refunded"},
    "declined": set(),
    "indeterminate": {"charge_captured"},
}

# Every check, in the order the table prints them, with what a violation means.
CHECKS = {
    "client_answer": "the client got a final answer (no refusal, no give-up)",
    "no_500": "no answer was a 500 (a lost database is a 503, a misbehaving rail a 502 or 504)",
    "one_payment_row": "one payment row per client payment",
    "charge_once": "at most one charge at the PSP",
    "payout_once": "at most one accepted transfer at the rail",
    "refund_once": "at most one refund, of the whole amount",
    "payout_needs_charge": "no transfer without a succeeded charge",
    "refund_needs_no_payout": "no refund unless the payout was rejected or absent",
    "external_consistent": "the PSP's and the rail's records form one outcome",
    "row_matches_external": "our payment row says what the PSP and the rail did",
    "answer_matches_external": "the client's final answer says what the PSP and the rail did",
    "ledger_balanced": "each payment's ledger balances, with the postings of its outcome",
    "key_finished_or_parked": "each key finished, or parked, after the drain",
    "parked_unsettleable": "no parked payment that reconciliation could have settled",
    "accounts_match": "each ledger account's total equals the outside world's (all payments)",
    "external_has_payment": "each PSP charge and rail transfer belongs to exactly one payment of ours",
    "answer_kept": "each final answer a client got is answered again byte for byte (when asked again)",
}
# The batches' own checks: printed only when the soak uploaded batches.
BATCH_CHECKS = {
    "batch_uploaded": "each batch file was accepted (202)",
    "batch_row_one_payment": "each batch row is the one payment its natural key names",
    "batch_resubmission_nothing_new": "a file sent again is answered by the first upload's payments, nothing new",
    "batch_completed_once": "each batch reached batch.completed exactly once",
    "batch_row_not_stuck": "no batch row left unpaid or dead-lettered",
}


@dataclass
class Evidence:
    """Everything the audit looks at, keyed by the payment's reference (unique per soak)."""

    answers: dict[str, dict[str, Any]]  # reference -> the client's outcome (status, refused, gave_up, ...)
    payments: dict[str, list[dict[str, Any]]]  # reference -> payment rows
    keys: dict[str, dict[str, Any]]  # payment id (str) -> its key row
    ledger: dict[str, list[dict[str, Any]]]  # payment id (str) -> ledger entries
    charges: dict[str, list[dict[str, Any]]]  # reference -> PSP charges
    refunds: dict[str, list[dict[str, Any]]]  # reference -> PSP refunds
    transfers: dict[str, list[dict[str, Any]]]  # reference -> rail transfers
    statements: dict[str, dict[str, Any]]  # YYYY-MM-DD -> the rail's statement
    booking_days: int = 3
    # reference -> {"first": (status, body) the client got, "again": the same request's answer at the
    # end}; None when the soak did not ask again.
    asked_again: dict[str, dict[str, Any]] | None = None
    # The soak's batches (devtools/soak.py::batch_evidence): each one's rows as our database holds them, its
    # completion and events; None when it uploaded none.
    batches: list[dict[str, Any]] | None = None


@dataclass
class Report:
    checked: int = 0
    violations: list[dict[str, Any]] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)  # external outcome -> payments
    answers: Counter = field(default_factory=Counter)  # the client's final answer -> payments
    parked_left: list[str] = field(default_factory=list)  # parked, not settleable: for a person
    accounts: dict[str, dict[str, int]] = field(default_factory=dict)
    batches_checked: int = 0  # 0: no batches, and their checks are not printed
    batch_rows_checked: int = 0  # rows of the batches' first uploads (each a payment among `checked`)

    def violate(self, check: str, reference: str | None, **details: Any) -> None:
        self.violations.append({"check": check, "reference": reference, **details})

    def by_check(self) -> Counter:
        return Counter(v["check"] for v in self.violations)


def external_outcome(charges: list[dict], transfers: list[dict], refunds: list[dict], amount: int | None) -> str:
    """declined | succeeded | failed from the PSP's and the rail's records; `none` or `charged` if
    incomplete (nothing, or a charge and nothing more); `inconsistent` for anything else."""
    succeeded = [c for c in charges if c["status"] == "succeeded"]
    declined = [c for c in charges if c["status"] == "declined"]
    accepted = [t for t in transfers if t["status"] == "accepted"]
    if not charges and not transfers and not refunds:
        return "none"
    if len(charges) != 1 or len(accepted) > 1 or len(refunds) > 1:
        return "inconsistent"
    if declined:
        return "declined" if not transfers and not refunds else "inconsistent"
    assert succeeded
    if accepted:
        return "succeeded" if not refunds else "inconsistent"
    if refunds:
        return "failed" if amount is None or refunds[0]["amount"] == amount else "inconsistent"
    return "charged"


def audit(ev: Evidence) -> Report:
    report = Report()
    booked: dict[str, list[dict]] = defaultdict(list)
    for statement in ev.statements.values():
        for entry in statement["entries"]:
            booked[entry["end_to_end_reference"]].append(entry)

    for reference, answer in sorted(ev.answers.items()):
        report.checked += 1
        charges = ev.charges.get(reference, [])
        transfers = ev.transfers.get(reference, [])
        refunds = ev.refunds.get(reference, [])
        rows = ev.payments.get(reference, [])
        row = rows[0] if len(rows) == 1 else None
        amount = row["amount_minor"] if row else None

        # An indeterminate answer is honest (reconciliation will settle it); the
        # client asks again after reconciliation, so it is final only if that
        # could not settle it either (a break, for a person).
        final = answer.get("final_status") or answer.get("first_status")
        report.answers[final or ("refused" if answer.get("refused") else "none")] += 1
        if answer.get("refused") or answer.get("gave_up") or final not in (*FINAL, "indeterminate"):
            report.violate("client_answer", reference, answer=answer)
        if answer.get("statuses", {}).get("500"):
            report.violate("no_500", reference, statuses=answer["statuses"])
        if len(rows) != 1:
            report.violate("one_payment_row", reference, rows=len(rows))

        if len(charges) > 1:
            report.violate("charge_once", reference, charges=[c["id"] for c in charges])
        accepted = [t for t in transfers if t["status"] == "accepted"]
        if len(accepted) > 1:
            report.violate("payout_once", reference, transfers=[t["id"] for t in accepted])
        if len(refunds) > 1 or (refunds and amount is not None and sum(r["amount"] for r in refunds) != amount):
            report.violate("refund_once", reference, refunds=[(r["id"], r["amount"]) for r in refunds])
        succeeded_charge = any(c["status"] == "succeeded" for c in charges)
        if transfers and not succeeded_charge:
            report.violate("payout_needs_charge", reference, transfers=[t["id"] for t in transfers])
        if refunds and accepted:
            report.violate("refund_needs_no_payout", reference, refunds=[r["id"] for r in refunds],
                           transfers=[t["id"] for t in accepted])

        outcome = external_outcome(charges, transfers, refunds, amount)
        report.outcomes[outcome] += 1
        if outcome == "inconsistent":
            report.violate("external_consistent", reference, charges=len(charges), transfers=len(transfers),
                           refunds=len(refunds))
        if row is None:
            continue
        status = row["status"]
        expected = {"none": None, "charged": "indeterminate"}.get(outcome, outcome)
        if outcome != "inconsistent" and status != expected:
            report.violate("row_matches_external", reference, row_status=status, external=outcome)
        if final in FINAL and outcome != "inconsistent" and final != expected:
            report.violate("answer_matches_external", reference, answer=final, external=outcome)
        if accepted and (accepted[0]["amount"] != row["net_minor"]
                         or accepted[0]["end_to_end_reference"] != row["end_to_end_reference"]):
            report.violate("row_matches_external", reference, transfer=accepted[0]["id"],
                           detail="transfer amount or end-to-end reference differs from the row")

        pid = str(row["id"])
        entries = ev.ledger.get(pid, [])
        debits = sum(e["debit_minor"] for e in entries)
        credits = sum(e["credit_minor"] for e in entries)
        postings = {e["posting"] for e in entries}
        if debits != credits or postings != POSTINGS.get(status, postings):
            report.violate("ledger_balanced", reference, status=status, postings=sorted(postings),
                           debits=debits, credits=credits)

        key = ev.keys.get(pid)
        if key is None or (key["state"] != "finished" and key["parked_at"] is None):
            report.violate("key_finished_or_parked", reference, key_state=key and key["state"], status=status)
        if status == "indeterminate":
            settleable = _settleable(row, booked, ev)
            if settleable:
                report.violate("parked_unsettleable", reference, would_settle_as=settleable,
                               end_to_end_reference=row["end_to_end_reference"])
            else:
                report.parked_left.append(reference)

    for reference in sorted({*ev.charges, *ev.transfers, *ev.refunds}):
        if reference not in ev.answers or len(ev.payments.get(reference, [])) != 1:
            report.violate("external_has_payment", reference, payments=len(ev.payments.get(reference, [])),
                           charges=len(ev.charges.get(reference, [])),
                           transfers=len(ev.transfers.get(reference, [])))
    for reference, asked in sorted((ev.asked_again or {}).items()):
        first, again = asked["first"], asked["again"]
        if again is None or tuple(again) != tuple(first):
            report.violate("answer_kept", reference, first=first, again=again)
    _accounts(ev, report)
    if ev.batches:
        _batches(ev, report)
    return report


def _batches(ev: Evidence, report: Report) -> None:
    """The batches: each row one payment, the same for the same row in a file sent again; completed once."""
    first_payment: dict[str, str | None] = {}  # row key -> the payment the first upload's row became
    parked = {ref for ref in report.parked_left}
    for batch in ev.batches or []:
        report.batches_checked += 1
        if batch["batch_id"] is None:
            report.violate("batch_uploaded", batch["name"], refused=batch["refused"])
            continue
        if len(batch["rows"]) != batch["planned_rows"]:
            report.violate("batch_uploaded", batch["name"], rows=len(batch["rows"]), planned=batch["planned_rows"])
        waiting_for_a_person = False
        for row in batch["rows"]:
            report.batch_rows_checked += batch["resubmission_of"] is None
            where = f"{batch['name']} row {row['row_number']}"
            if row["dead"] or row["payment_id"] is None:
                report.violate("batch_row_not_stuck", where, dead_lettered=row["dead"], payment=row["payment_id"])
                continue
            if row["payment_reference"] != row["planned_reference"] or \
                    len(ev.payments.get(row["planned_reference"], [])) != 1:
                report.violate("batch_row_one_payment", where, payment_reference=row["payment_reference"],
                               expected=row["planned_reference"],
                               payments=len(ev.payments.get(row["planned_reference"] or "", [])))
            if row["planned_reference"] in parked:
                waiting_for_a_person = True
            if batch["resubmission_of"] is None:
                first_payment[row["row_key"]] = row["payment_id"]
            elif first_payment.get(row["row_key"]) != row["payment_id"]:
                report.violate("batch_resubmission_nothing_new", where, payment=row["payment_id"],
                               first_upload=first_payment.get(row["row_key"]))
        # A batch waits for its parked rows: not a violation while reconciliation has left one for a person.
        if (not batch["completed"] and not waiting_for_a_person) or batch["events"] > 1 or \
                (batch["completed"] and batch["events"] != 1):
            report.violate("batch_completed_once", batch["name"], completed=batch["completed"],
                           events=batch["events"])


def _settleable(row: dict, booked: dict[str, list[dict]], ev: Evidence) -> str | None:
    """What reconciliation would have made of this parked payout: succeeded, failed, or None (a break,
    or statements not final yet)."""
    if row.get("payout_instructed_at") is None:
        return None  # parked before the payout (a PSP call): re-probed by the worker, not reconciled
    entries = booked.get(row["end_to_end_reference"], [])
    if len(entries) == 1 and entries[0]["amount"] == row["net_minor"]:
        return "succeeded"
    if entries:
        return None  # a duplicate booking or a wrong amount: a break, for a person
    instructed: date = row["payout_instructed_at"].date()
    days = [(instructed + timedelta(days=n)).isoformat() for n in range(ev.booking_days + 1)]
    if all(ev.statements.get(d, {}).get("final") for d in days):
        return "failed"
    return None


def _accounts(ev: Evidence, report: Report) -> None:
    """Each ledger account, over every payment, against what the outside world says it must hold."""
    net: Counter = Counter()
    for entries in ev.ledger.values():
        for e in entries:
            net[e["account"]] += e["debit_minor"] - e["credit_minor"]
    rows = [r for rs in ev.payments.values() for r in rs]
    by_id = {str(r["id"]): r for r in rows}
    charged = sum(c["amount"] for cs in ev.charges.values() for c in cs if c["status"] == "succeeded")
    refunded = sum(r["amount"] for rs in ev.refunds.values() for r in rs)
    paid_out = sum(t["amount"] for ts in ev.transfers.values() for t in ts if t["status"] == "accepted")
    fees = sum(r["fee_minor"] for r in rows if r["status"] in ("succeeded", "indeterminate"))
    owed = sum(r["net_minor"] for r in rows if r["status"] == "indeterminate")
    expected = {
        "psp_receivable": charged - refunded,  # debit: the PSP owes us
        "beneficiary_payable": -owed,  # credit: parked payouts we may still owe
        "fee_revenue": -fees,  # credit: our fees on payments that kept their charge
        "rail_settlement": -paid_out,  # credit: what went out over the rail
    }
    total = sum(net.values())
    report.accounts = {a: {"ledger": net.get(a, 0), "external": v} for a, v in expected.items()}
    report.accounts["total (debits - credits)"] = {"ledger": total, "external": 0}
    for account, values in report.accounts.items():
        if values["ledger"] != values["external"]:
            report.violate("accounts_match", None, account=account, **values)
    unknown = set(ev.ledger) - set(by_id)
    if unknown:
        report.violate("accounts_match", None, detail=f"{len(unknown)} ledger payments without a row")


def print_table(console: Any, report: Report) -> None:
    from rich.table import Table

    counts = report.by_check()
    rows = f" ({report.batch_rows_checked} of them batch rows)" if report.batch_rows_checked else ""
    table = Table(title=f"audit: {report.checked} payments{rows}, {len(report.violations)} violations")
    table.add_column("check")
    table.add_column("violations", justify="right")
    checks = CHECKS | (BATCH_CHECKS if report.batches_checked else {})
    for check, meaning in checks.items():
        n = counts.get(check, 0)
        table.add_row(meaning, f"[red]{n}[/]" if n else "0")
    console.print(table)
    console.print("outside world's outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(report.outcomes.items())))
    console.print("clients' final answers:   " + ", ".join(f"{k}={v}" for k, v in sorted(report.answers.items())))
    if report.parked_left:
        console.print(f"parked, left for a person (reconciliation breaks): {len(report.parked_left)}")
    for v in report.violations[:20]:
        console.print(f"[red]violation[/] {v}")
