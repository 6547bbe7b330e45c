"""The growth bench's pure parts: its days, its sizes, its fingerprint, its verdict.

`make bench-growth` itself takes minutes to hours and is not part of `make
test`. What it relies on to be right is: the two old days it fills must be
the one the reaper drops and one it leaves (or the drop-vs-DELETE comparison
measures something else), the preloaded keys must carry the service's own
fingerprint (or every replay of one is a 422), and a failed check must fail
the run.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, date, datetime, time, timedelta

import pytest

from app.idempotency.keys import request_fingerprint
from app.idempotency.partitions import AHEAD_DAYS, Partition, partition_name, past_retention
from bench.growth import layout, preload, report


def test_sizes_are_whole_numbers_that_grow() -> None:
    assert layout.parse_sizes("1000000,10000000") == [1_000_000, 10_000_000]
    assert layout.parse_sizes("20_000, 100000") == [20_000, 100_000]
    for wrong in ("", "0", "10,5", "10,10", "ten", "-5"):
        with pytest.raises(ValueError):
            layout.parse_sizes(wrong)


def test_the_window_covers_every_day_a_key_of_the_last_retention_hours_falls_on() -> None:
    now = datetime(2026, 12, 1, 0, 30, tzinfo=UTC)
    assert layout.window_days(now, 72) == [date(2026, 11, 28), date(2026, 11, 29), date(2026, 11, 30), date(2026, 12, 1)]
    assert layout.window_days(now, 0.25) == [date(2026, 12, 1)]


def _day(d: date) -> Partition:
    return Partition(partition_name(d), d, d + timedelta(days=1))


@pytest.mark.parametrize("retention_hours", [72, 80, 100.5, 24])
@pytest.mark.parametrize("clock", [time(0, 0, 1), time(0, 30), time(12), time(23, 59, 59)])
def test_the_reaper_drops_exactly_the_drop_day_and_a_delete_reaper_would_remove_the_other(
        retention_hours: float, clock: time) -> None:
    today = date(2026, 12, 1)
    now = datetime.combine(today, clock, tzinfo=UTC)
    days = layout.reap_days(today, retention_hours)
    window = layout.window_days(now, retention_hours)
    assert days.delete < window[0] and days.drop < days.delete  # the old days hold none of the window's keys
    existing = [_day(days.drop), _day(days.delete), *map(_day, window),
                *(_day(today + timedelta(days=n)) for n in range(1, AHEAD_DAYS + 1))]
    # The reaper, called with the bench's retention, drops the drop day and nothing else...
    assert past_retention(existing, now, days.reap_retention, today) == [_day(days.drop)]
    # ...while with the configured retention the DELETE day is past it too: its
    # finished keys are exactly the ones a reaper without partitions would delete.
    assert past_retention(existing, now, timedelta(hours=retention_hours), today) == [_day(days.drop),
                                                                                      _day(days.delete)]


def test_preloaded_keys_carry_the_services_fingerprint_of_the_benchs_body() -> None:
    params = preload.load_params([1], 1, datetime(2026, 12, 1, tzinfo=UTC), 1000.0, preload.WINDOW_MIX)
    reference = "order-4711"
    hashed = hashlib.sha256((params["head"] + reference + params["tail"]).encode()).digest()
    body = {"amount": 1250, "beneficiary": {"iban": "DE89370400440532013000", "name": "Ada Lovelace"},
            "card_token": "tok_visa", "currency": "EUR", "reference": reference}
    assert hashed == request_fingerprint("POST", "/v1/payments", body)


def test_a_parameter_named_twice_is_bound_once() -> None:
    sql, args = preload._bind("SELECT :a, :b, :a, x::text", {"a": 1, "b": 2})
    assert sql == "SELECT $1, $2, $1, x::text" and args == [1, 2]


def _run(db: str, kind: str, rate: float, ok: bool = True, round_: int = 1) -> dict:
    return {"size": 100, "key_rows": 100 if db == report.GROWN else None, "round": round_, "kind": kind,
            "database": db, "per_second": rate, "requests": 10, "succeeded": 10, "latencies_s": [0.01] * 10,
            "checks": [{"name": "exactly once", "ok": ok, "detail": ""}]}


def _results(runs: list[dict], checks: list[dict] | None = None) -> dict:
    return {"parameters": {"sizes": [100]}, "runs": runs, "checks": checks or [],
            "removal": {"drop": {"seconds": 2.0, "wal_bytes": 5 << 20, "drop_seconds": 0.05,
                                 "drop_wal_bytes": 100_000}}}


def test_ratios_are_preloaded_over_empty_and_the_targets_say_met_or_missed() -> None:
    runs = [_run(report.EMPTY, report.NEW, 100), _run(report.GROWN, report.NEW, 70),
            _run(report.EMPTY, report.REPLAYS, 1000), _run(report.GROWN, report.REPLAYS, 900)]
    summary = report.summarize(_results(runs))
    block = summary["blocks"][0]
    assert block["ratios"]["new_per_second"] == pytest.approx(0.7)
    assert block["ratios"]["replays_per_second"] == pytest.approx(0.9)
    assert [t["met"] for t in block["targets"]] == [False, True]
    # The drop's own transaction meets both targets; the whole reap, with its scan and move, misses both.
    assert [t["met"] for t in summary["removal_targets"]] == [True, True, False, False]
    assert summary["checks_pass"]


def test_a_failed_check_in_any_run_or_of_the_bench_fails_the_run() -> None:
    runs = [_run(report.EMPTY, report.NEW, 100), _run(report.GROWN, report.NEW, 100, ok=False)]
    assert not report.summarize(_results(runs))["checks_pass"]
    lost = [{"name": "every live key of the dropped day is still in the key table", "ok": False, "detail": ""}]
    assert not report.summarize(_results(runs[:1], lost))["checks_pass"]
