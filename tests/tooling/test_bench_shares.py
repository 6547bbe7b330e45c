"""bench/shares.py: one round's figures from the workers' shares, and the summary that tells served-more from spent-more."""

from __future__ import annotations

from bench.costs import WorkerShare
from bench.shares import figures, line, summary


def _share(cpu: float, answers: int, waited: float) -> WorkerShare:
    return WorkerShare(cpu_seconds=cpu, requests=answers, connections=16, waited_seconds=waited, preemptions=0)


def test_a_round_counts_the_answers_no_worker_held_and_reads_cpu_an_answer_busiest_over_idlest():
    round_ = figures([_share(3.0, 600, 0.4), _share(2.0, 400, 1.6)], answered=1004)

    assert round_["balance"]["max_over_min"] == 1.5
    assert round_["answers_percent"] == [60.0, 40.0] and round_["answers_unplaced"] == 4
    assert round_["cpu_per_answer_ratio"] == 1.0
    assert line(7, round_) == ("round 7: CPU 60/40 (max ÷ min 1.50), connections 16/16, answers 60/40, CPU an answer "
                               "busiest ÷ idlest 1.00, waited for a CPU 0.40 / 1.60 s, 4 on connections closed during it")


def test_the_summary_names_only_the_rounds_past_the_bound_and_how_much_longer_their_idlest_waited():
    served_more = figures([_share(3.0, 600, 0.4), _share(2.0, 400, 1.6)], answered=1000)
    spent_more = figures([_share(2.6, 500, 1.0), _share(2.0, 500, 1.0)], answered=1000)
    even = figures([_share(2.5, 500, 1.0), _share(2.4, 480, 1.0)], answered=980)

    text = summary([served_more, spent_more, even], bound=1.2)

    assert text.startswith("3 rounds: max ÷ min median 1.30, worst 1.50; 2 over 1.2")
    assert text.endswith("in those, CPU an answer busiest ÷ idlest 1.00, 1.30; "
                         "the idlest waited for a CPU +1.20, +0.00 s more than the busiest")
    assert summary([even], bound=1.2) == "1 round: max ÷ min median 1.04, worst 1.04; 0 over 1.2"


def test_a_round_whose_idlest_worker_spent_nothing_or_a_run_with_no_split_still_prints():
    idle = figures([_share(3.0, 600, 0.4), _share(0.0, 5, 0.0)], answered=605)

    assert "CPU an answer busiest ÷ idlest n/a" in line(1, idle)
    assert summary([figures([_share(3.0, 600, 0.4)], answered=600)], bound=1.2) == (
        "1 round: none split the CPU between two workers that spent any")
