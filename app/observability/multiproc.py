"""The directory where `payments api`'s processes keep their metrics (PROMETHEUS_MULTIPROC_DIR), and /metrics.

Run by the parent process of `payments api` (app/cli.py), before uvicorn
starts a worker and before anything imports prometheus_client: the library
decides at its first import whether values live in memory or in files, by
this variable, and each worker inherits it. The same parent then serves
/metrics on API_METRICS_HOST:API_METRICS_PORT (`serve`), from the files of
all its worker processes: never on the API's public port, where anyone could
read it.

The directory must start empty: a file left by an earlier run holds that
run's counts under a process id, and /metrics would add them to this run's.
Given PROMETHEUS_MULTIPROC_DIR, its files are deleted at start-up (so it
must belong to this one `payments api`: two sharing one would empty each
other's); without it, a fresh temporary directory is made, and removed when
`payments api` exits.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"


def prepare() -> tuple[Path, bool]:
    """The directory, empty, and exported to this process and its children; and whether we made it."""
    # Imported already, prometheus_client has chosen in-memory values for
    # this process, and /metrics would show nothing it counted.
    assert "prometheus_client" not in sys.modules, "prepare the metrics directory before importing prometheus_client"
    given = os.environ.get(MULTIPROC_DIR)
    if given:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob("*.db"):
            stale.unlink()
        made = False
    else:
        path = Path(tempfile.mkdtemp(prefix="payments-metrics-"))
        made = True
    os.environ[MULTIPROC_DIR] = str(path)
    return path, made


def serve(host: str, port: int) -> Callable[[], None]:
    """/metrics on `host:port`, in a thread: every worker process's files added up; returns how to stop it.

    It reads the files only, so it defines no metric and flushes nothing:
    each process writes its own counts within a second
    (app/observability/metrics.py::flush). OSError if the port is taken.
    """
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry)
    server, thread = start_http_server(port, addr=host, registry=registry)

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    return stop


def remove(path: Path) -> None:
    """Remove a directory `prepare` made (at exit of the parent)."""
    shutil.rmtree(path, ignore_errors=True)
