"""The bench's measure of how evenly `payments api --workers N` shares its CPU between its worker processes."""

from __future__ import annotations

import math
from typing import Any

from bench.costs import CpuMark, CpuMeter
from bench.report import balance, summarize


def test_the_split_gives_each_workers_share_busiest_first_and_the_busiest_over_the_idlest():
    even = balance([3.1, 2.9])
    skewed = balance([0.37, 6.74])

    assert even == {"percent": [51.7, 48.3], "max_over_min": 3.1 / 2.9}
    assert skewed is not None and skewed["percent"] == [94.8, 5.2]
    assert round(skewed["max_over_min"], 1) == 18.2


def test_a_worker_that_did_nothing_is_infinitely_uneven_and_one_process_or_no_cpu_is_no_figure():
    idle = balance([4.0, 0.0])

    assert idle is not None and idle["percent"] == [100.0, 0.0] and math.isinf(idle["max_over_min"])
    assert balance([4.0]) is None
    assert balance([0.0, 0.0]) is None


def test_the_split_counts_only_the_workers_an_idle_one_too_and_not_the_supervisor_or_another_process():
    supervisor, tracker, busy, idle = 10, 11, 12, 13
    before = CpuMark(seconds={"API": {supervisor: 1.0, tracker: 0.1, busy: 2.0, idle: 0.5}})
    after = CpuMark(seconds={"API": {supervisor: 1.2, tracker: 0.1, busy: 8.0, idle: 0.5}})

    assert CpuMeter.split(before, after, "API", {busy, idle}) == [6.0, 0.0]


def test_the_worst_round_at_two_workers_is_the_target_row_and_one_worker_has_none():
    runs = [_run("phased", 2, 1, [5.0, 4.5]), _run("naive", 2, 1, [6.0, 4.0]), _run("replays", 2, 1, [3.0, 2.9]),
            _run("phased", 1, 1, [9.0])]
    blocks = {b["workers"]: b for b in summarize(_results(runs))["blocks"]}

    target = blocks[2]["targets"][-1]
    assert target["target"] == "API workers' CPU: max ÷ min, worst round"
    assert target["value"] == 1.5 and target["met"] is False and target["goal"] == "<= 1.2×"
    assert blocks[2]["api_balance_worst"] | {"max_over_min": None} == {
        "kind": "naive", "round": 1, "percent": [60.0, 40.0], "max_over_min": None, "connections": []}
    assert blocks[2]["phased"]["api_split_percent"] == ["53/47 (1.11)"]
    assert not any(t["target"].startswith("API workers'") for t in blocks[1]["targets"])


def test_rounds_all_within_the_bound_meet_the_target():
    runs = [_run("phased", 2, 1, [5.0, 4.5]), _run("naive", 2, 1, [4.2, 4.0])]

    target = summarize(_results(runs))["blocks"][0]["targets"][-1]
    assert target["met"] is True and round(target["value"], 3) == round(5.0 / 4.5, 3)


def _run(kind: str, workers: int, round_: int, split: list[float]) -> dict[str, Any]:
    return {
        "kind": kind, "workers": workers, "round": round_,
        "run": {"per_second": 100.0, "succeeded": 400, "requests": 400, "latency_ms": {"p50": 10.0, "p99": 20.0}},
        "wal": {"transactions": 1200, "by_tables": {"a+b": 1200}, "wal_bytes": 0, "fpi_bytes": 0,
                "wal_bytes_all": 0, "operations": 400},
        "xact_commit": {"delta": 800, "operations": 400},
        "cpu_seconds": {"API": sum(split)}, "cpu_seconds_api_by_process": split, "machine_busy_percent": 50.0,
        "exactly_once": {"pass": True},
    }


def _results(runs: list[dict[str, Any]]) -> dict[str, Any]:
    workers = sorted({r["workers"] for r in runs})
    return {"parameters": {"workers": workers}, "runs": runs, "ceiling": {},
            "pooled_latency_ms": {str(w): {r["kind"]: r["run"]["latency_ms"] for r in runs if r["workers"] == w}
                                  for w in workers}}
