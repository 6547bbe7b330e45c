"""Where each API worker's CPU went, round by round: `perf record` of the workers, split by process and by time.

Used by `bench.shares --perf`. `make bench` judges how evenly the API's
workers share its CPU; when one spends more than another in a round, the
bench's counters tell whether it served more answers or spent more on each
(bench/costs.py::CpuMeter.workers), but not on what. This samples the
workers' stacks on the CPU all through a run of rounds, and for each round
and worker counts the samples three ways: in Python's cyclic garbage
collector (anywhere on the stack), in the kernel (the innermost frame is
the kernel's: sockets, scheduling, page faults) and the rest (the requests'
own work in the interpreter and its C extensions). For a round past the
bound it also names the functions the busiest worker was found in more
often than the idlest.

`perf record -e cpu-clock` takes a sample of whatever a process is running
on a CPU, a fixed number of times a second of its CPU, so a worker's
samples are proportional to its CPU whatever the other processes do. The
samples are stamped with CLOCK_MONOTONIC, the clock of Python's
`time.monotonic()`, so that a round's window, taken in the bench's
process, picks out its samples. It needs `perf` (Debian's linux-perf) and
the right to sample another process (root, or kernel.perf_event_paranoid
at most 1); without either the run says so and stops.

perf prints a stack's frames innermost first; symbols come from the
binaries as they are (the interpreter's C functions, the extensions' and
the kernel's), not Python's own function names: "the collector", "the
kernel" and "json's encoder" are what it can tell apart.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

FREQUENCY = 499  # samples a second of a process's CPU; not a multiple of the kernel's tick, so not in step with it
GC, KERNEL, REST = "the collector", "the kernel", "the rest"
# Python's cyclic collector, by the C functions of a collection (CPython 3.11's gcmodule.c; later
# versions add a few names). The interpreter is built without frame pointers, so perf's walk up the
# stack from a function it calls is not to be trusted: a sample is the collector's when the
# collection is on the stack, or when the innermost function is one only a collection calls, the
# objects' traverse functions among them (dict_traverse, tupletraverse...).
_COLLECTOR = frozenset((
    "gc_collect_main", "gc_collect_with_callback", "gc_collect_generations", "gc_collect_region",
    "gc_collect_full", "gc_collect_young", "gc_collect_increment", "_PyGC_Collect", "deduce_unreachable",
    "update_refs", "subtract_refs", "visit_decref", "move_unreachable", "visit_reachable", "untrack_tuples",
    "untrack_dicts", "move_legacy_finalizers", "move_legacy_finalizer_reachable", "visit_move",
    "handle_weakrefs", "finalize_garbage", "check_garbage", "delete_garbage", "gc_list_merge",
))


@dataclass(frozen=True)
class Sample:
    pid: int
    time: float  # CLOCK_MONOTONIC, seconds
    frames: tuple[tuple[str, str], ...]  # (symbol, binary), innermost first


def parse(lines: Iterable[str]) -> Iterator[Sample]:
    """Samples from `perf script -F pid,time,ip,sym,dso`: a header line `pid time:`, then one line a frame, then a blank."""
    pid: int | None = None
    time = 0.0
    frames: list[tuple[str, str]] = []
    for line in lines:
        text = line.strip()
        if not text:
            if pid is not None:
                yield Sample(pid, time, tuple(frames))
            pid, frames = None, []
        elif pid is None:
            head, _, _ = text.partition(":")
            number, _, stamp = head.rpartition(" ")
            pid, time = int(number.strip().partition("/")[0]), float(stamp)
        else:
            # "7f0e1c2d3e4f gc_collect_main+0x1a2 (/usr/lib/libpython3.11.so)"
            _, _, rest = text.partition(" ")
            symbol, _, binary = rest.rpartition(" (")
            frames.append((symbol.rsplit("+0x", 1)[0] or "[unknown]", binary.removesuffix(")")))
    if pid is not None:
        yield Sample(pid, time, tuple(frames))


def kind(sample: Sample) -> str:
    """GC if a collection is on the stack (or the innermost function is one only a collection calls),
    KERNEL if the innermost frame is the kernel's, else REST."""
    if any(symbol in _COLLECTOR for symbol, _ in sample.frames) or (
            sample.frames and "traverse" in sample.frames[0][0]):
        return GC
    if sample.frames and sample.frames[0][1].startswith("[kernel"):
        return KERNEL
    return REST


def leaf(sample: Sample) -> str:
    """The innermost frame's function, the kernel's marked so."""
    if not sample.frames:
        return "[unknown]"
    symbol, binary = sample.frames[0]
    return f"{symbol} (kernel)" if binary.startswith("[kernel") else symbol


def by_window(samples: Iterable[Sample], windows: list[tuple[float, float]],
              pids: set[int]) -> list[dict[int, list[Sample]]]:
    """Each window's samples of each of `pids`; samples outside every window (the warm-ups) are dropped."""
    split: list[dict[int, list[Sample]]] = [{pid: [] for pid in pids} for _ in windows]
    ordered = sorted(range(len(windows)), key=lambda i: windows[i][0])
    for sample in samples:
        if sample.pid not in pids:
            continue
        for i in ordered:
            start, end = windows[i]
            if start <= sample.time <= end:
                split[i][sample.pid].append(sample)
                break
    return split


def seconds_by_kind(samples: list[Sample]) -> dict[str, float]:
    """A worker's CPU in a window, the collector's, the kernel's and the rest, as its samples estimate it."""
    counted = Counter(kind(s) for s in samples)
    return {k: round(counted[k] / FREQUENCY, 3) for k in (GC, KERNEL, REST)}


def more_often(busiest: list[Sample], idlest: list[Sample], n: int = 5) -> list[tuple[str, float]]:
    """The functions the busiest worker was found in more often than the idlest, in seconds of CPU, most first."""
    difference = Counter(leaf(s) for s in busiest)
    difference.subtract(Counter(leaf(s) for s in idlest))
    return [(name, round(count / FREQUENCY, 3)) for name, count in difference.most_common(n) if count > 0]


def unavailable() -> str | None:
    """Why `perf record` cannot sample the workers here, or None if it can."""
    if shutil.which("perf") is None:
        return "perf is not installed (Debian: apt-get install linux-perf)"
    try:
        paranoid = int(Path("/proc/sys/kernel/perf_event_paranoid").read_text())
    except (OSError, ValueError):
        paranoid = None  # not said here: the recording below tells
    if paranoid is not None and paranoid > 1 and os.geteuid() != 0:
        return f"kernel.perf_event_paranoid is {paranoid}: sampling another process needs root or at most 1"
    # A recording of a command that exits at once: what stops perf here (a container without the
    # event, a kernel without it) stops it there too, before the rounds rather than after them.
    tried = subprocess.run(["perf", "record", "-e", "cpu-clock", "-o", os.devnull, "--", "true"],
                           capture_output=True, text=True, timeout=60)
    if tried.returncode != 0:
        return f"perf record does not run: {(tried.stderr.strip().splitlines() or ['no message'])[-1]}"
    return None


class Recording:
    """`perf record` of some processes' stacks on the CPU while in the block; `samples()` afterwards."""

    def __init__(self, pids: Iterable[int]) -> None:
        self.pids = sorted(pids)
        self.directory = tempfile.TemporaryDirectory(prefix="bench-perf-")
        self.data = Path(self.directory.name) / "perf.data"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Recording:
        self.process = subprocess.Popen(
            ["perf", "record", "-e", "cpu-clock", "-F", str(FREQUENCY), "-g", "-k", "CLOCK_MONOTONIC",
             "-p", ",".join(map(str, self.pids)), "-o", str(self.data)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return self

    def __exit__(self, *_: object) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGINT)  # perf writes its file and exits on an interrupt
        _, errors = self.process.communicate(timeout=120)
        if self.process.returncode not in (0, -signal.SIGINT) or not self.data.exists():
            raise RuntimeError(f"perf record failed ({self.process.returncode}): {errors.decode(errors='replace')[-500:]}")

    def samples(self) -> Iterator[Sample]:
        script = subprocess.Popen(["perf", "script", "-i", str(self.data), "-F", "pid,time,ip,sym,dso"],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, errors="replace")
        assert script.stdout is not None
        yield from parse(script.stdout)
        script.wait()

    def close(self) -> None:
        self.directory.cleanup()
