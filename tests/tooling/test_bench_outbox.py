"""How bench/outbox.py charges CPU to each side: by process, and by database session through its owner."""

from __future__ import annotations

from bench.outbox import summary
from bench.sessions import Mark, Meter


def test_a_side_is_charged_its_processes_and_its_own_sessions_and_a_new_session_from_zero():
    before = Mark(processes={"with": {1: 1.0}}, sessions={10: 2.0, 11: 5.0}, owner={10: "with", 11: "without"})
    after = Mark(processes={"with": {1: 1.5, 2: 0.25}},  # pid 2: a process that started in between
                 sessions={10: 2.5, 11: 6.0, 12: 0.125, 13: 9.0},  # 12 opened in between; 13 is nobody's
                 owner={10: "with", 11: "without", 12: "with"})

    assert Meter.spent(before, after, "with") == (0.75, 0.625)
    assert Meter.spent(before, after, "without") == (0.0, 1.0)


def test_the_summary_is_the_median_of_the_rounds_ratios_and_says_if_any_round_was_not_delivered():
    def round_(ratio: float, drained: float | None) -> dict:
        side = {"api_ms": 1.0, "sessions_ms": 1.0, "service_ms": 2.0, "per_second": 10.0}
        return {"cpu_ratio": ratio, "rate_ratio": 1.0, "drained_after_end_s": drained,
                "without": side, "with": side | {"worker_ms": 0.5}}

    figures = summary([round_(1.2, 0.5), round_(1.05, 0.2), round_(1.1, None)])

    assert figures["cpu_ratio"] == 1.1
    assert figures["all_drained"] is False
    assert figures["medians"]["with"]["worker_ms"] == 0.5 and "worker_ms" not in figures["medians"]["without"]
