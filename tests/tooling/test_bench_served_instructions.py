"""bench/served_instructions.py's pure parts: a window's count read from the dump callgrind_control asked for,
and the report of watched over unwatched."""

import pytest

from bench.instructions import NoFigure
from bench.served_instructions import Served, dump_events, report

DUMP = "version: 1\ncreator: callgrind-3.19.0\ndesc: Trigger: dump w2\n\nevents: Ir\nsummary: 123456789\ntotals: 999\n"
SIMULATED = ("desc: Trigger: dump w1\nevents: Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw Bc Bcm Bi Bim\n"
             "summary: 1000 400 200 30 20 10 3 2 1 150 15 50 5\n")


def test_a_window_is_counted_by_the_summary_of_the_dump_named_after_it():
    assert dump_events(DUMP, "w2") == {"Ir": 123_456_789}


def test_another_windows_dump_or_one_written_at_exit_is_no_figure():
    with pytest.raises(NoFigure, match="w1"):
        dump_events(DUMP, "w1")
    with pytest.raises(NoFigure):
        dump_events(DUMP.replace("desc: Trigger: dump w2", "desc: Trigger: Program termination"), "w2")


def test_with_the_caches_simulated_every_event_is_read_by_its_name():
    events = dump_events(SIMULATED, "w1")
    assert events["Ir"] == 1000 and events["I1mr"] == 30 and events["DLmw"] == 1 and events["Bim"] == 5


@pytest.mark.parametrize("summary", ["", "summary: 0\n"])
def test_a_dump_without_a_count_is_no_figure_not_a_zero(summary):
    with pytest.raises(NoFigure):
        dump_events(DUMP.replace("summary: 123456789\n", summary), "w2")


def test_each_process_is_the_mean_of_its_windows_and_the_report_divides_watched_by_unwatched(capsys):
    served = [Served("phased", 1, [1_030_000, 1_050_000]), Served("unwatched", 1, [1_000_000, 1_000_000]),
              Served("phased", 2, [1_040_000, 1_040_000]), Served("unwatched", 2, [1_000_000, 1_000_000])]
    report(served, ["phased", "unwatched"], tolerance=0.01)
    out = capsys.readouterr().out
    assert "phased: 1,040,000 instructions per replay" in out
    assert "phased ÷ unwatched per replay, served = 1.0400" in out


def test_simulated_misses_are_reported_per_replay_with_watched_over_unwatched(capsys):
    misses = {"I1 misses": 100.0, "D1 misses": 50.0, "LL misses": 2.0, "mispredicted branches": 40.0}
    served = [Served("phased", r, [1_000_000], {k: v * 1.2 for k, v in misses.items()}) for r in (1, 2)]
    served += [Served("unwatched", r, [1_000_000], misses) for r in (1, 2)]
    report(served, ["phased", "unwatched"], tolerance=0.01)
    assert "I1 misses per replay (simulated): phased 120, unwatched 100 (÷ 1.200)" in capsys.readouterr().out


def test_processes_that_disagree_give_no_figure():
    served = [Served("phased", 1, [1_000_000]), Served("phased", 2, [1_100_000])]
    with pytest.raises(NoFigure, match="disagree"):
        report(served, ["phased"], tolerance=0.01)
