"""The bench's writing transactions per payment: the payment's own, with the workers' bookkeeping counted apart."""

from __future__ import annotations

from typing import Any

from bench.report import progress_line, summarize


def _round(kind: str, payments: int, by_tables: dict[str, int]) -> dict[str, Any]:
    return {
        "kind": kind, "workers": 1, "round": 1,
        "run": {"per_second": 100.0, "succeeded": payments, "requests": payments,
                "latency_ms": {"p50": 10.0, "p99": 20.0}},
        "wal": {"transactions": sum(by_tables.values()), "by_tables": by_tables, "wal_bytes": 0, "fpi_bytes": 0,
                "wal_bytes_all": 0, "operations": payments},
        "xact_commit": {"delta": 2 * payments, "operations": payments},
        "cpu_seconds": {"API": 1.0}, "cpu_seconds_api_by_process": [1.0], "machine_busy_percent": 50.0,
        "exactly_once": {"pass": True},
    }


def _block(phased: dict[str, int]) -> dict[str, Any]:
    runs = [_round("phased", 1000, phased), _round("naive", 1000, {"naive.payment": 3000, "naive.ledger_entry": 2000})]
    results = {"parameters": {"workers": [1]}, "runs": runs, "ceiling": {},
               "pooled_latency_ms": {"1": {r["kind"]: r["run"]["latency_ms"] for r in runs}}}
    return summarize(results)["blocks"][0]


def _writes_target(block: dict[str, Any]) -> dict[str, Any]:
    return next(t for t in block["targets"] if t["target"] == "writing transactions per payment")


# The three phases of 1,000 payments, each one transaction.
PHASES = {"idempotency_key+payment": 1000, "event+idempotency_key+ledger_entry+payment": 1000,
          "idempotency_key+ledger_entry+payment": 1000}


def test_the_dispatchers_cursor_moves_are_the_workers_own_and_leave_the_payments_three_writes_alone():
    block = _block({**PHASES, "webhook_cursor": 40, "scheduled_run": 2})

    assert block["phased"]["writing_txns"] == 3.0
    assert block["phased"]["workers_writing_txns"] == 0.042
    assert _writes_target(block)["met"] is True


def test_a_fourth_transaction_of_a_payments_tables_misses_the_target_even_beside_the_cursor():
    block = _block({**PHASES, "webhook_cursor": 40, "webhook_delivery": 1000})

    assert block["phased"]["writing_txns"] == 4.0
    assert block["phased"]["workers_writing_txns"] == 0.04
    assert _writes_target(block)["met"] is False


def test_a_transaction_that_wrote_the_cursor_and_a_payments_table_is_the_payments():
    block = _block({"idempotency_key+payment": 1000, "event+idempotency_key+ledger_entry+payment": 1000,
                    "idempotency_key+ledger_entry+payment+webhook_cursor": 1000})

    assert block["phased"]["writing_txns"] == 3.0
    assert block["phased"]["workers_writing_txns"] == 0.0


def test_each_rounds_line_gives_the_payments_writes_and_the_workers_beside_them():
    line = progress_line("[1w] round 1 phased", _round("phased", 1000, {**PHASES, "webhook_cursor": 30}))

    assert "3.00 writing txns each and 0.03 the workers', busy" in line
    assert "3.00 writing txns each," in progress_line("naive", _round("naive", 1000, PHASES))
