"""The bench's refund round: each payment refunded once, its checks, and its figures beside the payments'."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from bench.checks import refund_checks
from bench.load import REFUND_MINOR, Load, Paid, Refunded, refund_order
from bench.report import summarize


def test_the_clients_share_one_order_refund_each_payment_it_yields_once_and_stop_when_it_runs_out():
    paid = [Paid(f"k{n}", f"ref{n}", b"{}", json.dumps({"id": f"pay-{n}"}).encode()) for n in range(5)]
    sent: list[tuple[str, str, dict[str, Any]]] = []
    load = Load("http://bench.invalid", "key", concurrency=3)

    async def post(key: str, body: bytes, path: str = "") -> tuple[int, bool, bytes, float]:
        await asyncio.sleep(0)
        sent.append((key, path, json.loads(body)))
        return 201, False, b'{"status": "succeeded"}', 0.01

    load._post = post  # type: ignore[method-assign]
    # A deadline far away: only running out of payments can end the run in time.
    result = asyncio.run(asyncio.wait_for(load.refunds(iter(paid), 30.0), 5.0))

    assert sorted(path for _, path, _ in sent) == [f"/v1/payments/pay-{n}/refunds" for n in range(5)]
    assert len({key for key, _, _ in sent}) == len({body["reference"] for _, _, body in sent}) == 5
    assert {body["amount"] for _, _, body in sent} == {REFUND_MINOR}
    assert result.succeeded == 5 and len(result.refunded) == 5 and len(result.references) == 5


def test_a_refund_answered_pending_or_failed_is_not_counted_as_a_refund():
    paid = [Paid(f"k{n}", f"ref{n}", b"{}", json.dumps({"id": f"pay-{n}"}).encode()) for n in range(3)]
    answers = iter([(201, b'{"status": "failed"}'), (202, b'{"status": "pending"}'), (409, b"{}")])
    load = Load("http://bench.invalid", "key", concurrency=1)

    async def post(key: str, body: bytes, path: str = "") -> tuple[int, bool, bytes, float]:
        status, content = next(answers)
        return status, False, content, 0.01

    load._post = post  # type: ignore[method-assign]
    result = asyncio.run(load.refunds(iter(paid), 30.0))

    assert result.succeeded == 0 and result.refunded == []
    assert result.statuses == {"201 failed": 1, "202 pending": 1, "409": 1}


def _rows(n: int = 3) -> dict[str, Any]:
    """Rows as the databases hold them after `n` refunds that all went right."""
    answered = [Refunded(f"key{i}", f"ref{i}", f"pay{i}", 100, f'{{"n": {i}}}'.encode()) for i in range(n)]
    return {
        "answered": answered,
        "sent": n,
        "refunds": [{"reference": a.reference, "id": f"rf{i}", "payment_id": a.payment_id, "status": "succeeded",
                     "amount_minor": 100} for i, a in enumerate(answered)],
        "postings": [{"posting": f"refund:rf{i}", "debits": 100, "credits": 100} for i in range(n)],
        "payments": [{"id": a.payment_id, "refunded_minor": 100, "refunds_minor": 100} for a in answered],
        "stored": [{"key": a.key, "state": "finished", "response_code": 201, "response_body": a.response.decode()}
                   for a in answered],
        "psp": [{"reference": a.reference, "amount": 100, "status": "succeeded"} for a in answered],
    }


def _failed(rows: dict[str, Any]) -> set[str]:
    return {c.name for c in refund_checks(**rows) if not c.ok}


def test_refunds_that_all_went_right_pass_every_check():
    assert _failed(_rows()) == set()


def test_a_second_psp_refund_for_a_reference_fails_the_counts_and_the_duplicate_check():
    rows = _rows()
    rows["psp"].append(dict(rows["psp"][0]))

    assert _failed(rows) == {"refunds = PSP refunds = refunds answered", "no reference refunded twice at the PSP"}


def test_a_refund_without_its_posting_or_with_an_unbalanced_one_fails_the_ledger_check():
    missing, unbalanced = _rows(), _rows()
    del missing["postings"][1]
    unbalanced["postings"][1]["credits"] = 99

    assert _failed(missing) == _failed(unbalanced) == {"ledger: every refund posted once, balanced"}


def test_a_payment_whose_refunded_amount_is_not_its_refunds_sum_fails():
    rows = _rows()
    rows["payments"][2]["refunded_minor"] = 200  # reserved twice, or never released

    assert _failed(rows) == {"each payment's refunded amount is its refunds' sum"}


def test_a_refund_the_psp_refunded_for_another_amount_and_a_stored_response_that_differs_fail():
    rows = _rows()
    rows["psp"][0]["amount"] = 1250
    rows["stored"][1]["response_body"] = '{"n": 99}'

    assert _failed(rows) == {"amounts the PSP refunded are the refunds'",
                             "every refund's 201 stored with its key, finished, byte for byte"}


def test_a_round_with_no_refund_answered_does_not_pass():
    assert "every refund's 201 has its refund, succeeded, of that payment and amount" in _failed(_rows(0))


def _run(kind: str, per_second: float, succeeded: int, transactions: int, round_: int = 1) -> dict[str, Any]:
    return {
        "kind": kind, "workers": 1, "round": round_,
        "run": {"per_second": per_second, "succeeded": succeeded, "requests": succeeded,
                "latency_ms": {"p50": 10.0, "p99": 20.0}},
        "wal": {"transactions": transactions, "by_tables": {"a+b": transactions}, "wal_bytes": 0, "fpi_bytes": 0,
                "wal_bytes_all": 0, "operations": succeeded},
        "xact_commit": {"delta": 2 * succeeded, "operations": succeeded},
        "cpu_seconds": {"API": 1.0}, "cpu_seconds_api_by_process": [1.0], "machine_busy_percent": 50.0,
        "exactly_once": {"pass": True},
    }


def _results(*runs: dict[str, Any]) -> dict[str, Any]:
    return {"parameters": {"workers": [1]}, "runs": list(runs), "ceiling": {},
            "pooled_latency_ms": {"1": {r["kind"]: r["run"]["latency_ms"] for r in runs}}}


def test_the_refund_round_gives_its_rate_beside_new_payments_and_writes_per_refund_and_moves_no_payment_figure():
    payments = [_run("phased", 200.0, 4000, 12000), _run("naive", 180.0, 3600, 18000), _run("replays", 3000.0, 1, 0)]
    without = summarize(_results(*payments))["blocks"][0]
    block = summarize(_results(*payments, _run("refunds", 300.0, 6000, 12000)))["blocks"][0]

    assert block["refunds"]["writing_txns"] == 2.0
    assert block["ratio"]["refunds_to_new"] == 1.5
    assert without["ratio"]["refunds_to_new"] is None
    assert block["ratio"] | {"refunds_to_new": None} == without["ratio"]
    assert block["targets"][:-1] == without["targets"]
    assert block["targets"][-1] | {"value": None} == {"target": "writing transactions per refund", "goal": "= 2",
                                                      "value": None, "met": True, "verdict": "met"}
    assert block["phased"] == without["phased"]


def test_a_refund_that_writes_a_third_time_misses_the_target():
    block = summarize(_results(_run("phased", 200.0, 4000, 12000), _run("refunds", 300.0, 6000, 18000)))["blocks"][0]

    assert block["targets"][-1]["met"] is False and block["targets"][-1]["verdict"] == "missed: +1.00"


def test_the_payments_are_refunded_in_turn_each_again_after_all_the_others_while_the_charge_has_room():
    paid = [Paid(f"k{n}", f"ref{n}", b"{}", b"{}") for n in range(3)]

    order = [p.key for p in refund_order(paid)]

    assert order[:6] == ["k0", "k1", "k2", "k0", "k1", "k2"]
    assert len(order) == 3 * (1250 // REFUND_MINOR)  # the body's 12.50, a refund of REFUND_MINOR at a time
