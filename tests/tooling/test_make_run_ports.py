"""`make run` on a port already in use refuses at once: one line naming it, no banner, a non-zero exit.

The runner (devtools/run.py) runs for real, as `make run` runs it; it must stop
before it starts anything (PostgreSQL included) or prints how to pay.
"""

from __future__ import annotations

import socket
import subprocess
import sys

from devtools.processes import free_port


def test_a_second_make_run_on_a_busy_port_refuses_before_it_prints_or_starts_anything(tmp_path):
    with socket.socket() as held:  # the first `make run`'s API, say
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        ports = [str(free_port()) for _ in range(5)]
        result = subprocess.run(
            [sys.executable, "-m", "devtools.run", "--api-port", str(busy), "--psp-port", ports[0],
             "--rail-port", ports[1], "--merchant-port", ports[2]],
            env={"PATH": "/usr/bin:/bin", "PAYMENTS_DATA_DIR": str(tmp_path),
                 "API_METRICS_PORT": ports[3], "WORKER_METRICS_PORT": ports[4],
                 # Never reached: the check comes before the database.
                 "DATABASE_URL": "postgresql://u:p@127.0.0.1:1/x"},
            capture_output=True, text=True, timeout=120,
        )

    assert result.returncode == 2, result
    assert result.stdout == "", result
    assert result.stderr.splitlines() == [
        f"cannot start: API_PORT {busy} already in use (another `make run`?); stop it, or choose other ports "
        "(README.md#configuration)"], result
    assert not list(tmp_path.iterdir())  # no key, no token: nothing was set up
