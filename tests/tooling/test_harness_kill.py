"""A process the harness kills takes the processes it started with it.

`payments api --workers N` is a supervisor and N workers. Killed alone, the
supervisor left its workers running after the test that started them, each
serving the port and using CPU until someone found them (two after every
`make test`). Likewise a bench stopped by a SIGTERM stops the services it
started (bench/system.py: `running`), instead of leaving them to run on.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil

import bench
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


# A bench that runs one service (a process that only sleeps) inside bench.system.running, and says so.
BENCH = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from bench.system import running\n"
    "from devtools.processes import Process, child_env\n"
    "sleeper = [sys.executable, '-c', 'import time; print(\"up\", flush=True); time.sleep(120)']\n"
    "service = Process('sleeper', sleeper, child_env(), Path(sys.argv[1]), ready_line='up')\n"
    "with running([service]):\n"
    "    print('service', service.pid, flush=True)\n"
    "    time.sleep(120)\n"
)


def test_a_bench_stopped_by_sigterm_stops_the_services_it_runs(tmp_path):
    """Bug caught: `kill` of a bench (a SIGTERM) ended it at once, and left its APIs and fakes running."""
    path = os.pathsep.join(filter(None, [str(Path(bench.__file__).parent.parent), os.environ.get("PYTHONPATH")]))
    log = tmp_path / "bench.log"
    runner = Process("bench", [sys.executable, "-c", BENCH, str(tmp_path / "sleeper.log")],
                     child_env(PYTHONPATH=path), log, ready_line="service ", timeout=60).start()
    service = psutil.Process(int(log.read_text().split("service ", 1)[1].split()[0]))
    assert service.is_running()

    try:
        runner.popen.send_signal(signal.SIGTERM)

        assert runner.wait(30) == 128 + signal.SIGTERM
        gone, alive = psutil.wait_procs([service], timeout=10)
        assert alive == [], "the service outlived the bench that was stopped"
    finally:
        runner.kill()
        if service.is_running():
            service.kill()  # the bug's leftover, not left for the next test
