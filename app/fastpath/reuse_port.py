"""One listening socket per API process, all on one port: how `payments api --workers N` spreads its connections.

Where it sits: before any request, in how `payments api` (app/cli.py) hands
its port to uvicorn's worker processes. uvicorn binds one socket in its
supervisor and every worker accepts from it; whichever worker wakes first
takes a new connection, and with long-lived keep-alive connections one
process can end up holding most of them while the other idles. Here each
worker binds a socket of its own with SO_REUSEPORT, and the kernel hands
every new connection to one of the listening sockets on the port, chosen
by a hash of the connection's addresses and ports. A worker that is still
starting has not listened yet, so it is sent nothing; one that dies leaves
the group, and the others get its share.

A hash is even on average, not for a few long-lived connections; so each
worker also keeps its share (`BalancedHttpToolsProtocol`): one holding more
than its share of the port's connections closes the excess after their next
answer, and their clients reconnect and are hashed afresh.

An optimisation: the service answers the same with uvicorn's one shared
socket (`--workers 1`, or a system without SO_REUSEPORT, uses it); it only
keeps a worker from idling while another is the bottleneck
(docs/reference/performance.md#api-workers-share-the-load measures it).
uvicorn's supervisor is kept as it is: signals, restarting a dead worker,
stopping when one cannot start. Only the socket it passes to each worker is
replaced by `PortPerProcess`, which is bound where it arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys

from uvicorn.config import STARTUP_FAILURE
from uvicorn.server import ServerState

from app.api.http_protocol import BoundedHttpToolsProtocol


def available() -> bool:
    """Whether this system spreads connections over sockets that share a port (Linux does, by a hash)."""
    # BSD and macOS accept SO_REUSEPORT too, but hand every connection to
    # one of the sockets: there the shared socket of uvicorn is kept.
    return sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def claim(host: str, port: int) -> int:
    """Check, in the supervisor, that `host:port` is free; the port (a port 0 is chosen here, once for all).

    The socket is bound without SO_REUSEPORT, so a port held by anything,
    another `payments api` included, refuses it (OSError): without this, a
    second API on the same port would join the first one's sockets and
    take half its connections instead of failing to start.
    """
    with socket.socket(_family(host)) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        return probe.getsockname()[1]


class PortPerProcess:
    """What uvicorn's supervisor passes each worker process instead of a socket: the port to bind one on.

    uvicorn pickles the sockets it gives a worker when it starts it;
    unpickled in the worker, this is a socket bound there, on the shared
    port, that only that worker accepts from. The worker listens on it
    once its app has started.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port

    def __reduce__(self) -> tuple[object, tuple[str, int]]:
        return bind, (self.host, self.port)


def bind(host: str, port: int) -> socket.socket:
    """A socket on `host:port` that shares the port with the other workers' (in the worker, at its start).

    A port taken since the supervisor claimed it ends this worker with
    uvicorn's start-up failure, on which the supervisor stops rather than
    restart it for ever.
    """
    sock = socket.socket(_family(host))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        # Logging is not configured yet in a worker this early.
        print(f"cannot listen on {host}:{port}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(STARTUP_FAILURE)
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


# --- Keeping the shares even ---------------------------------------------------

# How often a worker compares its share of the port's connections with the
# others' while connections come and go: a share set wrong when clients
# connect is put right within seconds.
CHECK_EVERY_SECONDS = 0.5
# How often once its share is settled, with no connection arriving. Reading
# the kernel's table of TCP sockets walks every bucket of its hash, empty or
# not: milliseconds of CPU on a server-sized machine, whatever the port
# holds (docs/reference/performance.md#the-shares-look-at-the-port-only-when-it-can-matter-2026-12-05).
# Rarely, then, and only for what no arrival shows: another worker's clients
# gone, or a worker started or restarted, either of which can leave this one
# over its share.
SETTLED_CHECK_SECONDS = 5.0
_LISTEN, _ESTABLISHED = "0A", "01"  # socket states as /proc/net/tcp writes them


def port_connections(port: int) -> tuple[int, int]:
    """The sockets listening on `port` (one per live worker) and the connections accepted on it, all processes'."""
    listening = established = 0
    suffix = f":{port:04X}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                next(rows, None)  # the header
                for row in rows:
                    fields = row.split(None, 4)
                    if len(fields) > 3 and fields[1].endswith(suffix):
                        listening += fields[3] == _LISTEN
                        established += fields[3] == _ESTABLISHED
        except OSError:
            pass
    return listening, established


def excess(held: int, listening: int, established: int, workers: int) -> int:
    """How many of its `held` connections a worker should let go for every worker to hold at most its fair share.

    Shared among the workers listening, at most `workers` of them: another
    program may listen on the same port at another address, and counted, it
    would make every share too small and the workers close connections for ever.
    """
    listening = min(listening, workers)
    if listening < 2:
        return 0
    fair = -(-established // listening)  # rounded up: a share of one connection more is fair too
    return max(0, held - fair)


class BalancedHttpToolsProtocol(BoundedHttpToolsProtocol):
    """The API's protocol, in a worker of `payments api --workers N`: a worker holding more than its share
    of the port's connections closes some after their next answer, and their clients reconnect.

    The kernel's hash spreads connections evenly on average, but of a few
    long-lived ones, many more can fall to one worker than to another, and
    stay there. A connection answered with `Connection: close` is opened again
    by its client, and hashed afresh: the excess halves at each check, and
    settles with no worker holding more than its share rounded up. What a
    client sees is HTTP's ordinary end of a kept-alive connection, after a
    whole answer.
    """

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        super().connection_made(transport)
        share = _shares.get(self.server_state)
        if share is None:
            share = _shares[self.server_state] = Share(self.server_state, self.config.port, self.config.workers)
            share.task = asyncio.get_running_loop().create_task(share.keep())
        share.arrived.set()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if getattr(self, "leaving", False) and self.cycle is not None:
            self.cycle.keep_alive = False  # answered with `Connection: close`, then closed


class Share:
    """One worker's share of the port's connections, kept: which of them leave, and when to look again."""

    def __init__(self, state: ServerState, port: int, workers: int) -> None:
        self.state, self.port, self.workers = state, port, workers
        self.arrived = asyncio.Event()  # a connection was accepted since the last look
        self.task: asyncio.Task[None] | None = None

    def check(self) -> int:
        """Mark this worker's connections beyond its share to close after their next answer; how many.

        A worker holding one connection or none is never over its share, and
        does not read the table: an API nobody is connected to costs nothing here.
        """
        staying = [c for c in self.state.connections if not getattr(c, "leaving", False)]
        if len(staying) <= 1:
            return 0
        over = excess(len(staying), *port_connections(self.port), self.workers)
        for connection in staying[:over]:
            connection.leaving = True  # type: ignore[attr-defined]
        return over

    async def keep(self) -> None:
        """Look every CHECK_EVERY_SECONDS while connections arrive or some were over; once settled, at the next
        arrival or after SETTLED_CHECK_SECONDS."""
        while True:
            await asyncio.sleep(CHECK_EVERY_SECONDS)
            # Arrivals until now are in this look's count: only a later one ends the settled wait.
            self.arrived.clear()
            if self.check() == 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(SETTLED_CHECK_SECONDS):
                        await self.arrived.wait()


# One per server: a worker process serves one, for its whole life.
_shares: dict[ServerState, Share] = {}
