"""Development tooling, not the payment path: the one process harness.

Used by `make run` (devtools/run.py), the tests (tests/conftest.py), the
demos (demos/system.py) and the bench (bench/system.py), which all start the
fake PSP, the fake rail, API processes and workers as real processes. Nothing
in app/ imports it.

A `Process` is one of them: started, and waited for until it is up (its
/healthz answers, or, for the worker, its log says "worker started"), then
stopped (SIGTERM, then SIGKILL after a grace) or killed. Its environment is
explicit (`child_env`): a few of the caller's variables that a program needs
to run at all, plus the settings the harness chooses, so a PAYMENTS_CRASH_AT
or a LEASE_SECONDS exported in the caller's shell never changes a test.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

# The virtualenv's scripts: payments, fake-psp, fake-rail.
BIN = Path(sys.executable).parent

# What a child may inherit from the caller: what it needs to run (find
# programs, a home, a locale, a temporary directory, certificates) and
# PYTHONPATH (`make mutants` points it at a mutated copy of the code; unset,
# it names this checkout: TREE below). None of the service's settings: those
# the harness sets itself.
INHERITED = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH",
             "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
INHERITED_PREFIXES = ("LC_",)


# The checkout these modules were imported from. The virtualenv's scripts
# find `app` through the editable install, which names the checkout that ran
# `make install`: run from another one (a worktree of an older commit, for a
# before and after), the harness would start that checkout's code, not its
# own. So a child's PYTHONPATH names this one unless the caller set it.
TREE = Path(__file__).resolve().parents[1]


def child_env(**settings: str) -> dict[str, str]:
    """An explicit environment: the allow-listed variables of ours, plus `settings`."""
    inherited = {
        name: value for name, value in os.environ.items()
        if name in INHERITED or name.startswith(INHERITED_PREFIXES)
    }
    inherited.setdefault("PYTHONPATH", str(TREE))
    return inherited | settings


class NotHealthy(Exception):
    """The process exited, or did not become ready in time."""


# The ports free_port has handed out in this process. Nobody listens on a
# port it returns, but nobody has yet either: the kernel may offer the same
# port again before its taker binds it. An API was once given one port for
# its metrics and the same one for itself; its metrics server took it,
# answered the readiness poll (any path answers 200 there), and uvicorn then
# could not bind it and exited.
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on right now, and never one this process was given before.

    Taken, where the machine leaves room, from below the kernel's range of
    ephemeral ports: the kernel gives the ports of that range to outgoing
    connections (to PostgreSQL, to the fakes), and one could be given a port
    between the moment it is found free here and the moment the child this
    port is for binds it; the child then cannot start ("Address already in
    use"). Below the range only a listener can take it. Each process walks a
    block of its own there (a pytest-xdist worker's by its number, or the one
    PORT_BLOCK names), so two test workers never hand out the same port
    either.
    """
    for port in _candidates():
        if port in _handed_out:
            continue
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port))
        except OSError:
            continue  # somebody listens there
        _handed_out.add(port)
        return port
    while True:  # no room below the ephemeral range, or the block is used up: any port the kernel offers
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port


# The blocks free_port walks: _BLOCK ports each, from _LOWEST up to the
# first ephemeral port. A pytest-xdist worker walks the block after its
# number (gw0: block 1). A process may be given a block by PORT_BLOCK:
# `make mutants` gives each of its pytest sessions at once one from the top,
# since sessions without -n would otherwise share block 0. Block 0 is for
# every other process (the bench, `make run`, a test run without -n); each
# of those starts at a place of its own in it, by its process id.
_LOWEST, _BLOCK = 10000, 1000


def port_blocks() -> int:
    """How many blocks of ports there are below this machine's ephemeral range."""
    return max(0, (_first_ephemeral_port() - _LOWEST) // _BLOCK)


def _candidates() -> list[int]:
    """This process's block below the ephemeral range, from its own starting place round to it; [] if no room."""
    given = os.environ.get("PORT_BLOCK", "")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if given.isdigit():
        number = int(given)
    else:
        number = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    if number >= port_blocks():
        return []
    start = _LOWEST + number * _BLOCK
    offset = 0 if number else os.getpid() % _BLOCK
    return [start + (offset + i) % _BLOCK for i in range(_BLOCK)]


def _first_ephemeral_port() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _LOWEST  # not Linux, or not readable: no room known, so the kernel's offer


def answers_health(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(url + "/healthz").status_code == 200
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
    """Poll `url`/healthz (and `ready`) until both say yes; bounded by `timeout`.

    One client for the whole wait: building one (its TLS context, unused on
    loopback HTTP) costs the test process more than the poll it makes.
    """
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1) as client:
        while time.monotonic() < deadline:
            if child.poll() is not None:
                raise NotHealthy(f"{name} exited with code {child.returncode}")
            if ready() and answers_health(client, url):
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


@dataclass
class Process:
    """One process of the system, started and known to be up.

    `port`: it serves HTTP there, and is up once /healthz answers 200 (and
    `ready()` says yes, if given). `ready_line`: it is up once its log holds
    that line (the worker's "worker started"). Neither: up once spawned.
    `log`: where its output goes (appended); None leaves it on our terminal.
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path | None = None
    port: int | None = None
    ready_line: str | None = None
    ready: Callable[[], bool] | None = None
    timeout: float = 30
    grace: float = 10
    # Run it as this user (we are root and it should not be: nginx).
    user: str | None = None
    # In a process group of its own: a Ctrl-C at the terminal then reaches
    # only the supervisor that started it, which stops its processes one by
    # one in reverse (System(own_process_groups=True), for `make run`).
    own_group: bool = False
    popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.popen is not None, f"{self.name} was never started"
        return self.popen.pid

    def start(self) -> Process:
        """Spawn it and wait until it is up; NotHealthy (with its log's tail) if it is not."""
        group = 0 if self.own_group else None  # 0: a new group, named by the child's pid
        if self.log is None:
            # A group that is not the terminal's foreground is stopped (SIGTTIN)
            # if it reads the terminal: such a child reads nothing instead.
            stdin = subprocess.DEVNULL if self.own_group else None
            self.popen = subprocess.Popen(self.argv, env=self.env, user=self.user, process_group=group, stdin=stdin)
        else:
            self.log.parent.mkdir(parents=True, exist_ok=True)
            with self.log.open("ab") as log:
                self.popen = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL, user=self.user, process_group=group)
        try:
            if self.port is not None:
                wait_healthy(self.name, self.url, self.popen, timeout=self.timeout, ready=self.ready or (lambda: True))
            elif self.ready_line is not None:
                self._wait_for_line(self.ready_line)
        except NotHealthy as exc:
            tail = self.tail(20)
            raise NotHealthy(f"{exc}" + (f":\n{tail}" if tail else "")) from None
        return self

    def _wait_for_line(self, line: str) -> None:
        assert self.log is not None, "a ready line needs a log to look in"
        deadline = time.monotonic() + self.timeout
        while line not in self.log.read_text(errors="replace"):
            if self.popen.poll() is not None:
                raise NotHealthy(f"{self.name} exited with code {self.popen.returncode} before logging {line!r}")
            if time.monotonic() > deadline:
                raise NotHealthy(f"{self.name} did not log {line!r} within {self.timeout:.0f} s")
            time.sleep(0.02)  # readiness polling, bounded by the deadline

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def wait(self, timeout: float = 10) -> int | None:
        """Its exit code once it exits; None if it is still running after `timeout` seconds."""
        try:
            return self.popen.wait(timeout) if self.popen else None
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within its grace."""
        if self.popen:
            stop_processes(self.popen, grace=self.grace)

    def kill(self) -> None:
        """SIGKILL, no grace (a crash, or a test's quick clean-up), of it and of every process it started.

        `payments api --workers N` is a supervisor and N worker processes: the
        supervisor killed alone leaves its workers running, serving the port,
        with nobody to stop them (as they would be after a machine's crash,
        which takes them too).
        """
        if self.running:
            try:
                children = psutil.Process(self.popen.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                children = []
            self.popen.kill()
            for child in children:
                try:
                    child.kill()
                except psutil.NoSuchProcess:
                    pass
            self.popen.wait(10)

    def tail(self, lines: int = 3) -> str:
        """The last `lines` lines of its log ("" if it has none)."""
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
        except FileNotFoundError:
            return ""
