"""The bench's CPU reading of a process: to well under a millisecond, all its threads together.

And its wake-ups, preemptions and the kernel's part of its CPU, added up by role between two marks.

The bench judges some figures by a few milliseconds of one process's CPU
(the webhook dispatcher's database sessions in a 5 s round, bench/outbox.py).
Read in /proc's clock ticks, that is 0 or 10 ms; `bench.costs.cpu_of` reads
the kernel's CPU clock of the process instead.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import psutil
import pytest

from bench.costs import CpuMark, CpuMeter, cpu_of, in_kernel_of, wakeups_of

# A child that runs until its own CPU clock reads 5 ms past a tick of 10 ms,
# part of it in a second thread, says what its clock reads, and then waits
# (on its stdin) for this test to read it from outside.
_CHILD = textwrap.dedent(
    """
    import sys, threading, time

    def spin(until):
        while time.process_time() < until:
            pass

    start = time.process_time()
    target = (int(start * 100) + 3) / 100 + 0.005
    helper = threading.Thread(target=spin, args=((start + target) / 2,))
    helper.start()
    helper.join()
    spin(target)
    print(repr(time.process_time()), flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the process CPU clock is read on Linux only")
def test_a_process_cpu_is_read_to_the_millisecond_with_its_threads_not_in_ticks():
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        said = float(child.stdout.readline())  # the child's own clock, read after the spin; blocking until it prints
        read = cpu_of(psutil.Process(child.pid))
    finally:
        child.communicate("")
    # What the child printed is its CPU so far; printing it costs a little
    # more. In ticks the reading would be a multiple of 10 ms, 5 ms off.
    assert read is not None
    assert said <= read < said + 0.002, (said, read)


def test_a_process_that_is_gone_has_no_reading():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    process = psutil.Process(child.pid)
    child.wait()

    assert cpu_of(process) is None


# A child that reads a number from its stdin, sleeps 1 ms that many times
# (each sleep a wake-up), says so, and waits on its stdin for the next one.
_SLEEPER = textwrap.dedent(
    """
    import sys, time

    for line in sys.stdin:
        for _ in range(int(line)):
            time.sleep(0.001)
        print("slept", flush=True)
    """
)


def test_a_process_wake_ups_are_counted_each_sleep_once():
    child = subprocess.Popen([sys.executable, "-c", _SLEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    process = psutil.Process(child.pid)
    try:
        child.stdin.write("0\n")
        child.stdin.flush()
        child.stdout.readline()  # started
        before = wakeups_of(process)
        child.stdin.write("200\n")
        child.stdin.flush()
        child.stdout.readline()
        after = wakeups_of(process)
    finally:
        child.communicate("")
    assert before is not None and after is not None
    # 200 sleeps, and a few more at most: for the line it read, if it was not there yet, and its answer.
    assert 200 <= after - before <= 230, (before, after)


def test_wake_ups_between_two_marks_are_added_up_by_role_a_new_process_from_zero():
    before = CpuMark(wakeups={"fake PSP": {10: 100}, "API": {20: 5, 21: 7}})
    after = CpuMark(wakeups={"fake PSP": {10: 160}, "API": {20: 9, 21: 7, 22: 3}})

    assert CpuMeter.woken(before, after) == {"fake PSP": 60, "API": 7}


def test_the_kernels_part_and_the_preemptions_between_two_marks_are_added_up_by_role_too():
    before = CpuMark(in_kernel={"fake PSP": {10: 1.5}}, preempted={"fake PSP": {10: 40}})
    after = CpuMark(in_kernel={"fake PSP": {10: 1.75, 11: 0.25}}, preempted={"fake PSP": {10: 45, 11: 2}})

    assert CpuMeter.kernel_part(before, after) == {"fake PSP": 0.5}
    assert CpuMeter.preemptions(before, after) == {"fake PSP": 7}


# A child that spends about 0.3 s of CPU either in the kernel (copying zeros
# out of /dev/zero: each read is the kernel's work) or in its own code (a
# spin), says so, and waits on its stdin.
_WORKER = textwrap.dedent(
    """
    import os, sys, time

    zeros = os.open("/dev/zero", os.O_RDONLY)
    while time.process_time() < 0.3:  # reading the clock is a system call: not on every turn of the spin
        if sys.argv[1] == "kernel":
            os.read(zeros, 1 << 20)
        else:
            sum(range(100_000))
    print("done", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/dev/zero and the system time as Linux keeps them")
@pytest.mark.parametrize("where", ["kernel", "own code"])
def test_the_kernels_part_of_a_process_cpu_is_its_system_time_not_its_user_time(where):
    child = subprocess.Popen([sys.executable, "-c", _WORKER, where], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        child.stdout.readline()  # blocks until the child has spent its 0.3 s
        process = psutil.Process(child.pid)
        in_kernel, total = in_kernel_of(process), cpu_of(process)
    finally:
        child.communicate("")
    assert in_kernel is not None and total is not None
    # In ticks of 10 ms, and Python's own start is some of either; the split is far from even both ways.
    if where == "kernel":
        assert in_kernel > 0.6 * total, (in_kernel, total)
    else:
        assert in_kernel < 0.2 * total, (in_kernel, total)
