"""How bench/rate_at_once.py charges each side of a round: the worker to the safe service, sessions by their owner."""

from __future__ import annotations

from bench.load import RunResult
from bench.rate_at_once import round_figures, summary
from bench.sessions import Mark


def _ran(payments: int, seconds: float) -> RunResult:
    return RunResult(latencies=[0.1] * payments, elapsed=seconds)


def _marks(owned: bool) -> tuple[Mark, Mark]:
    owner = {10: "phased", 11: "naive", 12: "worker"} if owned else {}
    before = Mark(processes={"phased": {1: 1.0}, "naive": {2: 1.0}, "worker": {3: 1.0}},
                  sessions={10: 1.0, 11: 1.0, 12: 1.0}, owner=owner)
    after = Mark(processes={"phased": {1: 1.5}, "naive": {2: 2.0}, "worker": {3: 1.125}},
                 sessions={10: 1.25, 11: 1.125, 12: 1.125}, owner=owner)
    return before, after


def test_the_worker_and_its_sessions_are_the_safe_services_and_each_side_is_charged_its_own_sessions():
    figures = round_figures(*_marks(owned=True), {"phased": _ran(250, 10.0), "naive": _ran(200, 10.0)})

    phased, naive = figures["phased"], figures["naive"]
    assert (phased["api_ms"], phased["sessions_ms"], phased["worker_ms"]) == (2.0, 1.0, 1.0)
    assert phased["service_ms"] == 4.0
    assert (naive["api_ms"], naive["sessions_ms"], naive["service_ms"]) == (5.0, 0.625, 5.625)
    assert "worker_ms" not in naive
    assert figures["rate_ratio"] == 1.25
    assert figures["cpu_ratio"] == round(4.0 / 5.625, 4)
    assert figures["db_ratio"] == 1.6


def test_sessions_that_cannot_be_told_apart_give_no_database_figure_not_a_guess():
    figures = round_figures(*_marks(owned=False), {"phased": _ran(250, 10.0), "naive": _ran(200, 10.0)})

    assert figures["phased"]["sessions_ms"] is None and figures["naive"]["service_ms"] is None
    assert figures["cpu_ratio"] is None and figures["db_ratio"] is None
    assert figures["rate_ratio"] == 1.25, "the rate needs no session"


def test_the_summary_is_the_median_of_the_rounds_ratios():
    rounds = [round_figures(*_marks(owned=True), {"phased": _ran(p, 10.0), "naive": _ran(200, 10.0)})
              for p in (180, 250, 220)]

    figures = summary(rounds)

    assert figures["rate_ratio"] == 1.1
    assert figures["medians"]["phased"]["per_second"] == 22.0
    assert "worker_ms" not in figures["medians"]["naive"]
