"""`make run`'s watch over its processes (devtools/run.py::supervise), with real child processes.

A process that exits on its own stops everything else and makes the run
fail. One whose output goes to a file rather than the terminal (the NATS
server's, since its start-up banner was moved off the terminal) would
otherwise die without a word on the screen: its last lines are printed
with the notice.
"""

from __future__ import annotations

import io
import os
import signal
import sys

import pytest
from rich.console import Console

from devtools.processes import Process
from devtools.run import supervise
from devtools.system import System


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
