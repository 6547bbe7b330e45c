"""The CPU of a few services, how often they were woken, and their database sessions' CPU, at the same moments.

Some figures of the bench compare two services running at once, each with
half of the clients, so that whatever slows the machine slows both alike:
the service with and without webhooks (bench/outbox.py), the phased service
and the naive twin (bench/rate_at_once.py). Both sides reach the same
PostgreSQL server, often the same database, so a session is told apart by
its client port: the ports of each service's connections to the server,
matched against pg_stat_activity. A server reached over a Unix socket has
no client ports, and no session is then anyone's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import asyncpg
import psutil

from app.config import libpq_url
from bench.costs import cpu_of, wakeups_of
from bench.system import Service


def _session_cpu(pid: int) -> float | None:
    try:
        return cpu_of(psutil.Process(pid))
    except psutil.Error:  # the session ended between the listing and the read
        return None


@dataclass
class Mark:
    """CPU seconds so far: each role's processes, and every database session (by backend pid).

    And each role's processes' wake-ups so far (voluntary context switches).
    """

    processes: dict[str, dict[int, float]] = field(default_factory=dict)
    woken: dict[str, dict[int, int]] = field(default_factory=dict)
    sessions: dict[int, float] = field(default_factory=dict)
    owner: dict[int, str] = field(default_factory=dict)  # backend pid -> role


class Meter:
    """CPU marks of the roles (each a service, by the name the caller gives it) and of their database sessions."""

    def __init__(self, conn: asyncpg.Connection, server_url: str, roles: dict[str, Service]) -> None:
        self.conn, self.roles = conn, roles
        self.server_port = urlsplit(libpq_url(server_url)).port or 5432

    async def mark(self) -> Mark:
        mark = Mark()
        ports: dict[int, str] = {}
        for role, service in self.roles.items():
            tree = service.tree()
            mark.processes[role] = {p.pid: s for p in tree if (s := cpu_of(p)) is not None}
            mark.woken[role] = {p.pid: w for p in tree if (w := wakeups_of(p)) is not None}
            for process in tree:
                try:
                    connections = process.net_connections(kind="tcp")
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                for c in connections:
                    if c.raddr and c.raddr.port == self.server_port:
                        ports[c.laddr.port] = role
        await self.conn.execute("SELECT pg_stat_clear_snapshot()")
        for pid, port in await self.conn.fetch(
                "SELECT pid, client_port FROM pg_stat_activity WHERE backend_type = 'client backend'"):
            if (seconds := _session_cpu(pid)) is not None:
                mark.sessions[pid] = seconds
                if port in ports:
                    mark.owner[pid] = ports[port]
        return mark

    @staticmethod
    def spent(before: Mark, after: Mark, role: str) -> tuple[float, float]:
        """CPU seconds of the role's processes, and of its sessions, between the marks.

        A session that opened after `before` counts from zero: all of its CPU
        was spent in between.
        """
        processes = sum(s - before.processes.get(role, {}).get(pid, 0.0)
                        for pid, s in after.processes.get(role, {}).items())
        sessions = sum(s - before.sessions.get(pid, 0.0)
                       for pid, s in after.sessions.items() if after.owner.get(pid) == role)
        return processes, sessions

    @staticmethod
    def woken(before: Mark, after: Mark, role: str) -> int:
        """How many times the role's processes were woken between the marks (a new process counts from zero)."""
        return sum(w - before.woken.get(role, {}).get(pid, 0) for pid, w in after.woken.get(role, {}).items())
