"""bench/watching.py's summary of the side-by-side rounds: the CPU and rate ratios, and the user/system split."""

import os
import subprocess
import sys

from types import SimpleNamespace

import psutil

from bench.load import RunResult
from bench.watching import split_seconds, summary


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
