"""Development tooling, not the payment path: `make soak-ha`, the chaos soak on a database that fails over.

    python -m devtools.soak_ha --seed 1 --payments 450 --seconds 180 --kills 2
    python -m devtools.soak_ha --short            # what CI runs: one kill, one switchover, standbys gone, a partition

The soak of `make soak` (devtools/soak.py: calm run, chaos run, calm phase,
the three-way audit), with our database on the HA cluster of devtools/ha.py
(three PostgreSQL nodes under Patroni, synchronous and strict, behind
HAProxy) and the fakes' records on a private embedded server outside it.
Beside the soak's own chaos (replicas and workers killed and frozen, fault
plans on the PSP and the rail; its PostgreSQL restart is left out: the
failovers replace it), the chaos run takes, one after the other, each
finished before the next starts:

- `kill_primary` (--kills times): SIGKILL of the primary's Patroni and of
  its PostgreSQL (postmaster and every backend) at once, a machine dying;
  Patroni elects the synchronous standby once the leader key expires (TTL);
  the dead node is started again and rejoins as a standby (pg_rewind);
- `switchover`: a planned one, through Patroni's REST API;
- `stall_primary` (not in --short): SIGSTOP of the primary's Patroni and
  PostgreSQL together, past the TTL, then SIGCONT: the old primary wakes up
  believing it leads, and must not take a write the service relies on:
  the moment it wakes, a write is sent straight to it (past HAProxy), and
  an acknowledged commit there fails the run, as does a failover that did
  not complete;
- `partition_primary` (only where network namespaces can be made: as
  root, with iproute2; said loudly where not): the cluster
  then runs with each node in a network namespace of its own
  (devtools/netns.py), and the primary's link is cut: Patroni elects a new
  primary once the leader key expires, and the old one's agent, unable to
  reach etcd, demotes it. From inside its namespace a write is sent to it
  the moment it is cut, again once it is demoted, again the moment its
  link is restored, and again once it has rejoined as a standby, which it
  must; an acknowledged one fails the run.
- `standbys_gone`: both standbys stopped (SIGSTOP of their Patroni and
  PostgreSQL) while the primary stays, so in strict synchronous mode every
  commit waits; payments offered then must each be answered 503 with
  Retry-After within the service's bound (DB_PHASE_TIMEOUT_SECONDS, twice,
  below nginx's read timeout), never a 500 or a 504; then the standbys come
  back and the same payments, retried with their keys, must finish exactly
  once (they join the audit). No node's log may show a synchronous wait
  cancelled by a request meanwhile ("canceling wait for synchronous
  replication due to user request"): the service gives up on a waiting
  commit by dropping its connection, never by cancelling it.

The audit adds, to the soak's checks: every final answer a client got is
asked again at the end and must come back byte for byte; every PSP charge
and rail transfer belongs to one payment; no answer was a 500. Per
failover it reports how long the cluster took to route to a new primary and
the recovery time (the first payment offered after the failure began that
got its final answer), median and max, beside the throughput against the
calm run. docs/failover.md#the-soak-make-soak-ha has the figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import httpx
from rich.console import Console

from app.config import Settings
from devtools import embedded_db, netns, soak
from devtools.bodies import payment_body
from devtools.ha import INSTALL_HINT, TTL, HaCluster, find_programs
from devtools.processes import child_env, free_port
from devtools.system import System, with_database

FAILOVERS = ("kill_primary", "switchover", "stall_primary", "partition_primary")
# CI's short run keeps the partition: what it adds to the run is measured in docs/failover.md#figures.
SHORT = {"payments": 150, "seconds": 60, "kills": 1, "stall": False, "partition": True}
# standbys_gone: payments offered while both standbys are stopped, one a second, and how long they stay
# stopped at least; the service's bound on one wait at the database (its default), met at most twice
# per request, below nginx's read timeout.
GONE_PROBES, GONE_SECONDS = 6, 10.0
PHASE_BOUND = Settings.model_fields["db_phase_timeout_seconds"].default
ANSWER_LIMIT = 2 * PHASE_BOUND + 0.5
CANCELLED_SYNC_WAIT = b"canceling wait for synchronous replication due to user request"


class HaChaos(soak.Chaos):
    """The soak's chaos without its PostgreSQL restart: the failovers of HaHooks take its place."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        # Set by standbys_gone while it times answers: a replica frozen then would cost nginx's
        # read timeout by itself, whatever the database does, so none is frozen meanwhile.
        self.no_freezing = threading.Event()

    def first_actions(self) -> list[Any]:
        return [a for a in super().first_actions() if a != self.restart_postgres]

    async def freeze_api(self) -> None:
        if not self.no_freezing.is_set():
            await super().freeze_api()


class HaHooks(soak.Hooks):
    """The failovers, run one after another beside the soak's chaos, and their figures."""

    ask_again = True

    def __init__(self, plan: list[str], console: Console, command: str, base_port: int = 0,
                 lag: float = 0, partition_skipped: str | None = None) -> None:
        self.plan, self.console, self.command, self.base_port = plan, console, command, base_port
        self.lag = lag  # > 0: asynchronous replication, every standby held this far behind before each kill
        # A partition needs each node in a namespace of its own; why it could not be run, if it could not.
        self.namespaces = "partition_primary" in plan
        self.partition_skipped = partition_skipped
        self.ha: HaCluster  # made by start_cluster
        self.events: list[dict[str, Any]] = []
        self.probes: list[soak.Payment] = []  # made by standbys_gone, audited with the rest
        self.results: Path  # set by start_cluster

    def chaos(self, cluster: soak.Cluster, rng: Any, reject_refs: list[str], console: Console) -> soak.Chaos:
        self.soak_chaos = HaChaos(cluster, rng, reject_refs, console)
        return self.soak_chaos

    async def during_chaos(self, clients: soak.Clients, load_done: asyncio.Event) -> None:
        await asyncio.sleep(5)  # some load on the primary first
        for action in self.plan:
            event = {"action": action, "at": time.time()}
            self.events.append(event)
            try:
                await asyncio.to_thread(getattr(self, action), event)
            except Exception as exc:  # shown in the report as a finding; the soak goes on to its audit
                event["failed"] = repr(exc)[:300]
            self.console.print(f"  failover: {action} " + " ".join(
                f"{k}={v}" for k, v in event.items() if k not in ("action", "at")), highlight=False)
            await asyncio.sleep(3)

    # -- the failovers (in a thread: they block) ---------------------------------

    def kill_primary(self, event: dict[str, Any]) -> None:
        old = self._leader()
        receivers = [pid for node in self.ha.nodes if node is not old for pid in node.wal_receivers()]
        if self.lag:
            # The loss is not left to chance (on loopback a standby is never behind): the standbys stop
            # receiving while the primary goes on committing; then it dies, and what they had not
            # received dies with it (their WAL receivers are killed, with whatever sat in their sockets).
            for pid in receivers:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(self.lag)
            event["standbys_behind_seconds"] = self.lag
        event["at"] = time.time()
        old.signal_all(signal.SIGKILL)
        if self.lag:
            for pid in receivers:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        event["node"] = old.name
        self._routed_elsewhere(old.name, event, TTL + 60)
        self.ha.restart_agent(old)
        self.ha.wait_healthy(120)
        event["rejoined_seconds"] = round(time.time() - event["at"], 1)

    def switchover(self, event: dict[str, Any]) -> None:
        old = self._leader()
        event["at"] = time.time()
        answer = self.ha.switchover()
        event["node"], event["answer"] = old.name, answer["answer"][:80]
        self._routed_elsewhere(old.name, event, 60)
        self.ha.wait_healthy(120)
        event["rejoined_seconds"] = round(time.time() - event["at"], 1)

    def stall_primary(self, event: dict[str, Any]) -> None:
        old = self._leader()
        event["at"] = time.time()
        stopped = old.signal_all(signal.SIGSTOP)
        event["node"] = old.name
        try:
            self._routed_elsewhere(old.name, event, TTL + 60)
        finally:
            _resume(stopped)
        event["stalled_seconds"] = round(time.time() - event["at"], 1)
        # It woke up as the primary it was: Patroni must see the key is another's and demote it.
        woke = time.time()
        event["direct_write_to_old_primary"] = asyncio.run(fence_probe(old.pg_port, host=old.host))
        deadline = woke + 120
        while not any(m["name"] == old.name and m.get("role") != "leader" for m in self.ha.members()):
            if time.time() > deadline:
                raise RuntimeError(f"{old.name} was not demoted within 120 s of waking")
            time.sleep(0.2)  # polling Patroni's view, bounded by the deadline
        event["demoted_seconds_after_waking"] = round(time.time() - woke, 1)
        self.ha.wait_healthy(120)
        event["rejoined_seconds"] = round(time.time() - event["at"], 1)

    def partition_primary(self, event: dict[str, Any]) -> None:
        network = self.ha.network
        assert network is not None, "a partition needs the cluster in namespaces"
        old = self._leader()
        inside = network.inside(old.name, workers=3)  # what the old primary's own processes can reach
        seen: list[dict[str, Any]] = []
        watching = threading.Event()

        def write(timeout: float) -> Any:
            return inside.submit(asyncio.run, watched_write(old.host, old.pg_port, timeout))

        try:
            inside.submit(watch_agent, old.rest, seen, watching)
            event["at"] = time.time()
            network.cut(old.name)
            event["node"] = old.name
            # Sent the moment it is cut, while it still runs as primary and lists a synchronous
            # standby it can no longer reach: its commit has nobody to wait for.
            while_cut = write(TTL + 30)
            self._routed_elsewhere(old.name, event, TTL + 60)
            deadline = time.time() + TTL + 60
            while not (demoted := [s for s in seen[1:] if (s["role"], s["state"]) != ("primary", "running")]):
                if time.time() > deadline:
                    raise RuntimeError(f"{old.name}, cut off, still ran as primary {TTL + 60} s after the cut")
                time.sleep(0.2)  # polling the agent's own view (from inside its namespace), bounded
            event["demoted_seconds"] = demoted[0]["seconds"]
            event["write_while_cut"] = while_cut.result(timeout=TTL + 60)
            event["write_once_demoted"] = write(10).result()
            network.restore(old.name)
            event["cut_seconds"] = round(time.time() - event["at"], 1)
            event["write_after_restore"] = write(10).result()
            self.ha.wait_healthy(120)
            # Healthy counts the old primary as running once its agent has started it read-only, before
            # it has rewound it and started it again as a standby: wait until it streams, so the figure
            # and the last write are of the standby it has become.
            deadline = time.time() + 120
            while not any(m["name"] == old.name and m.get("state") == "streaming" for m in self.ha.members()):
                if time.time() > deadline:
                    raise RuntimeError(f"{old.name} did not stream from the new primary within 120 s")
                time.sleep(0.2)  # polling Patroni's view, bounded by the deadline
            event["rejoined_seconds"] = round(time.time() - event["at"], 1)
            event["rejoined_as"] = next((m.get("role") for m in self.ha.members() if m["name"] == old.name), None)
            event["write_after_rejoining"] = write(10).result()
        finally:
            network.restore(old.name)
            watching.set()
            inside.shutdown(wait=True)
            event["old_primary_by_its_agent"] = " -> ".join(f"{s['seconds']} s {s['role']}/{s['state']}"
                                                            for s in seen)

    def standbys_gone(self, event: dict[str, Any]) -> None:
        leader = self._leader()
        standbys = [n for n in self.ha.nodes if n is not leader]
        self.soak_chaos.no_freezing.set()
        deadline = time.monotonic() + 30
        while self.soak_chaos.c.frozen and time.monotonic() < deadline:
            time.sleep(0.2)  # until a replica frozen before is thawed, bounded
        logs = {path: path.stat().st_size for path in self.ha.logs.glob("patroni-*.log")}
        event["at"] = time.time()
        stopped = [pid for node in standbys for pid in node.signal_all(signal.SIGSTOP)]
        event["node"] = leader.name
        try:
            asyncio.run(self._offer_while_gone(event, leader.host, leader.pg_port))
        finally:
            _resume(stopped)
            self.soak_chaos.no_freezing.clear()
        event["gone_seconds"] = round(time.time() - event["at"], 1)
        back = time.time()
        asyncio.run(self._finish_probes(event, back))
        self.ha.wait_healthy(120)
        event["rejoined_seconds"] = round(time.time() - event["at"], 1)
        event["cancelled_sync_waits"] = sum(_appended(path, size).count(CANCELLED_SYNC_WAIT)
                                            for path, size in logs.items())

    async def _offer_while_gone(self, event: dict[str, Any], primary_host: str, primary_port: int) -> None:
        """GONE_PROBES new payments, one a second, each POSTed once through nginx: what came back, how soon."""
        cluster = self.soak_chaos.c
        seed = len(self.probes)
        probes = [soak.Payment(f"soak-standbys-gone-{seed + i}", "normal", str(uuid.uuid4()),
                               payment_body(f"soak-standbys-gone-{seed + i}"), "chaos") for i in range(GONE_PROBES)]
        self.probes += probes
        headers = {"Authorization": f"Bearer {cluster.api_key}", "Content-Type": "application/json"}
        answers: list[dict[str, Any]] = []
        started = time.monotonic()

        async def offer(http: aiohttp.ClientSession, i: int, p: soak.Payment) -> None:
            await asyncio.sleep(max(0.0, started + i - time.monotonic()))  # the offered rate, one a second
            sent = time.monotonic()
            try:
                async with http.post(f"{cluster.balancer.url}/v1/payments", data=json.dumps(p.body),
                                     headers=headers | {"Idempotency-Key": p.key}) as r:
                    answer = {"status": r.status, "type": r.headers.get("Content-Type"),
                              "retry_after": r.headers.get("Retry-After")}
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                answer = {"status": type(exc).__name__}
            answer["seconds"] = round(time.monotonic() - sent, 2)
            p.statuses[str(answer["status"])] += 1  # the audit's no_500 sees it
            answers.append(answer)

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            await asyncio.gather(*(offer(http, i, p) for i, p in enumerate(probes)))
        await asyncio.sleep(max(0.0, started + GONE_SECONDS - time.monotonic()))  # gone at least this long
        primary = await asyncpg.connect(f"postgresql://postgres@{primary_host}:{primary_port}/postgres")
        try:  # a read: it waits for no standby
            event["commits_waiting"] = await primary.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        finally:
            await primary.close()
        event["answers"] = dict(Counter(str(a["status"]) for a in answers))
        event["answer_max_seconds"] = max(a["seconds"] for a in answers)
        event["bounded"] = all(a["status"] == 503 and a.get("retry_after") and a["seconds"] <= ANSWER_LIMIT
                               and a.get("type") == "application/problem+json" for a in answers)
        event["answers_detail"] = answers

    async def _finish_probes(self, event: dict[str, Any], back: float) -> None:
        """The standbys are back: each probe retried with its key, as the soak's clients do, until final."""
        cluster = self.soak_chaos.c
        journal = soak.Journal(self.results / "standbys-gone-keys.jsonl")
        probes = self.probes[-GONE_PROBES:]
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
                clients = soak.Clients(http, cluster.balancer.url, cluster.api_key, journal, asyncio.Lock())
                await asyncio.gather(*(clients.answer(p, time.monotonic() + 180) for p in probes))
        finally:
            journal.close()
        finals = [p.answered_at - back for p in probes if p.answered_at is not None]
        event["first_final_after_back_seconds"] = round(min(finals), 1) if finals else None
        event["last_final_after_back_seconds"] = round(max(finals), 1) if finals else None

    def extra_payments(self) -> list[soak.Payment]:
        return self.probes

    def _leader(self) -> Any:
        self.ha.wait_healthy(120)
        self.ha.wait_routed(60)
        leader = self.ha.leader()
        assert leader is not None
        return leader

    def _routed_elsewhere(self, old: str, event: dict[str, Any], timeout: float) -> None:
        """Wait until HAProxy routes to a new leader; the seconds since the failure began, in `event`."""
        deadline = time.time() + timeout
        while True:
            leader = self.ha.leader()
            if leader is not None and leader.name != old and self.ha.routed_to() == leader.name:
                break
            if time.time() > deadline:
                raise RuntimeError(f"no new primary routed within {timeout:.0f} s")
            time.sleep(0.1)  # polling Patroni's and HAProxy's view, bounded by the deadline
        event["new_primary"] = leader.name
        event["routed_seconds"] = round(time.time() - event["at"], 1)

    # -- after -------------------------------------------------------------------

    def judge(self, report: Any) -> None:
        for event in self.events:
            if "failed" in event:
                report.violate("failover_completed", None, action=event["action"], error=event["failed"])
            if event.get("direct_write_to_old_primary") == "acknowledged":
                report.violate("old_primary_fenced", None, node=event["node"])
            for probe in PARTITION_PROBES:
                if event.get(probe, {}).get("outcome") == "acknowledged":
                    report.violate("old_primary_fenced", None, node=event["node"], probe=probe)
            if event["action"] == "standbys_gone" and not event.get("bounded"):
                report.violate("standbys_gone_503_within_bound", None, answers=event.get("answers_detail"),
                               limit_seconds=ANSWER_LIMIT)
            if event.get("cancelled_sync_waits"):
                report.violate("no_cancelled_sync_wait", None, lines=event["cancelled_sync_waits"])

    async def everything_up(self, cluster: soak.Cluster) -> None:
        await soak.everything_up(cluster)
        if self.ha.network is not None:
            await asyncio.to_thread(self.ha.network.restore_all)
        for node in self.ha.nodes:
            node.signal_all(signal.SIGCONT)
            if not node.agent.running:
                await asyncio.to_thread(self.ha.restart_agent, node)
        await asyncio.to_thread(self.ha.wait_healthy, 120)
        await asyncio.to_thread(self.ha.wait_routed, 60)

    def figures(self, payments: list[soak.Payment]) -> dict[str, Any]:
        for event in self.events:
            after = [p.answered_at - event["at"] for p in payments
                     if p.offered_at >= event["at"] and p.answered_at is not None and p.final_status]
            event["first_payment_seconds"] = round(min(after), 1) if after else None
        recovery: dict[str, Any] = {}
        for action in FAILOVERS:
            times = [e["first_payment_seconds"] for e in self.events
                     if e["action"] == action and e["first_payment_seconds"] is not None]
            routed = [e["routed_seconds"] for e in self.events if e["action"] == action and "routed_seconds" in e]
            recovery[action] = {
                "count": sum(e["action"] == action for e in self.events),
                "failed": [e["failed"] for e in self.events if e["action"] == action and "failed" in e],
                "first_payment_median_seconds": round(statistics.median(times), 1) if times else None,
                "first_payment_max_seconds": max(times) if times else None,
                "routed_median_seconds": round(statistics.median(routed), 1) if routed else None,
                "routed_max_seconds": max(routed) if routed else None,
            }
        fence = [e["direct_write_to_old_primary"] for e in self.events if "direct_write_to_old_primary" in e]
        gone = [{k: v for k, v in e.items() if k != "answers_detail"} for e in self.events
                if e["action"] == "standbys_gone"]
        partitions = [{k: e.get(k) for k in ("node", "demoted_seconds", *PARTITION_PROBES, "old_primary_by_its_agent",
                                             "rejoined_as", "rejoined_seconds")}
                      for e in self.events if e["action"] == "partition_primary"]
        return {"command": self.command, "failovers": self.events, "old_primary_fenced": fence,
                "partition": partitions, "partition_skipped": self.partition_skipped,
                "network": ("each node in a network namespace of its own on a bridge, "
                            f"{self.ha.network.subnet}" if self.ha.network else "loopback"),
                "failover_recovery": recovery, "standbys_gone": gone,
                "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}",
                "patroni": {"ttl": TTL, "synchronous_mode": True, "synchronous_mode_strict": True}}


def _resume(pids: list[int]) -> None:
    """SIGCONT to every process a failover stopped; one that died meanwhile is simply gone."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _appended(path: Path, since: int) -> bytes:
    """What a log gained after it was `since` bytes long."""
    with path.open("rb") as log:
        log.seek(since)
        return log.read()


PROBE_WRITE = "CREATE TEMP TABLE fence_probe (at timestamptz) ON COMMIT DROP"


async def fence_probe(port: int, timeout: float = 5, host: str = "127.0.0.1") -> str:
    """Right after the old primary wakes: a write straight to it, past HAProxy. What came back;
    "acknowledged" would mean a commit the service could have relied on, on a node that no longer leads.

    The write must be one whose commit waits for a synchronous standby: a transaction that wrote WAL
    before its commit record. (`SELECT txid_current()` alone does not: PostgreSQL commits a transaction
    that wrote nothing but its commit record asynchronously, and an earlier probe was fooled by it.)
    Creating a temporary table writes the catalogs' WAL; ON COMMIT DROP, so the session leaves no
    table behind. (One left behind is dropped when the backend exits, in a transaction whose commit
    waits for a standby too: on a primary cut off from its standbys that exit never ends, and it held
    the primary's shutdown, and so its demotion, for as long as the cut lasted.)"""
    try:
        conn = await asyncpg.connect(f"postgresql://postgres@{host}:{port}/postgres", timeout=timeout)
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError) as exc:
        return f"not acknowledged: could not connect ({type(exc).__name__})"
    try:
        await conn.execute(PROBE_WRITE, timeout=timeout)
        return "acknowledged"
    except asyncio.TimeoutError:
        return f"not acknowledged: the commit waited {timeout:g} s for a synchronous standby (none follows it)"
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return f"not acknowledged: {type(exc).__name__}"
    finally:
        conn.terminate()


PARTITION_PROBES = ("write_while_cut", "write_once_demoted", "write_after_restore", "write_after_rejoining")


async def watched_write(host: str, port: int, timeout: float) -> dict[str, Any]:
    """fence_probe's write, sent from wherever the caller runs (inside the old primary's namespace),
    with what its backend waited on (pg_stat_activity, asked on a second connection) and how it ended:
    a commit that waits on `SyncRep` is one the primary cannot complete without a standby."""
    url = f"postgresql://postgres@{host}:{port}/postgres"
    started = time.monotonic()
    waited_on: set[str] = set()

    def result(outcome: str) -> dict[str, Any]:
        return {"outcome": outcome, "seconds": round(time.monotonic() - started, 1), "waited_on": sorted(waited_on)}

    try:
        conn = await asyncpg.connect(url, timeout=5)
    except (OSError, asyncpg.PostgresError, asyncio.TimeoutError) as exc:
        return result(f"not acknowledged: could not connect ({type(exc).__name__})")

    async def watch() -> None:
        try:
            other = await asyncpg.connect(url, timeout=5)
        except (OSError, asyncpg.PostgresError, asyncio.TimeoutError):
            return
        try:
            while True:
                event = await other.fetchval("SELECT wait_event FROM pg_stat_activity WHERE pid = $1",
                                             conn.get_server_pid())
                if event:
                    waited_on.add(event)
                await asyncio.sleep(0.2)  # sampling what the write waits on, for the report; ends with it
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return
        finally:
            other.terminate()

    watcher = asyncio.create_task(watch())
    try:
        await conn.execute(PROBE_WRITE, timeout=timeout)
        return result("acknowledged")
    except asyncio.TimeoutError:
        return result(f"not acknowledged: no answer within {timeout:g} s")
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        return result(f"not acknowledged: {type(exc).__name__}")
    finally:
        watcher.cancel()
        conn.terminate()


def watch_agent(rest: str, seen: list[dict[str, Any]], done: threading.Event) -> None:
    """The node's role and state as its own Patroni reports them (GET /patroni), each change with the
    seconds since the watch began, appended to `seen` until `done`; an agent that does not answer is
    recorded as such."""
    started = time.monotonic()
    with httpx.Client(timeout=1) as http:
        while not done.is_set():
            try:
                body = http.get(rest + "/patroni").json()
                now = {"role": body.get("role", "?"), "state": body.get("state", "?")}
            except (httpx.HTTPError, ValueError):
                now = {"role": "no answer", "state": "-"}
            if not seen or (seen[-1]["role"], seen[-1]["state"]) != (now["role"], now["state"]):
                seen.append({"seconds": round(time.monotonic() - started, 1), **now})
            done.wait(0.2)  # sampling its view for the report, until the partition is over


def start_cluster(hooks: HaHooks) -> Any:
    """soak.start_cluster's counterpart: our database on the HA cluster, the fakes' on a private server."""

    def start(results: Path, replicas: int, console: Console) -> soak.Cluster:
        system = System(results / "logs", settings=soak.SETTINGS, environ=child_env())
        # Not under /tmp/pytest-of-*, whose mode other sessions reset (as soak.py's servers).
        root = Path(tempfile.mkdtemp(prefix="payments-soak-ha-"))
        system.defer(shutil.rmtree, root, True)
        hooks.results = results
        ha = hooks.ha = HaCluster(root / "ha", base_port=hooks.base_port, logs=results / "logs" / "ha",
                                  synchronous=not hooks.lag, namespaces=hooks.namespaces)
        try:
            with console.status("starting etcd, three PostgreSQL nodes under Patroni, and HAProxy"):
                ha.start()
            system.defer(ha.stop)
            rails_server = embedded_db.EmbeddedServer(root / "rails", free_port())
            embedded_db.start(rails_server)
            system.defer(embedded_db.stop, rails_server)
            embedded_db.create_database(rails_server.url(), "rails")
            rails_url = rails_server.url("rails")
            system.start_postgres(server_url=ha.url)
            system.create_database("payments")
            # The console's pages on a standby, as make cluster-ha does (nothing in the soak reads them).
            system.settings["DATABASE_READ_URL"] = with_database(ha.read_url, "payments")
            _, api_key = system.create_client("soak")
            system.start_fakes(records_url=rails_url,
                               rail_args=("--legacy-accounts", soak.LEGACY_IBAN, "--cutoff", "24:00"))
            apis = [system.start_api(f"api-{n}") for n in range(1, replicas + 1)]
            workers = [system.start_worker(f"worker-{n}") for n in (1, 2)]
            balancer = system.start_nginx(apis, results / "nginx")
        except BaseException:
            system.stop()
            ha.stop()
            raise
        return soak.Cluster(system, apis, workers, balancer, None, system.database_url, rails_url, api_key)

    return start


def print_failovers(console: Console, figures: dict[str, Any]) -> None:
    console.print(f"network: {figures['network']}")
    if figures["partition_skipped"]:
        console.print(f"[bold red]PARTITION NOT RUN: {figures['partition_skipped']}[/]")
    for outcome in figures["old_primary_fenced"]:
        console.print(f"stalled primary, woken, written to directly: {outcome}")
    for p in figures["partition"]:
        console.print(f"partitioned primary {p['node']}, by its own agent: {p['old_primary_by_its_agent']}")
        for probe in PARTITION_PROBES:
            if p.get(probe):
                w = p[probe]
                waited = f", waited on {', '.join(w['waited_on'])}" if w["waited_on"] else ""
                console.print(f"  {probe.replace('_', ' ')} (from inside its namespace): {w['outcome']} after "
                              f"{w['seconds']} s{waited}")
        console.print(f"  streaming again, as {p['rejoined_as']}, {p['rejoined_seconds']} s after the cut")
    for e in figures["standbys_gone"]:
        console.print(f"standbys gone {e.get('gone_seconds')} s: payments offered then answered {e.get('answers')}, "
                      f"slowest {e.get('answer_max_seconds')} s (limit {ANSWER_LIMIT} s), {e.get('commits_waiting')} "
                      f"commits waiting; after the standbys came back, first final answer "
                      f"{e.get('first_final_after_back_seconds')} s, last {e.get('last_final_after_back_seconds')} s; "
                      f"synchronous waits cancelled by a request meanwhile, in the nodes' logs: "
                      f"{e.get('cancelled_sync_waits')}")
    for action, r in figures["failover_recovery"].items():
        if r["count"]:
            console.print(f"{action} x{r['count']}: new primary routed in median {r['routed_median_seconds']} s, "
                          f"max {r['routed_max_seconds']} s; first payment after it in median "
                          f"{r['first_payment_median_seconds']} s, max {r['first_payment_max_seconds']} s"
                          + (f"; [red]failed: {r['failed']}[/]" if r["failed"] else ""))


def main() -> None:
    parser = soak.arguments("python -m devtools.soak_ha", __doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=2, help="primaries killed (SIGKILL), default 2")
    parser.add_argument("--no-stall", action="store_true", help="leave out the SIGSTOP stall past the TTL")
    parser.add_argument("--no-partition", action="store_true",
                        help="leave out the partition (and the namespaces it needs)")
    parser.add_argument("--short", action="store_true",
                        help=f"CI's: {SHORT['payments']} payments over {SHORT['seconds']} s per run, one kill, "
                             "one switchover, both standbys stopped, a partition where namespaces can be made, no stall")
    parser.add_argument("--no-standbys-gone", action="store_true",
                        help="leave out stopping both standbys (payments answered 503 within the bound, then once)")
    parser.add_argument("--async-lag", type=float, default=0, metavar="SECONDS",
                        help="asynchronous replication, the standbys held SECONDS behind before each kill, no "
                             "switchover or stall: what it loses (a report: exit 0 whatever the audit finds)")
    parser.add_argument("--base-port", type=int, default=0,
                        help="etcd, PostgreSQL, Patroni and HAProxy on the 15 ports from here (default: free ones)")
    # Longer than `make soak`'s runs: the failovers, one after another, take about three minutes.
    parser.set_defaults(payments=450, seconds=180)
    args = parser.parse_args()
    if args.short:
        args.payments, args.seconds, args.kills, args.no_stall = (
            SHORT["payments"], SHORT["seconds"], SHORT["kills"], not SHORT["stall"])
        args.no_partition = args.no_partition or not SHORT["partition"]
    console = Console(width=120)
    if find_programs() is None:
        console.print(f"[red]{INSTALL_HINT}[/]")
        raise SystemExit(2)
    plan = ["kill_primary", "switchover"] + (["stall_primary"] if not args.no_stall else [])
    partition_skipped = None
    if not args.no_partition and not args.async_lag:
        partition_skipped = netns.why_not()
        if partition_skipped is None:
            plan.append("partition_primary")
        else:
            partition_skipped = f"network namespaces cannot be made here ({partition_skipped}): no partition"
            console.print(f"[bold red]PARTITION NOT RUN: {partition_skipped}[/]")
    plan += ["kill_primary"] * (args.kills - 1)
    plan += ["standbys_gone"] if not args.no_standbys_gone else []
    if args.async_lag:
        plan = ["kill_primary"] * args.kills
    args_text = ("--short" if args.short else f"--payments {args.payments} --seconds {args.seconds:g} "
                 f"--kills {args.kills}" + (" --no-stall" if args.no_stall else "")
                 + (" --no-partition" if args.no_partition else "")
                 + (f" --async-lag {args.async_lag:g}" if args.async_lag else "")
                 + (" --no-standbys-gone" if args.no_standbys_gone else ""))
    command = f"python -m devtools.soak_ha --seed {args.seed} --replicas {args.replicas} {args_text}"
    hooks = HaHooks(plan, console, command, args.base_port, args.async_lag, partition_skipped)
    try:
        soak.run(args, console, start_cluster(hooks), hooks, print_failovers)
    except SystemExit as exit:
        if args.async_lag and exit.code == 1:
            console.print("asynchronous replication: the violations above are the measurement (a report, "
                          "not a gate); docs/failover.md#what-asynchronous-replication-costs")
            raise SystemExit(0) from None
        raise


if __name__ == "__main__":
    main()
