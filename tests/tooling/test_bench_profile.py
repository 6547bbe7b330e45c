"""bench/profile.py's split of py-spy's samples by layer: each sample goes to the layer whose code it was in;
and the CPU of the sampled processes beside the samples."""

import os
import subprocess
import sys
from types import SimpleNamespace

import psutil
import pytest

from bench.profile import busy_and_cpu, layer_of, summarise
from bench.system import Service
from bench.watching import cpu_seconds


def test_a_sample_belongs_to_the_innermost_layer_on_its_stack_not_to_the_standard_library_it_ended_in():
    assert layer_of(["asyncio", "uvicorn", "fastapi", "app.api", "pydantic", "json"]) == "validation (pydantic)"
    assert layer_of(["asyncio", "app.machine", "sqlalchemy", "asyncpg"]) == "asyncpg"
    assert layer_of(["asyncio", "app.machine", "sqlalchemy", "re"]) == "SQLAlchemy"
    assert layer_of(["threading", "hashlib"]) == "other"


def test_h11_under_an_http_client_is_that_clients_and_h11_alone_is_the_server():
    assert layer_of(["asyncio", "app.rails", "httpx", "httpcore", "h11"]) == "the rail clients (aiohttp)"
    assert layer_of(["asyncio", "uvicorn", "h11"]) == "HTTP server and framework"


def test_an_http_client_under_the_outbox_is_the_webhook_dispatchers_not_a_rail_clients():
    assert layer_of(["asyncio", "app.rails", "aiohttp"]) == "the rail clients (aiohttp)"
    assert layer_of(["asyncio", "app.workers", "app.outbox", "aiohttp"]) == "the outbox"


def test_the_summary_gives_each_layer_its_share_of_all_samples():
    raw = "\n".join([
        "run (uvicorn/server.py:1);handle (fastapi/routing.py:2);validate (pydantic/main.py:3) 30",
        "run (uvicorn/server.py:1);execute (sqlalchemy/engine.py:4);fetch (asyncpg/connection.py:5) 50",
        "run (uvicorn/server.py:1);send (httpx/_client.py:6);write (h11/_connection.py:7) 20",
    ])
    layers = dict(summarise(raw)["self_by_layer"])
    assert layers == {"asyncpg": 50.0, "validation (pydantic)": 30.0, "the rail clients (aiohttp)": 20.0}


def test_the_cpu_beside_the_samples_counts_every_process_sampled():
    """With --workers 2 py-spy samples uvicorn's worker processes, children of the one it is given. Bugs
    caught: the service's tree without its descendants (their CPU left out), user or system time left out."""
    burn = ("import resource, sys\n"
            "while resource.getrusage(resource.RUSAGE_SELF).ru_utime < 0.3: pass\n"
            "print('burned', flush=True)\n"
            "sys.stdin.read()\n")  # alive until the test closes its stdin
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "burned\n"
        mine = psutil.Process().cpu_times()
        child_times = psutil.Process(child.pid).cpu_times()
        # What bench.profile reads for the API: its service's process tree (Service.tree reads only `pid`).
        me = SimpleNamespace(pid=os.getpid())
        total = cpu_seconds(SimpleNamespace(tree=lambda: Service.tree(me)))
    finally:
        child.communicate("")
    assert child_times.user >= 0.3
    assert total >= mine.user + mine.system + child_times.user + child_times.system


def test_busy_to_py_spy_and_on_a_cpu_are_shares_of_their_own_windows():
    assert busy_and_cpu(1265, 15.0, 9.75, 15.2) == (pytest.approx(1265 / 1500), pytest.approx(9.75 / 15.2))
