"""bench/cpu_samples.py and bench.shares --perf: perf's samples read, sorted by kind, and put in each round and worker."""

from __future__ import annotations

import io

from rich.console import Console

import bench.shares
from bench.costs import WorkerShare
from bench.cpu_samples import GC, KERNEL, REST, FREQUENCY, Sample, by_window, kind, more_often, parse
from bench.shares import figures, profiled

LIBPYTHON = "/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0"

# What `perf script -F pid,time,ip,sym,dso` prints (taken from a real recording, cut down).
SCRIPT = f"""\
 7695   229.688965: 
\t          2bb344 gc_collect_main ({LIBPYTHON})
\t               1 [unknown] ([unknown])

 7695   229.700100: 
\t          1a2b3c dict_traverse ({LIBPYTHON})
\t          2bb000 [unknown] ([unknown])

 7696   229.701000: 
\tffffffff8224379b tcp_sendmsg_locked+0x1c ([kernel.kallsyms])
\tffffffff822452b5 tcp_sendmsg+0x28 ([kernel.kallsyms])
\t    7fea43e56240 __send ([unknown])

 7696   229.702000: 
\t          1a0000 _PyEval_EvalFrameDefault ({LIBPYTHON})
\t          1b0000 visit_decref ({LIBPYTHON})

 0   229.703000: 
\tffffffff8224379b pv_native_safe_halt ([kernel.kallsyms])
"""


def test_perf_script_is_read_into_samples_with_their_process_time_and_frames_innermost_first():
    samples = list(parse(io.StringIO(SCRIPT)))

    assert [(s.pid, s.time) for s in samples] == [(7695, 229.688965), (7695, 229.7001), (7696, 229.701),
                                                  (7696, 229.702), (0, 229.703)]
    assert samples[0].frames == (("gc_collect_main", LIBPYTHON), ("[unknown]", "[unknown]"))
    assert samples[2].frames[0] == ("tcp_sendmsg_locked", "[kernel.kallsyms]")  # the offset dropped


def test_a_sample_is_the_collectors_by_its_stack_or_its_innermost_function_the_kernels_by_its_innermost_frame():
    collection, traverse, kernel, interpreter, _ = parse(io.StringIO(SCRIPT))

    assert kind(collection) == GC
    assert kind(traverse) == GC  # the walk up from it is not trusted, its name is
    assert kind(kernel) == KERNEL
    assert kind(interpreter) == GC  # a collection's function on the stack, above the leaf
    assert kind(Sample(1, 0.0, (("_PyEval_EvalFrameDefault", LIBPYTHON),))) == REST


def test_samples_fall_in_the_window_of_their_round_and_only_the_workers_are_kept():
    samples = list(parse(io.StringIO(SCRIPT)))

    split = by_window(samples, [(229.70, 229.7015), (229.68, 229.69)], {7695, 7696})

    assert [s.time for s in split[0][7695]] == [229.7001] and [s.time for s in split[0][7696]] == [229.701]
    assert [s.time for s in split[1][7695]] == [229.688965] and split[1][7696] == []
    # 229.702 is in no window (a warm-up), pid 0 is no worker: neither is anywhere.
    assert sum(len(v) for w in split for v in w.values()) == 3


def _samples(pid: int, at: float, leaves: dict[str, int]) -> list[Sample]:
    binary = {"tcp_recvmsg": "[kernel.kallsyms]"}
    return [Sample(pid, at, ((leaf, binary.get(leaf, LIBPYTHON)),)) for leaf, n in leaves.items() for _ in range(n)]


def _share(cpu: float, pid: int) -> WorkerShare:
    return WorkerShare(cpu_seconds=cpu, requests=1000, connections=16, waited_seconds=0.3, preemptions=0, pid=pid)


def test_each_round_gets_its_workers_cpu_by_kind_and_an_uneven_round_the_functions_its_busiest_spent_more_in(
        monkeypatch):
    printed = io.StringIO()
    monkeypatch.setattr(bench.shares, "console", Console(file=printed, width=400))
    even = figures([_share(0.5, 11), _share(0.5, 12)], answered=2000) | {"monotonic": [10.0, 11.0]}
    uneven = figures([_share(0.6, 12), _share(0.4, 11)], answered=2000) | {"monotonic": [20.0, 21.0]}
    f = FREQUENCY
    samples = [*_samples(11, 10.5, {"_PyEval_EvalFrameDefault": f // 2}),
               *_samples(12, 10.5, {"_PyEval_EvalFrameDefault": f // 2}),
               # In the uneven round the busiest (pid 12) collected for a tenth of a second more.
               *_samples(12, 20.5, {"_PyEval_EvalFrameDefault": f // 2, "gc_collect_main": f // 10,
                                    "tcp_recvmsg": 2, "[unknown]": 3}),
               *_samples(11, 20.5, {"_PyEval_EvalFrameDefault": f // 2 - f // 20, "tcp_recvmsg": 2})]

    profiled([even, uneven], samples, bound=1.2)

    assert uneven["on_cpu"] == [{GC: round((f // 10) / f, 3), KERNEL: round(2 / f, 3), REST: round((f // 2 + 3) / f, 3)},
                                {GC: 0.0, KERNEL: round(2 / f, 3), REST: round((f // 2 - f // 20) / f, 3)}]
    assert uneven["more_often"] == [("gc_collect_main", round((f // 10) / f, 3)),
                                    ("_PyEval_EvalFrameDefault", round((f // 20) / f, 3)),
                                    ("[unknown]", round(3 / f, 3))]
    assert f"[unknown] +{3 / f:.3f} s" in printed.getvalue()  # printed as it is, not taken for a style
    assert "more_often" not in even and even["on_cpu"][0][GC] == 0.0
    assert f"the collector +{(f // 10) / f:.3f} s" in printed.getvalue().splitlines()[-1]
    assert more_often(_samples(1, 0, {"a": 3}), _samples(2, 0, {"a": 3})) == []


def test_perf_missing_or_refused_is_said_before_the_rounds_with_why(monkeypatch):
    import subprocess

    import bench.cpu_samples as cpu_samples

    monkeypatch.setattr(cpu_samples.shutil, "which", lambda _: None)
    assert cpu_samples.unavailable() == "perf is not installed (Debian: apt-get install linux-perf)"

    monkeypatch.setattr(cpu_samples.shutil, "which", lambda _: "/usr/bin/perf")
    refused = subprocess.CompletedProcess([], 255, "", "Error:\nNo permission to enable cpu-clock event.\n")
    monkeypatch.setattr(cpu_samples.subprocess, "run", lambda *a, **k: refused)
    monkeypatch.setattr(cpu_samples.os, "geteuid", lambda: 0)  # root: the kernel's setting does not stop it first
    assert cpu_samples.unavailable() == "perf record does not run: No permission to enable cpu-clock event."
