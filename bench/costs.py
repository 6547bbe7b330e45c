"""What each payment costs: writing transactions, commits, WAL and CPU.

writing transactions per payment (from the WAL)
    The figure the design is about. A writing transaction is one that
    changed a row, and so has to reach the disk (a WAL flush, an fsync) before
    its COMMIT returns: the most expensive thing a payment does in the
    database. The phased service should do exactly 3 per payment (Handler1
    with the claim; the charge's outcome with Handler2; the transfer's outcome
    with Handler3), the naive twin does 5 (each write commits on its own).
    Counted exactly, not estimated: `pg_waldump` decodes the WAL written
    during the run, and a transaction counts if it wrote a relation of the
    service's database (`rel <tablespace>/<database oid>/<file>` in a record)
    and has a COMMIT record. The fakes' database, other databases on the
    server, catalog updates (autovacuum's ANALYZE) and read-only transactions
    do not count. The tables each transaction wrote are listed too: a phase
    that writes the key row, the payment and the ledger is one transaction,
    and this is where one sees it. A temporary replication slot keeps the
    run's WAL from being recycled by a checkpoint before it is read.
    A transaction that wrote only the workers' own bookkeeping (WORKERS_OWN:
    the webhook dispatcher's cursor, the scheduled jobs' runs) is not a
    payment's: it is counted apart, as the workers' writing transactions per
    payment, and the target judges the rest.
    The same pass counts the bytes of records that carry a full-page image
    (a page's first change after a checkpoint) and splits them by the
    relation the image is of, an index apart from its table: which pages
    a payment's images come from.

xact_commit per payment (pg_stat_database)
    Every commit in the service's database, read-only ones included (the
    API-key lookup, the key lookup, a replay's reads): what the database
    does per request, including work that needs no fsync. PostgreSQL 15+
    publishes a backend's counts with up to 10 s delay once it goes idle, so
    the bench lets the system idle 11 s after each run before it reads them;
    the window then covers the run's warm-up and its run (both the same
    variant), divided by the payments of both.

CPU ms per payment, per process
    On a small machine every process competes for the same cores; the
    slowest one sets the pace. Load generator, API (the master and its
    workers), each fake, PostgreSQL (all its processes, split into backends of
    the service's database, of the fakes' database, background processes
    such as the WAL writer and I/O workers, and other databases' sessions),
    and the whole machine. Backends that exit during a run take their CPU
    time with them; the pools keep theirs open, so that is rare.
    A process's CPU is read from the kernel's CPU clock of that process, in
    nanoseconds (`cpu_of`), not from its user and system times, which
    /proc gives in clock ticks of 10 ms: a database session that works
    2 ms a second reads 0 or 10 ms over a 5 s window, and such a session is
    the whole of some figures (the webhook dispatcher's, bench/outbox.py).

Wake-ups per payment, per process of ours (not PostgreSQL's)
    How often each process went to sleep and was woken again (its main
    thread's voluntary context switches, where the event loop waits): an
    asyncio server woken once for a burst of requests pays once for the
    wake-up, one woken per request pays each time. The fakes run the same
    statements for either service; this says whether the two sides' calls
    reach them alike. They do not (the safe service's calls wake the fakes
    more often a payment), and docs/reference/performance.md says what
    that costs them: little.

The kernel's part and preemptions per payment, per process of ours
    Where a process's CPU a payment went when it differs between the two
    sides: the kernel's part (its system time; ticks of 10 ms are fine
    for a fake's seconds in a round) is the work of its sockets and
    wake-ups; the rest is its own code, which runs slower when it lands
    on a CPU whose caches another process has just filled. Preemptions
    (involuntary context switches, the main thread's) count how often it
    was taken off a CPU while it still had work.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import subprocess
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import psutil

from devtools.embedded_db import POSTGRES_BIN_PATH
from bench.system import RAILS_DATABASE, SERVICE_DATABASE, Server

# PostgreSQL publishes an idle backend's statistics at most 10 s late.
STATS_SETTLE_SECONDS = 11.0
# Relations below this file number are the system catalogs (FirstNormalObjectId).
FIRST_USER_FILENODE = 16384


# --- Writing transactions, from the WAL ------------------------------------------------

# Tables only the workers write, for their own bookkeeping: the webhook
# dispatcher's cursor (leased and moved once a batch of events, however many
# payments the batch passes over; it moves with no webhook endpoint at all)
# and the scheduled jobs' runs. A transaction that wrote nothing else is not
# a payment's. One that wrote any other table is, whoever ran it: a payment
# path that began writing a delivery row in a transaction of its own would
# show in the payment's count.
WORKERS_OWN = frozenset({"webhook_cursor", "scheduled_run"})


@dataclass
class WalCount:
    """The service database's writing transactions in one LSN window."""

    transactions: int
    by_tables: Counter[str]  # "idempotency_key+payment" -> transactions that wrote exactly those
    wal_bytes: int  # the service database's records and its transactions' commits
    fpi_bytes: int  # of which records carrying a full-page image (first change to a page after a checkpoint)
    wal_bytes_all: int  # everything in the window, the fakes and other databases included
    # fpi_bytes by the relation each image is of ("payment", "payment_pkey"; a partition as its root)
    fpi_by_relation: Counter[str] = field(default_factory=Counter)

    def to_json(self, operations: int) -> dict[str, Any]:
        return {
            "transactions": self.transactions,
            "by_tables": dict(self.by_tables.most_common()),
            "wal_bytes": self.wal_bytes,
            "fpi_bytes": self.fpi_bytes,
            "fpi_by_relation": dict(self.fpi_by_relation.most_common()),
            "wal_bytes_all": self.wal_bytes_all,
            "operations": operations,
        }


# rmgr: Heap  len (rec/tot):  54/ 214, tx:  107608, lsn: 0/336258E8, prev 0/33625880, desc: INSERT off: 2, ...
_RECORD = re.compile(r"^rmgr: (\S+)\s+len \(rec/tot\):\s*\d+/\s*(\d+), tx:\s*(\d+), lsn: \S+ prev \S+ desc: (\S+)")
_REL = re.compile(r"rel (\d+)/(\d+)/(\d+)")
# One block of a record, with its image: "blkref #0: rel 1663/16385/16434 blk 13 FPW", or of a fork other
# than the main one, "rel 1663/16385/16442 fork fsm blk 4 FPW".
_IMAGE = re.compile(r"rel \d+/(\d+)/(\d+)(?: fork (\w+))? blk \d+ FPW")


class Wal:
    """Counts the service database's writing transactions between two LSNs.

    Available when the bench can read the server's WAL directory (the server
    runs on this machine and we may read its files, as root may) and has a
    pg_waldump; otherwise `reason` says why not and the figure is n/a.
    """

    def __init__(self, conn: asyncpg.Connection, server: Server) -> None:
        self.conn, self.server = conn, server
        self.reason: str | None = None
        self.pg_wal: Path | None = None
        self.waldump: str | None = None
        self.timeline = 1
        self.database_oid = 0
        self.tables: dict[int, str] = {}  # file number -> its table (an index's, a TOAST file's)
        self.relations: dict[int, str] = {}  # file number -> its own relation (an index by its name)
        self.slot: str | None = None

    async def setup(self) -> None:
        try:
            data_dir = Path(await self.conn.fetchval("SHOW data_directory"))
        except asyncpg.PostgresError as exc:
            self.reason = f"the server does not tell its data directory ({exc})"
            return
        pg_wal = data_dir / "pg_wal"
        if not (pg_wal.is_dir() and os.access(pg_wal, os.R_OK | os.X_OK)):
            self.reason = f"{pg_wal} is not readable here (another machine, or not root)"
            return
        # pg_waldump reads only its own major version's WAL: the server's own, one on PATH, or the wheel's.
        major = await self.conn.fetchval("SELECT current_setting('server_version_num')::int / 10000")
        tools = [self.server.bin_dir / "pg_waldump"] if self.server.bin_dir else []
        tools += [Path(p) for p in (shutil.which("pg_waldump"),) if p] + [POSTGRES_BIN_PATH / "pg_waldump"]
        self.waldump = next((str(t) for t in tools if _major_version(t) == major), None)
        if self.waldump is None:
            self.reason = f"no pg_waldump for PostgreSQL {major} (it comes with the server packages)"
            return
        self.pg_wal = pg_wal
        self.timeline = await self.conn.fetchval("SELECT timeline_id FROM pg_control_checkpoint()")
        self.database_oid = await self.conn.fetchval("SELECT oid FROM pg_database WHERE datname = $1", SERVICE_DATABASE)

    async def learn_tables(self, service_url: str) -> None:
        """File number -> table name for the service database (indexes, TOAST and sequences under their table)."""
        conn = await asyncpg.connect(service_url)
        try:
            rows = await conn.fetch(
                """
                SELECT pg_relation_filenode(c.oid)::bigint AS filenode, c.oid,
                       coalesce(owner.oid, c.oid) AS table_oid
                  FROM pg_class c
                  LEFT JOIN pg_index i ON i.indexrelid = c.oid
                  LEFT JOIN pg_depend d ON c.relkind = 'S' AND d.classid = 'pg_class'::regclass
                       AND d.objid = c.oid AND d.deptype IN ('a', 'i')
                  LEFT JOIN pg_class owner ON owner.oid = coalesce(i.indrelid, d.refobjid)
                 WHERE pg_relation_filenode(c.oid) IS NOT NULL
                """
            )
            names = dict(
                await conn.fetch(
                    """
                    -- A partition (the key table has one per day) counts as its table, a
                    -- partition's index as the partitioned table's index.
                    SELECT c.oid, CASE WHEN n.nspname = 'public' THEN r.relname
                                       ELSE n.nspname || '.' || r.relname END
                      FROM pg_class c
                      JOIN pg_class r ON r.oid = coalesce(pg_partition_root(c.oid), c.oid)
                      JOIN pg_namespace n ON n.oid = r.relnamespace
                    """
                )
            )
            toast_owner = dict(await conn.fetch("SELECT reltoastrelid, oid FROM pg_class WHERE reltoastrelid <> 0"))
        finally:
            await conn.close()
        self.tables = {
            r["filenode"]: names.get(toast_owner.get(r["table_oid"], r["table_oid"]), str(r["filenode"])) for r in rows
        }
        self.relations = {
            r["filenode"]: f"{self.tables[r['filenode']]} TOAST" if r["table_oid"] in toast_owner
            else names.get(r["oid"], str(r["filenode"])) for r in rows
        }

    @property
    def available(self) -> bool:
        return self.reason is None

    async def start(self) -> str | None:
        """Keep the WAL from here on (a temporary slot), and say where here is."""
        if not self.available:
            return None
        if self.slot is None:
            slot = f"payments_bench_{os.getpid()}"
            try:
                await self.conn.execute("SELECT pg_create_physical_replication_slot($1, true, true)", slot)
                self.slot = slot
            except asyncpg.PostgresError:
                pass  # no slots to spare: a checkpoint during the run could recycle its WAL (then n/a)
        return await self.conn.fetchval("SELECT pg_current_wal_lsn()::text")

    async def end(self) -> str | None:
        return await self.conn.fetchval("SELECT pg_current_wal_lsn()::text") if self.available else None

    async def release(self) -> None:
        """Let the server recycle the WAL again (a temporary slot would also go with our session)."""
        if self.slot is not None:
            await self.conn.execute("SELECT pg_drop_replication_slot($1)", self.slot)
            self.slot = None

    async def count(self, start: str | None, end: str | None) -> WalCount | str:
        """The window's count, or why there is none."""
        if not self.available or start is None or end is None:
            return self.reason or "no window"
        return await asyncio.to_thread(self._count, start, end)

    def _count(self, start: str, end: str) -> WalCount | str:
        assert self.waldump and self.pg_wal
        if start == end:
            return WalCount(0, Counter(), 0, 0, 0)
        argv = [self.waldump, "--path", str(self.pg_wal), "--timeline", str(self.timeline),
                "--start", start, "--end", end]
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1 << 20)
        assert process.stdout is not None
        counted = tally(process.stdout, self.database_oid, self.tables, self.relations)
        stderr = process.stderr.read() if process.stderr else ""
        if process.wait() != 0:
            return f"pg_waldump failed: {stderr.strip()[:300]}"
        return counted


def _relation(filenode: int, fork: str, tables: dict[int, str], relations: dict[int, str]) -> str:
    """A file's relation by name ("payment", "payment_pkey", "payment (fsm)"), else its number."""
    name = relations.get(filenode) or tables.get(filenode) or f"file {filenode}"
    return f"{name} ({fork})" if fork else name


def tally(lines: Iterable[str], database_oid: int, tables: dict[int, str], relations: dict[int, str]) -> WalCount:
    """Count pg_waldump's lines: the service database's writing transactions, their WAL, their page images.

    `tables` names a file by its table (an index or a TOAST file by the
    table it belongs to), `relations` by its own relation.
    """
    oid = str(database_oid)
    tables_of: dict[str, set[str]] = defaultdict(set)  # xid -> tables of ours it wrote
    bytes_of: Counter[str] = Counter()  # xid -> WAL bytes
    images_of: dict[str, Counter[str]] = defaultdict(Counter)  # xid -> bytes with a page image, by relation
    committed: set[str] = set()
    untransacted = 0  # ours without an xid (pruning, hint-bit images)
    untransacted_images: Counter[str] = Counter()
    all_bytes = 0
    for line in lines:
        m = _RECORD.match(line)
        if m is None:
            continue
        rmgr, size, xid, desc = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        all_bytes += size
        ours = [int(f) for _, db, f in _REL.findall(line) if db == oid]
        # A record's bytes are mostly its images; one with several is split evenly between them.
        imaged = [_relation(int(f), fork, tables, relations) for db, f, fork in _IMAGE.findall(line) if db == oid]
        images: Counter[str] = Counter()
        for relation in imaged:
            images[relation] += size / len(imaged)
        if xid == "0":
            if ours:
                untransacted += size
                untransacted_images.update(images)
            continue
        bytes_of[xid] += size
        images_of[xid].update(images)
        for filenode in ours:
            if filenode >= FIRST_USER_FILENODE:
                tables_of[xid].add(tables.get(filenode, f"file {filenode}"))
        if rmgr == "Transaction" and desc.startswith("COMMIT"):
            committed.add(xid)
    mine = [x for x in committed if tables_of.get(x)]
    by_tables = Counter("+".join(sorted(tables_of[x])) for x in mine)
    by_relation = sum((images_of[x] for x in mine), untransacted_images)
    fpi_by_relation = Counter({r: round(b) for r, b in by_relation.items()})
    return WalCount(len(mine), by_tables, sum(bytes_of[x] for x in mine) + untransacted,
                    round(sum(by_relation.values())), all_bytes, fpi_by_relation)


def _major_version(tool: Path) -> int | None:
    """12 for `pg_waldump (PostgreSQL) 12.3`; None if it cannot be run."""
    if not os.access(tool, os.X_OK):
        return None
    try:
        out = subprocess.run([str(tool), "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\) (\d+)", out)
    return int(m.group(1)) if m else None


# --- Commits, from the statistics -------------------------------------------------------


async def xact_commit(conn: asyncpg.Connection) -> int:
    """The service database's commit counter, as published (read from another database)."""
    await conn.execute("SELECT pg_stat_clear_snapshot()")
    return await conn.fetchval("SELECT xact_commit FROM pg_stat_database WHERE datname = $1", SERVICE_DATABASE)


# --- CPU ---------------------------------------------------------------------------------


LOAD_GENERATOR, MACHINE = "load generator", "whole machine"
OTHERS = "other processes (not ours)"
KERNEL = "kernel, exited processes"
POSTGRES = "PostgreSQL (all processes)"
PG_PARTS = {
    SERVICE_DATABASE: "  service DB backends",
    RAILS_DATABASE: "  fakes' DB backends",
    None: "  background (WAL writer, I/O...)",
    "other": "  other databases' sessions",
}


@dataclass
class CpuMark:
    seconds: dict[str, dict[int, float]] = field(default_factory=dict)  # role -> pid -> CPU s
    others: dict[int, tuple[str, float]] = field(default_factory=dict)  # pid -> (name, CPU s): user processes
    kernel: dict[int, tuple[str, float]] = field(default_factory=dict)  # the same for kernel threads
    machine: float = 0.0
    wakeups: dict[str, dict[int, int]] = field(default_factory=dict)  # role -> pid -> voluntary switches so far
    preempted: dict[str, dict[int, int]] = field(default_factory=dict)  # role -> pid -> involuntary switches so far
    in_kernel: dict[str, dict[int, float]] = field(default_factory=dict)  # role -> pid -> system CPU s (ticks)
    waited: dict[str, dict[int, float]] = field(default_factory=dict)  # role -> pid -> s runnable, off a CPU, so far


def cpu_of(process: psutil.Process) -> float | None:
    """CPU seconds of one process so far, all its threads'; None if it is gone or not ours to read.

    Read from the process's CPU clock, to the nanosecond (Linux; the
    module's docstring says why not the ticks). Where that clock cannot be
    read, from the user and system times in ticks, as psutil gives them.
    """
    try:
        return time.clock_gettime_ns(_process_cpu_clock(process.pid)) / 1e9
    except OSError:  # gone, or not Linux
        pass
    try:
        times = process.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return times.user + times.system


def wakeups_of(process: psutil.Process) -> int | None:
    """How many times so far the process's main thread slept and was woken (voluntary context switches)."""
    try:
        return process.num_ctx_switches().voluntary
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def preempted_of(process: psutil.Process) -> int | None:
    """How many times so far the process's main thread was taken off a CPU while it could still run."""
    try:
        return process.num_ctx_switches().involuntary
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def in_kernel_of(process: psutil.Process) -> float | None:
    """CPU seconds so far that the kernel spent working for the process (its system time, in ticks)."""
    try:
        return process.cpu_times().system
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def waited_of(process: psutil.Process) -> float | None:
    """Seconds so far that the process's main thread could run but waited for a CPU (Linux's run queue delay).

    The second figure of /proc/<pid>/schedstat, in nanoseconds: how a
    process that got less CPU than another tells "it was not given a CPU"
    from "it had nothing to do". None where the file is not there (not
    Linux, or the kernel keeps no scheduler statistics) or the process is gone.
    """
    try:
        with open(f"/proc/{process.pid}/schedstat") as stats:
            return int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def _process_cpu_clock(pid: int) -> int:
    """The clock id of a process's CPU time, all its threads together, as Linux numbers it.

    What clock_getcpuclockid(3) returns for `pid`, which Python does not
    offer: the pid inverted and shifted, and 2 for the scheduler's own
    count of the time it ran (CPUCLOCK_SCHED), which is also what the
    user and system times are scaled from.
    """
    return ((~pid) << 3) | 2


def _machine_busy() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


def _by_role(before: dict[str, dict[int, Any]], after: dict[str, dict[int, Any]]) -> dict[str, Any]:
    """A count per role between two marks, summed over its processes; a process new since the first from zero."""
    return {role: sum(n - before.get(role, {}).get(pid, 0) for pid, n in pids.items()) for role, pids in after.items()}


@dataclass(frozen=True)
class WorkerShare:
    """One API worker process in a measured run: the CPU it spent, the answers it gave, and how long it waited for a CPU."""

    cpu_seconds: float
    requests: int  # answers on the connections it held at the end
    connections: int  # the clients' connections it held at the end
    waited_seconds: float  # runnable but not on a CPU (its main thread)
    preemptions: int  # taken off a CPU with work left
    kernel_seconds: float | None = None  # of cpu_seconds, the kernel's work for it (system time, in ticks)
    pid: int | None = None  # to find the worker in a profile of the run (bench/shares.py --perf)

    def to_json(self) -> dict[str, float | int | None]:
        return dataclasses.asdict(self)


class CpuMeter:
    """CPU seconds of each part of the system between two marks."""

    def __init__(self, conn: asyncpg.Connection) -> None:
        self.conn = conn
        self.postmaster: psutil.Process | None = None

    async def setup(self) -> None:
        """Find PostgreSQL's processes: the parent of our own backend, if it runs on this machine."""
        backend = await self.conn.fetchval("SELECT pg_backend_pid()")
        try:
            parent = psutil.Process(backend).parent()
            if parent is not None and "postgres" in parent.name():
                self.postmaster = parent
        except psutil.Error:
            pass

    async def mark(self, roles: dict[str, list[psutil.Process]]) -> CpuMark:
        """CPU seconds so far of this process, of each role's processes, of PostgreSQL, of the rest."""
        mark = CpuMark()
        mark.seconds[LOAD_GENERATOR] = {os.getpid(): cpu_of(psutil.Process()) or 0.0}
        for role, processes in roles.items():
            mark.seconds[role] = {p.pid: s for p in processes if (s := cpu_of(p)) is not None}
            mark.wakeups[role] = {p.pid: w for p in processes if (w := wakeups_of(p)) is not None}
            mark.preempted[role] = {p.pid: n for p in processes if (n := preempted_of(p)) is not None}
            mark.in_kernel[role] = {p.pid: k for p in processes if (k := in_kernel_of(p)) is not None}
            mark.waited[role] = {p.pid: w for p in processes if (w := waited_of(p)) is not None}
        if self.postmaster is not None:
            databases = dict(await self.conn.fetch("SELECT pid, datname FROM pg_stat_activity"))
            for process in [self.postmaster, *self.postmaster.children()]:
                if (seconds := cpu_of(process)) is not None:
                    part = PG_PARTS.get(databases.get(process.pid), PG_PARTS["other"])
                    mark.seconds.setdefault(part, {})[process.pid] = seconds
        known = {pid for pids in mark.seconds.values() for pid in pids}
        for process in psutil.process_iter(["name", "ppid"]):
            if process.pid not in known and (seconds := cpu_of(process)) is not None:
                # Kernel threads are children of kthreadd (pid 2): writeback, I/O completion...
                kernel = process.info["ppid"] == 2 or process.pid == 2
                (mark.kernel if kernel else mark.others)[process.pid] = (process.info["name"], seconds)
        mark.machine = _machine_busy()
        return mark

    @staticmethod
    def spent(before: CpuMark, after: CpuMark) -> dict[str, float]:
        """CPU seconds per role between the marks, with the PostgreSQL total, the rest and the machine."""
        spent = {
            role: sum(s - before.seconds.get(role, {}).get(pid, 0.0) for pid, s in pids.items())
            for role, pids in after.seconds.items()
        }
        parts = {k: spent.pop(k) for k in list(spent) if k in PG_PARTS.values()}
        if parts:
            spent[POSTGRES] = sum(parts.values())
            spent |= {part: parts.get(part, 0.0) for part in PG_PARTS.values()}
        machine = after.machine - before.machine
        spent[OTHERS] = sum(CpuMeter._by_name(before.others, after.others).values())
        spent[KERNEL] = machine - sum(v for k, v in spent.items() if k not in PG_PARTS.values())
        spent[MACHINE] = machine
        return spent

    @staticmethod
    def woken(before: CpuMark, after: CpuMark) -> dict[str, int]:
        """Wake-ups per role between the marks (the roles passed to `mark`, not PostgreSQL's processes)."""
        return _by_role(before.wakeups, after.wakeups)

    @staticmethod
    def preemptions(before: CpuMark, after: CpuMark) -> dict[str, int]:
        """Times per role between the marks that a process was taken off a CPU while it could still run."""
        return _by_role(before.preempted, after.preempted)

    @staticmethod
    def kernel_part(before: CpuMark, after: CpuMark) -> dict[str, float]:
        """CPU seconds per role between the marks that the kernel spent working for the role's processes."""
        return _by_role(before.in_kernel, after.in_kernel)

    @staticmethod
    def workers(before: CpuMark, after: CpuMark, role: str, held: dict[int, set[int]],
                answered: Counter[int]) -> list[WorkerShare]:
        """What each of a role's worker processes did between the marks, the busiest first: how evenly they shared the load.

        Every worker in `held` is in it, an idle one with its 0.0 (that is the
        skew to see); no other process of the role (uvicorn's supervisor).
        `held` maps each worker's pid to the clients' ports of the connections
        it holds at the end; `answered` counts the answers the clients got by
        their own port. A worker's requests are the answers on the
        connections it holds, so a connection closed during the run (a worker
        shedding its excess, app/fastpath/reuse_port.py) is counted by no one.
        """
        def between(field_: str, pid: int) -> Any:
            """A figure of one process at the second mark less the first (from zero if it is new since)."""
            return (getattr(after, field_).get(role, {}).get(pid, 0)
                    - getattr(before, field_).get(role, {}).get(pid, 0))

        shares = [WorkerShare(cpu_seconds=round(between("seconds", pid), 3),
                              requests=sum(answered[port] for port in held[pid]),
                              connections=len(held[pid]),
                              waited_seconds=round(between("waited", pid), 3),
                              preemptions=between("preempted", pid),
                              kernel_seconds=round(between("in_kernel", pid), 3),
                              pid=pid)
                  for pid in after.seconds.get(role, {}) if pid in held]
        return sorted(shares, key=lambda w: -w.cpu_seconds)

    @staticmethod
    def _by_name(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> Counter[str]:
        by_name: Counter[str] = Counter()
        for pid, (name, seconds) in after.items():
            previous = before.get(pid)
            by_name[name] += seconds - (previous[1] if previous and previous[0] == name else 0.0)
        return by_name

    @staticmethod
    def busiest_others(before: CpuMark, after: CpuMark, n: int = 5) -> list[tuple[str, float]]:
        """The processes outside the system under test that used the most CPU between the marks."""
        busiest = CpuMeter._by_name(before.others, after.others).most_common(n)
        busiest += [(f"[{name}]", s) for name, s in CpuMeter._by_name(before.kernel, after.kernel).most_common(n)]
        return [(name, round(s, 3)) for name, s in sorted(busiest, key=lambda ns: -ns[1])[:n] if s > 0]
