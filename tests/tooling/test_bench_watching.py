"""bench/watching.py's summary of the side-by-side rounds: the CPU and rate ratios, the user/system split, and
the judged figure over several pairs of APIs."""

import os
import subprocess
import sys

from types import SimpleNamespace

import psutil

from bench.load import RunResult
from bench.report import print_watching, summarize, watching_judged
from bench.watching import across_pairs, split_seconds, summary
from tests.tooling.test_bench_balance import _results, _run


def result(requests: int, elapsed: float = 1.0) -> RunResult:
    return RunResult(latencies=[0.001] * requests, elapsed=elapsed)


def test_the_split_is_weighted_by_each_rounds_requests_and_divided_by_the_base():
    measured = {
        "on": [(0.0011, 100.0, result(100)), (0.0011, 300.0, result(300))],
        "off": [(0.0010, 110.0, result(110)), (0.0010, 330.0, result(330))],
    }
    splits = {
        # per request: user, system seconds, wake-ups
        "on": [(0.0008, 0.0002, 1.0), (0.0008, 0.0004, 0.5)],
        "off": [(0.0008, 0.0002, 1.0), (0.0008, 0.0002, 1.0)],
    }
    figures = summary(measured, splits=splits)
    on, off = figures["on"], figures["off"]
    # (0.2 ms x 100 + 0.4 ms x 300) / 400 requests = 0.35 ms, not the rounds' plain mean of 0.3
    assert on["system_ms_per_request"] == 0.35
    assert on["wakeups_per_request"] == 0.625
    assert on["user_ratio"] == 1.0
    assert on["system_ratio"] == 1.75
    assert off["system_ms_per_request"] == 0.2 and "system_ratio" not in off
    assert on["cpu_ratio"] == 1.1 and on["rate_ratio"] == round(100 / 110, 4)


def test_without_splits_the_summary_has_no_split():
    figures = summary({"on": [(0.001, 1.0, result(1))], "off": [(0.001, 1.0, result(1))]})
    assert "user_ms_per_request" not in figures["on"]


def test_a_process_that_spins_in_the_kernel_reads_as_system_time_and_one_in_python_as_user_time():
    # Real processes, read the way a round reads an API: one reads a MiB of
    # zeros at a time (the kernel fills the buffer), the other adds numbers.
    kernel = "import os\nfd = os.open('/dev/zero', os.O_RDONLY)\nwhile True: os.read(fd, 1 << 20)"
    python = "n = 0\nwhile True: n += 1"
    spinners = [subprocess.Popen([sys.executable, "-c", code]) for code in (kernel, python)]
    try:
        for process in spinners:
            # Read once it has half a second of CPU to split (ticks are 10 ms).
            while sum(psutil.Process(process.pid).cpu_times()[:2]) < 0.5:
                os.sched_yield()
        (k_user, k_system, _), (p_user, p_system, _) = (
            split_seconds(SimpleNamespace(tree=lambda pid=p.pid: [psutil.Process(pid)])) for p in spinners)
    finally:
        for process in spinners:
            process.kill()
            process.wait()
    assert k_system > 2 * k_user
    assert p_user > 10 * max(p_system, 0.01)


def pair(cpu_on: float, rate_on: float) -> dict:
    """One pair's `summary`: the watched API's rounds against the unwatched one's 1 ms and 100 replays/s."""
    return summary({"on": [(cpu_on / 1000, rate_on, result(int(rate_on)))],
                    "off": [(0.001, 100.0, result(100))]})


def test_the_judged_figure_is_the_median_of_the_pairs_not_the_first_pair_or_the_mean():
    # The run's own pair unlucky (0.94), the two fresh ones not: the median
    # is the middle pair's 0.97; the first pair alone would miss the target,
    # the mean (0.963) would be moved by the unlucky one.
    pairs = [pair(1.06, 94.0), pair(1.02, 98.0), pair(1.03, 97.0)]
    judged = across_pairs(pairs)
    assert judged["pairs"] == judged["measured"] == 3
    assert judged["rate_ratio_per_pair"] == [0.94, 0.98, 0.97]
    assert judged["rate_ratio"] == 0.97
    assert judged["cpu_ratio"] == 1.03
    # The report's target reads the median of a step with pairs, and the one
    # pair of a result from before the step had pairs.
    assert watching_judged({"judged": judged, "pairs": pairs})["rate_ratio"] == 0.97
    assert watching_judged({"figures": pairs[0]})["rate_ratio"] == 0.94


def test_a_pair_whose_base_served_nothing_is_left_out_of_the_median():
    served_nothing = summary({"on": [(0.001, 50.0, result(50))], "off": [(0.0, 0.0, result(0))]})
    judged = across_pairs([pair(1.01, 99.0), served_nothing])
    assert judged["rate_ratio_per_pair"] == [0.99] and judged["rate_ratio"] == 0.99
    # Counted as measured, not as one of the pairs the median is of.
    assert judged["measured"] == 2 and judged["pairs"] == 1


def test_new_payments_watching_is_judged_at_once_over_the_pairs_and_by_the_rounds_only_in_a_result_without_them():
    # One after the other the watched service looks faster (100 ÷ 80): the
    # host slowed between the rounds. At once, in three pairs, it is 0.93.
    unwatched = _run("unwatched", 1, 1, [5.0])
    unwatched["run"] = unwatched["run"] | {"per_second": 80.0}
    old = _results([_run("phased", 1, 1, [5.0]), unwatched])
    replays = [pair(1.03, 97.0)] * 3
    new = [pair(1.08, 93.0), pair(1.09, 92.0), pair(1.07, 94.0)]
    side = {"rounds": 8, "seconds": 5.0, "judged": across_pairs(replays),
            "pairs": [{"whose": f"pair {n}", "figures": r, "new_payments": p} for n, (r, p) in enumerate(zip(replays, new))],
            "new_payments": {"rounds": 4, "seconds": 5.0, "judged": across_pairs(new)},
            "exactly_once": {"pass": True, "checks": []}}
    now = old | {"watching_side_by_side": {"1": side}}

    [before] = summarize(old)["blocks"]
    [block] = summarize(now)["blocks"]
    watching = {t["target"]: t for t in block["targets"] if "on ÷ off" in t["target"]}

    assert [t["value"] for t in before["targets"] if t["target"] == "payments/s: metrics and logs on ÷ off"] == [1.25]
    assert set(watching) == {"new payments/s: metrics and logs on ÷ off, at once, median of the pairs",
                             "replays/s: metrics and logs on ÷ off, at once on one CPU, median of the pairs"}
    judged = watching["new payments/s: metrics and logs on ÷ off, at once, median of the pairs"]
    assert judged["value"] == 0.93 and judged["met"] is False
    assert block["ratio"]["watching"] == 1.25 and block["ratio"]["watching_new_side_by_side_cpu"] == 1.08
    print_watching(block)  # the table's rows for each pair and the judged figure


def test_watching_only_judges_both_targets_by_the_pairs_and_fails_on_any_check_of_the_step():
    from bench.run import watching_verdict

    side = {"judged": {"rate_ratio": 0.97}, "new_payments": {"judged": {"rate_ratio": 0.94}},
            "exactly_once": {"pass": True, "checks": []}}
    verdict = watching_verdict({"watching_side_by_side": {"1": side, "2": side | {"judged": {"rate_ratio": None}}}})
    assert [[(t["target"].split(":")[0], t["value"], t["met"]) for t in block["targets"]]
            for block in verdict["blocks"]] == [
        [("new payments/s", 0.94, False), ("replays/s", 0.97, True)],
        [("new payments/s", 0.94, False), ("replays/s", None, None)],
    ]
    assert verdict["exactly_once_pass"] is True
    # A warm-up payment paid twice fails the run, even though no target did.
    failed = side | {"exactly_once": {"pass": False, "checks": [{"check": "paid once", "ok": False, "detail": "x"}]}}
    assert watching_verdict({"watching_side_by_side": {"1": failed}})["exactly_once_pass"] is False
    # A run that measured nothing passes nothing.
    assert watching_verdict({"watching_side_by_side": {}})["exactly_once_pass"] is False
