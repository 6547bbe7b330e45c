"""Starting the system's own processes on one machine, and knowing when they are up.

Used by `payments run`, the test harness, the demos and the bench, which all
start the fake PSP, the fake rail and API processes as real processes.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable

import httpx


class NotHealthy(Exception):
    """The process exited, or did not answer /healthz in time."""


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answers_health(url: str) -> bool:
    try:
        return httpx.get(url + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(
    name: str,
    url: str,
    child: subprocess.Popen,
    *,
    timeout: float = 30,
    ready: Callable[[], bool] = lambda: True,
) -> None:
    """Poll `url`/healthz (and `ready`) until both say yes; bounded by `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if child.poll() is not None:
            raise NotHealthy(f"{name} exited with code {child.returncode}")
        if ready() and answers_health(url):
            return
        time.sleep(0.1)  # readiness polling, bounded by the deadline
    raise NotHealthy(f"{name} did not become healthy at {url}")


def stop_processes(*children: subprocess.Popen, grace: float = 10) -> None:
    """Stop each child still running: SIGTERM, then SIGKILL if it has not exited within `grace` seconds.

    SIGTERM first, and to all of them before waiting on any, so each gets the
    full grace to let go of what it holds (a worker its leases, uvicorn's
    master its workers).
    """
    running = [child for child in children if child.poll() is None]
    for child in running:
        child.terminate()
    for child in running:
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
