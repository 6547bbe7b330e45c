"""`payments api --workers N`: each worker process listens on a socket of its own, on the one port.

What spreads the connections over the workers (app/fastpath/reuse_port.py): the
kernel chooses among the listening sockets that share the port, so each
worker must hold one and the supervisor none (a socket of the supervisor's,
shared by the workers, is uvicorn's default, the one that let keep-alive
connections pile onto one worker). Sharing a port is also how a second API
could take half of the first one's connections: it must be refused.
"""

from __future__ import annotations

import asyncio
import subprocess

import psutil

from devtools.processes import free_port
from tests.support import until


def listening(processes: list[psutil.Process], port: int) -> list[psutil.Process]:
    """Those of `processes` that hold a socket listening on `port`."""
    return [p for p in processes
            if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in p.net_connections("tcp"))]


async def test_each_worker_listens_on_its_own_socket_and_a_second_api_on_the_port_is_refused(processes):
    api = processes.system.start_api("two-workers", args=("--workers", "2"))
    supervisor = psutil.Process(api.pid)

    async def both_listen() -> bool:
        return len(listening(supervisor.children(recursive=True), api.port)) == 2

    await until(both_listen, "both worker processes to listen on the API's port")
    assert listening([supervisor], api.port) == [], "the supervisor holds a socket the workers share"

    # Bounded: a second API that joined the port would serve until killed.
    second = processes.system.api_process("second", port=api.port, args=("--workers", "2"),
                                          API_METRICS_PORT=str(free_port()))
    done = await asyncio.to_thread(subprocess.run, second.argv, env=second.env, capture_output=True, text=True,
                                   timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "Address already in use" in done.stdout + done.stderr
