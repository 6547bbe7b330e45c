"""`make run`'s watch over its processes (devtools/run.py::supervise), with real child processes.

A process that exits on its own stops everything else and makes the run
fail. One whose output goes to a file rather than the terminal (the NATS
server's, since its start-up banner was moved off the terminal) would
otherwise die without a word on the screen: its last lines are printed
with the notice. A Ctrl-C stops the supervisor alone, which stops the rest
in reverse: a consumer before its broker.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from rich.console import Console

from devtools.processes import Process
from devtools.run import supervise
from devtools.system import System

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def own_signal_handlers():
    """supervise() takes SIGTERM and SIGHUP, and ignores those and SIGINT while it cleans up: give all three back."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_process_that_exits_stops_the_rest_and_its_logs_last_lines_are_printed(tmp_path, own_signal_handlers):
    system = System()
    log = tmp_path / "broker.log"
    broker = Process("broker", [sys.executable, "-c", "print('banner'); print('fatal: the store is locked'); "
                                                      "raise SystemExit(3)"], dict(os.environ), log)
    steady = Process("steady", [sys.executable, "-c", "import time; time.sleep(120)"], dict(os.environ))
    screen = io.StringIO()

    def start() -> None:
        system.spawn(steady)
        system.spawn(broker)

    with pytest.raises(SystemExit) as failed:
        supervise(system, Console(file=screen, width=200), start)

    assert failed.value.code == 1  # not stopped by the user: `make run` must exit non-zero
    printed = screen.getvalue()
    assert "broker exited; stopping everything" in printed, printed
    assert f"the end of {log}:\nbanner\nfatal: the store is locked\n" in printed, printed
    assert broker.popen.returncode == 3
    assert not steady.running  # stopped with the rest, not left behind


# A stand-in for a broker or its consumer: on SIGINT or SIGTERM it logs which
# one it got (the consumer also whether the broker had already gone), then
# exits. Its log's "ready" is logged once its handlers are in place.
CHILD = """
import pathlib, signal, sys
broker_log = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else None
def stop(signum, frame):
    seen = ""
    if broker_log is not None:
        seen = "; the broker " + ("had gone" if "exiting" in broker_log.read_text() else "was up")
    print(signal.Signals(signum).name + seen, flush=True)
    print("exiting", flush=True)
    raise SystemExit(0)
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, stop)
print("ready", flush=True)
while True:
    signal.pause()
"""

# `make run` in miniature: a broker, then its consumer, supervised until Ctrl-C.
SUPERVISOR = """
import os, signal, sys
from pathlib import Path
from rich.console import Console
from devtools.processes import Process
from devtools.run import supervise
from devtools.system import System
signal.signal(signal.SIGINT, signal.default_int_handler)  # as at a terminal, whatever the test runner left
logs, child = Path(sys.argv[1]), sys.argv[2]
system = System(own_process_groups=True)
def start():
    system.spawn(Process("broker", [sys.executable, "-c", child], dict(os.environ), logs / "broker.log",
                         ready_line="ready"))
    system.spawn(Process("consumer", [sys.executable, "-c", child, str(logs / "broker.log")], dict(os.environ),
                         logs / "consumer.log", ready_line="ready"))
    print("all up", flush=True)
supervise(system, Console(), start)
"""


def test_ctrl_c_reaches_only_the_supervisor_which_stops_the_consumer_while_its_broker_is_up(tmp_path):
    # The terminal sends Ctrl-C's SIGINT to its foreground process group: the
    # supervisor's, in a session of its own here so that the test's own
    # process group is not in it.
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path), CHILD], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
    try:
        printed = []
        while (line := supervisor.stdout.readline()) and line != "all up\n":  # bounded by the readiness deadlines
            printed.append(line)
        assert line == "all up\n", "".join(printed)
        os.killpg(supervisor.pid, signal.SIGINT)
        printed.append(supervisor.communicate(timeout=60)[0])
    finally:
        if supervisor.poll() is None:  # failed: its children are in groups of their own, so each is killed too
            for child in psutil.Process(supervisor.pid).children(recursive=True):
                child.kill()
            os.killpg(supervisor.pid, signal.SIGKILL)
    assert supervisor.returncode == 0, "".join(printed)  # stopped by the user, not failed
    # Neither child saw the Ctrl-C; each was told to stop by the supervisor, the consumer first.
    assert (tmp_path / "consumer.log").read_text() == "ready\nSIGTERM; the broker was up\nexiting\n"
    assert (tmp_path / "broker.log").read_text() == "ready\nSIGTERM\nexiting\n"
