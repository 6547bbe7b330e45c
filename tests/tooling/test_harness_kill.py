"""A process the harness kills takes the processes it started with it.

`payments api --workers N` is a supervisor and N workers. Killed alone, the
supervisor left its workers running after the test that started them, each
serving the port and using CPU until someone found them (two after every
`make test`).
"""

from __future__ import annotations

import sys

import psutil

from devtools.processes import Process, child_env

# A parent that starts a child which would outlive it, then says so on its output.
PARENT = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('child', child.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_killing_a_process_kills_the_processes_it_started(tmp_path):
    log = tmp_path / "parent.log"
    parent = Process("parent", [sys.executable, "-c", PARENT], child_env(), log, ready_line="child ").start()
    child_pid = int(log.read_text().split("child ", 1)[1].split()[0])
    child = psutil.Process(child_pid)
    assert child.is_running()

    parent.kill()

    # Bug caught: the child still running once its parent is gone.
    gone, alive = psutil.wait_procs([child], timeout=10)
    assert alive == [], "the child outlived its killed parent"
