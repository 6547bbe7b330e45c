"""How bench/before_after.py sums up its rounds, and how it tells which tree a process ran."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from bench.before_after import Side, compiled_apps, differing_migrations, merged, summary, verdict
from bench.load import Paid, RunResult


def side(payment_cpu_ms: float, replay_cpu_ms: float, payments_per_s: float = 50.0,
         replays_per_s: float = 1000.0) -> Side:
    return Side(500, payments_per_s, payment_cpu_ms, 10_000, replays_per_s, replay_cpu_ms)


def test_the_ratios_are_the_median_of_the_rounds_after_over_before_not_the_ratio_of_the_medians():
    rounds = [
        {"before": side(4.0, 0.200), "after": side(4.4, 0.210)},  # 1.10, 1.05
        {"before": side(8.0, 0.250), "after": side(8.0, 0.250)},  # 1.00, 1.00
        {"before": side(5.0, 0.300, payments_per_s=40), "after": side(5.1, 0.330, payments_per_s=50)},  # 1.02, 1.10
    ]

    figures = summary(rounds)

    assert [round(r["payment_cpu_ratio"], 3) for r in figures["rounds"]] == [1.1, 1.0, 1.02]
    assert round(figures["payment_cpu_ratio"], 3) == 1.02  # the ratio of the medians would be 5.1 / 5.0
    assert round(figures["replay_cpu_ratio"], 3) == 1.05
    assert figures["payments_per_s_ratio"] == 1.0
    assert figures["medians"]["before"]["payment_cpu_ms"] == 5.0
    assert figures["medians"]["after"]["replay_cpu_ms"] == 0.25


def test_a_round_with_no_cpu_before_gives_no_ratio_and_is_left_out_of_the_median():
    rounds = [{"before": side(0.0, 0.2), "after": side(4.0, 0.2)}, {"before": side(4.0, 0.2), "after": side(4.2, 0.2)}]

    figures = summary(rounds)

    assert figures["rounds"][0]["payment_cpu_ratio"] is None
    assert round(figures["payment_cpu_ratio"], 3) == 1.05


def test_the_verdict_line_names_both_ratios_the_target_and_whether_both_are_met():
    assert verdict({"payment_cpu_ratio": 1.0123, "replay_cpu_ratio": 0.98}) == (
        "CPU per payment after/before = 1.012, per replay = 0.980 (target <= 1.05): met")
    assert verdict({"payment_cpu_ratio": 1.0123, "replay_cpu_ratio": 1.0501}).endswith(": not met")
    assert verdict({"payment_cpu_ratio": None, "replay_cpu_ratio": 1.0}) == (
        "CPU per payment after/before = n/a, per replay = 1.000 (target <= 1.05): not met")


def test_merged_runs_keep_every_answer_reference_and_status_for_the_exactly_once_check():
    one = RunResult([0.1], Counter({"201": 1, "503": 1}), [Paid("k1", "r1", b"{}", b"a")], ["r1", "r2"], 2.0)
    two = RunResult([0.2, 0.3], Counter({"201": 2}), [Paid("k3", "r3", b"{}", b"b")], ["r3"], 3.0)

    total = merged([one, two])

    assert (total.succeeded, total.requests, total.failed, total.elapsed) == (3, 4, 1, 5.0)
    assert [p.key for p in total.paid] == ["k1", "k3"] and total.references == ["r1", "r2", "r3"]


def test_trees_with_a_migration_that_differs_or_is_missing_cannot_share_a_database(tmp_path: Path):
    before, after = tmp_path / "before", tmp_path / "after"
    for tree in (before, after):
        (tree / "migrations" / "versions").mkdir(parents=True)
        (tree / "migrations" / "versions" / "0001_a.py").write_text("one")
    assert differing_migrations(before, after) == []

    (after / "migrations" / "versions" / "0002_b.py").write_text("two")
    (before / "migrations" / "versions" / "0001_a.py").write_text("one, edited")

    assert differing_migrations(before, after) == ["0001_a.py", "0002_b.py"]


def test_a_process_ran_the_tree_whose_app_it_compiled_into_its_own_pycache(tmp_path: Path):
    pycache, before, after = tmp_path / "pycache", Path("/work/before"), Path("/work/after")
    (pycache / "work" / "before" / "app").mkdir(parents=True)
    (pycache / "work" / "before" / "app" / "main.cpython-311.pyc").write_bytes(b"")
    (pycache / "work" / "after" / "app" / "machine").mkdir(parents=True)  # a directory, nothing compiled

    assert compiled_apps(pycache, [before, after]) == [before]
