"""The processes the tests, the demos and the bench start get an explicit environment.

A PAYMENTS_CRASH_AT, a LEASE_SECONDS or a DATABASE_URL exported in the
caller's shell must not change what a test's API or worker does: the harness
(devtools/processes.py::child_env, devtools/system.py::System.service_env)
passes on only what a program needs to run, plus the settings it chooses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from devtools import processes
from devtools.processes import child_env
from devtools.system import System
from tests.conftest import TEST_SETTINGS, service_setting_names

CALLERS = {
    "LEASE_SECONDS": "1",
    "PAYMENTS_CRASH_AT": "after-call-EXT1",
    "MAX_ATTEMPTS": "1",
    "PSP_URL": "http://127.0.0.1:1",
    "DATABASE_URL": "postgresql://someone@elsewhere/theirs",
    "FAKE_RAILS_DATABASE_URL": "postgresql://someone@elsewhere/records",
}


def test_an_api_started_by_the_harness_does_not_inherit_the_callers_settings(monkeypatch, tmp_path):
    for name, value in CALLERS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONPATH", "/somewhere/mutated")  # `make mutants` relies on it passing through
    system = System(tmp_path, settings=TEST_SETTINGS)
    system.database_url = "postgresql://postgres@127.0.0.1:5432/payments_test"

    api = system.api_process("api", LEASE_SECONDS="7")
    worker = system.worker_process("worker")
    psp = system.fake_process("psp")

    assert api.env["LEASE_SECONDS"] == "7", "what the harness sets, it sets"
    assert "PAYMENTS_CRASH_AT" not in api.env and "MAX_ATTEMPTS" not in api.env and "PSP_URL" not in api.env
    assert api.env["DATABASE_URL"] == system.database_url
    assert api.env["PSP_TIMEOUT_SECONDS"] == TEST_SETTINGS["PSP_TIMEOUT_SECONDS"]
    for name in ("LEASE_SECONDS", "PAYMENTS_CRASH_AT", "MAX_ATTEMPTS", "PSP_URL"):
        assert name not in worker.env and name not in psp.env, name
    assert "FAKE_RAILS_DATABASE_URL" not in psp.env and psp.env["DATABASE_URL"] == system.database_url
    for env in (api.env, worker.env, psp.env):
        assert env["PYTHONPATH"] == "/somewhere/mutated"
        assert env["PATH"] == os.environ["PATH"]


def test_a_child_runs_the_code_of_the_checkout_that_started_it(tmp_path):
    # Bug caught: a harness run from another checkout (a worktree of an older
    # commit, for a before and after) starting the services of the checkout
    # the editable install names, so both sides measured the same code.
    other = tmp_path / "checkout"
    shutil.copytree(Path(processes.__file__).parent, other / "devtools",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (other / "app").mkdir()
    (other / "app" / "__init__.py").write_text("")
    start_a_child = (
        "import subprocess, sys\n"
        "from devtools.processes import child_env\n"
        "subprocess.run([sys.executable, '-c', 'import app; print(app.__file__)'], env=child_env(), cwd='/',"
        " check=True)\n"
    )
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    ran = subprocess.run([sys.executable, "-c", start_a_child], cwd=other, env=env,
                         capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == str(other / "app" / "__init__.py"), ran


def test_the_explicit_environment_is_an_allow_list(monkeypatch):
    monkeypatch.setenv("LC_ALL", "C.UTF-8")
    monkeypatch.setenv("SOME_TOKEN", "secret")
    monkeypatch.setenv("LEASE_SECONDS", "1")

    env = child_env(DATABASE_URL="postgresql://postgres@127.0.0.1/x")

    assert env["LC_ALL"] == "C.UTF-8"
    assert "SOME_TOKEN" not in env and "LEASE_SECONDS" not in env
    assert env["DATABASE_URL"] == "postgresql://postgres@127.0.0.1/x"


def test_the_test_session_does_not_read_the_callers_service_settings():
    # tests/conftest.py::no_caller_settings took them out of os.environ for
    # the session, so a Settings(...) built in this process reads none.
    assert service_setting_names(os.environ) == []
    assert set(service_setting_names({"lease_seconds": "1", "PAYMENTS_CRASH_AT": "x", "PATH": "/bin"})) == {
        "lease_seconds", "PAYMENTS_CRASH_AT"}


def test_free_port_never_hands_out_the_same_port_twice_in_one_process(monkeypatch):
    """Two ports asked for one after the other (an API's own and its metrics') are always two ports."""
    import socket

    from devtools import processes

    offered = iter([41001, 41001, 41002])  # the kernel offering the same port again

    class Offer:
        def __init__(self, *args):
            self.port = next(offered)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            pass

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(processes, "_handed_out", set())
    monkeypatch.setattr(processes, "_candidates", lambda: [])  # no room below the ephemeral range
    monkeypatch.setattr(socket, "socket", Offer)
    assert [processes.free_port(), processes.free_port()] == [41001, 41002]


def test_free_port_hands_out_ports_below_the_ephemeral_range_each_xdist_worker_its_own(monkeypatch):
    # Bug caught: a port taken from the kernel's ephemeral range, which the
    # kernel may give to an outgoing connection before the child binds it
    # (an API once exited with "cannot serve metrics on ... Address already
    # in use" that way), or two test workers walking the same ports.
    from devtools import processes

    first_ephemeral = processes._first_ephemeral_port()
    if first_ephemeral - processes._LOWEST < 3 * processes._BLOCK:
        pytest.fail(f"this machine's ephemeral range starts at {first_ephemeral}: no room below it to test")
    monkeypatch.setattr(processes, "_handed_out", set())
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    gw0 = {processes.free_port() for _ in range(20)}
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    gw1 = {processes.free_port() for _ in range(20)}
    assert len(gw0) == len(gw1) == 20 and not gw0 & gw1
    assert all(port < first_ephemeral for port in gw0 | gw1)


def test_free_port_walks_the_block_port_block_names(monkeypatch):
    # Bug caught: two pytest sessions without -n at once (`make mutants`'
    # jobs) walking block 0 from neighbouring process ids, so that one hands
    # out a port the other has handed out and not bound yet.
    from devtools import processes

    if processes.port_blocks() < 3:
        pytest.fail(f"this machine's ephemeral range starts at {processes._first_ephemeral_port()}: no room to test")
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    ports = {}
    for block in (1, 2):
        monkeypatch.setattr(processes, "_handed_out", set())  # each as a process of its own
        monkeypatch.setenv("PORT_BLOCK", str(block))
        ports[block] = {processes.free_port() for _ in range(20)}
    first, second = (processes._LOWEST + block * processes._BLOCK for block in (1, 2))
    assert all(first <= port < second for port in ports[1])
    assert all(second <= port < second + processes._BLOCK for port in ports[2])


def test_free_port_skips_a_port_somebody_listens_on(monkeypatch):
    import socket

    from devtools import processes

    monkeypatch.setattr(processes, "_handed_out", set())
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        monkeypatch.setattr(processes, "_candidates", lambda: [taken, taken + 1])
        port = processes.free_port()
    assert port != taken
