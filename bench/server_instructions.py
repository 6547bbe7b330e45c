"""`python -m bench.server_instructions`: the database server's instructions per new payment, and where they go.

Not on a request's path: the figure behind "where the database's
instructions go" in docs/reference/performance.md. bench/instructions.py
counts the app's instructions and what pg_stat_statements sees of each
statement; but pg_stat_statements times a statement's run only, not the
setting up of its plan, its CHECK constraints or its commit, and the
server's CPU per payment is several times what it times. This counts all
of it: the server's backend runs under `valgrind --tool=callgrind`, and
callgrind attributes every instruction to the server's own functions (the
embedded PostgreSQL's binary is not stripped).

How. A PostgreSQL of the bench's own (the embedded server's binaries, a data
directory of its own, a free port) is migrated to this tree's head and given
client 1; bench/db_parts.py records one new payment's statements from the
service's request path (and writes the naive twin's). The server is then
started again under callgrind, following the backends it forks
(`--trace-children=yes`), without autovacuum and without full-page images
(QUIET below), and pgbench runs each script with one client for 10
payments and then, on a new connection, for 110, each on empty tables:
each run's backend writes its counts as it exits. Instructions per payment
= (the 110 run's - the 10 run's) / 100, so a connection's start (its
catalogue caches) and end cancel out. pgbench also opens a connection of
its own first, which runs no payment; the run's backend is the one that
wrote rows. Each script runs once uncounted (so that its tables' pages
are in shared buffers for every counted run), then twice; the repeats must
agree within 1%, else NO FIGURE and exit 1. Statements are prepared, with
the service's session settings (`plan_cache_mode`), as bench/db_parts.py
runs them.

Where they go: callgrind_annotate's inclusive counts of a few of the
server's functions, per payment, the same difference of the two runs:

    PostgresMain           everything the backend did for the payment
    ExecutorStart          each statement's plan set up for its run
    standard_ExecutorRun   the statement run (what pg_stat_statements times)
    ExecutorFinish         after the run: AFTER triggers (foreign keys), the
                           rest of a statement's writing CTEs
    ExecConstraints        the table's CHECK constraints, each read back from
                           its stored text and prepared on every statement
                           that writes a row (PostgreSQL keeps no parsed copy
                           between statements), then evaluated
    stringToNode           every stored expression read back from its text
    plpgsql_call_handler   the claim's function (claim_idempotency_key)
    finish_xact_command    the commit
    RI_FKey_check_ins      the foreign keys' checks (inside ExecutorFinish, or
                           the commit's for a deferred one)
    LockAcquireExtended    the locks taken: each table, partition and index a
                           statement opens (a generic plan of the partitioned
                           key table locks every partition, pruned or not)
    ExecInitAppend         the scan of a partitioned table set up: a scan of
                           each partition its pruning leaves

Any variant of bench/db_parts.py (`--variant NAME`, again for more) is
counted the same way beside them, on a database of its schema: what
taking one part out of a payment, or changing the schema under it, saves
in instructions, where db_parts measures it in the server's CPU, which
drifts with the machine. Shares do not add up exactly, as there.

Needs valgrind (apt-get install valgrind) and callgrind_annotate beside it
(without it, the totals only). About a minute, and half a minute more for
each variant.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import asyncpg

from bench import ceiling, db_parts
from bench.instructions import Count, NoFigure, agreed, callgrind_total, per_unit, spread
from devtools import embedded_db
from devtools.processes import free_port

SCRIPTS = ("as is", "naive twin")
SCHEMA_OF = {v.name: v.database for v in db_parts.VARIANTS}  # {a script's name: the schema it runs on}
WINDOWS = (10, 110)
# What would make one payment's count depend on what ran before it, not on the payment: autovacuum's
# work, and full-page images (the first change to each page after a checkpoint writes the whole page to
# the WAL, so how many a payment writes depends on how long ago the last checkpoint was). Off, and no
# checkpoint within a run. pg_stat_statements' WAL figures (bench/instructions.py) count the images.
QUIET = (("autovacuum", "off"), ("full_page_writes", "off"), ("checkpoint_timeout", "1h"), ("max_wal_size", "10GB"))
FUNCTIONS = ("PostgresMain", "ExecutorStart", "standard_ExecutorRun", "ExecutorFinish", "ExecConstraints",
             "stringToNode", "plpgsql_call_handler", "finish_xact_command", "RI_FKey_check_ins",
             "LockAcquireExtended", "ExecInitAppend")
_ANNOTATED = re.compile(r"^\s*([\d,]+) \([^)]*\)\s+\S*?:?([A-Za-z_][\w.]*)(?: \[|$)")


# --- The pure parts: tests/tooling/test_bench_server_instructions.py ---------------------------------------


def inclusive(annotated: str, names: tuple[str, ...] = FUNCTIONS) -> dict[str, int]:
    """Each named function's inclusive count in callgrind_annotate's output (`--inclusive=yes`).

    A function's recursive entries (`name'2`) are inside its first entry's count, so only `name` itself is read.
    """
    found: dict[str, int] = {}
    for line in annotated.splitlines():
        m = _ANNOTATED.match(line)
        if m and m.group(2) in names:
            found[m.group(2)] = found.get(m.group(2), 0) + int(m.group(1).replace(",", ""))
    return found


def the_runs_backend(dumps: dict[Path, str]) -> Path | None:
    """Of the dumps written since a pgbench run began, the one of the backend that ran its payments; None if
    it is not written yet.

    Others appear beside it: pgbench's own first connection, which runs no statement of the script, and, once,
    the server's start-up process, and the readiness checks' connections. Only a backend that ran the
    script wrote rows (both scripts insert and update).
    """
    ran = [path for path, text in dumps.items() if "ExecModifyTable" in text]
    if len(ran) > 1:
        raise NoFigure(f"{len(ran)} backends wrote rows during one pgbench run: {sorted(map(str, ran))}")
    return ran[0] if ran else None


# --- The run -----------------------------------------------------------------------------------------------


def _dumps(folder: Path) -> dict[Path, str]:
    """The backends' dumps written so far: each is complete once its `totals:` line is in it."""
    written = {}
    for path in folder.glob("callgrind.*"):
        text = path.read_text(errors="replace")
        if "\ntotals:" in text:
            written[path] = text
    return written


async def _empty(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(db_parts.FRESH)
    finally:
        await conn.close()


async def _quiet(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for name, value in QUIET:
            if (found := await conn.fetchval(f"SELECT current_setting('{name}')")) != value:
                raise NoFigure(f"the server runs with {name} = {found}, not {value}")
    finally:
        await conn.close()


def run_pgbench(binary: str, url: str, script: Path, payments: int, folder: Path) -> Path:
    """One pgbench run of `payments` payments on one connection, on empty tables; the dump of its backend.

    Empty tables, so that every run measures the same thing: an index's inserts cost more, and unevenly (a
    page split, a pass that deletes old versions), as it fills.
    """
    asyncio.run(_empty(url))
    before = set(_dumps(folder))
    run = subprocess.run(
        [binary, "--no-vacuum", "--protocol=prepared", "--client=1", "--jobs=1", f"--transactions={payments}",
         f"--file={script}", ceiling.libpq_url(url)],
        capture_output=True, text=True, env=ceiling.pgbench_environment(),
    )
    if run.returncode != 0 or "number of failed transactions: 0" not in run.stdout:
        raise NoFigure(f"pgbench failed on {script.name}:\n{(run.stdout + run.stderr)[-2000:]}")
    # The backends write their counts as they exit, after pgbench has closed them.
    deadline = time.monotonic() + 120
    while (found := the_runs_backend({p: t for p, t in _dumps(folder).items() if p not in before})) is None:
        if time.monotonic() > deadline:
            raise NoFigure("the backend of a pgbench run wrote no counts within 120 s")
        time.sleep(0.2)  # polling for the file, not waiting a guess
    return found


def annotate(path: Path) -> dict[str, int] | None:
    if shutil.which("callgrind_annotate") is None:
        return None
    out = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return inclusive(out)


def databases(names: tuple[str, ...]) -> dict[str, str]:
    """The database each named script runs on, by its schema (bench/db_parts.py's SCHEMAS): {name: database}.

    The head's schema is db_parts' own database; another schema gets one of its own, named by its place
    among the schemas.
    """
    unknown = [name for name in names if name not in SCHEMA_OF]
    if unknown:
        raise NoFigure(f"no such variant of bench/db_parts.py: {', '.join(unknown)}")
    number = {schema: n for n, schema in enumerate(db_parts.SCHEMAS)}
    return {name: db_parts.DATABASE if SCHEMA_OF[name] == "head" else f"{db_parts.DATABASE}_{number[SCHEMA_OF[name]]}"
            for name in names}


def measure(repeats: int, tolerance: float, variants: tuple[str, ...] = ()) -> None:
    if shutil.which("valgrind") is None:
        raise NoFigure("valgrind is not installed (apt-get install valgrind)")
    names = SCRIPTS + tuple(v for v in variants if v not in SCRIPTS)
    on = databases(names)
    root = Path(os.environ.get("PAYMENTS_DATA_DIR", Path.cwd() / ".data")).resolve()
    server = embedded_db.EmbeddedServer(root / "postgres-server-instructions", free_port())
    folder = root / "server-callgrind"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    user = embedded_db.run_as()
    if user is not None:
        import pwd

        embedded_db.ensure_reachable(folder)
        os.chown(folder, pwd.getpwnam(user).pw_uid, pwd.getpwnam(user).pw_gid)
    embedded_db.start(server)
    urls = {name: server.url(database) for name, database in on.items()}
    schema_of = {database: SCHEMA_OF[name] for name, database in on.items()}  # {database: its schema}
    try:
        # The head's first: its client's API key is the one every recorded script sends.
        api_key = None
        for database in sorted(schema_of, key=lambda d: d != db_parts.DATABASE):
            embedded_db.create_database(server.url(), database, recreate=True)
            api_key = db_parts.prepare(server.url(database), schema_of[database], api_key)
        assert api_key
        files, _ = db_parts.write_scripts(api_key)
    finally:
        embedded_db.stop(server)
    binary = ceiling.pgbench_binary(server)
    if binary is None:
        raise NoFigure("no pgbench beside the embedded server")
    postmaster = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--trace-children=yes", f"--callgrind-out-file={folder}/callgrind.%p",
         str(server.bin_dir / "postgres"), "-D", str(server.data_dir), "-h", "127.0.0.1", "-p", str(server.port),
         "-k", str(server.data_dir), *(arg for name, value in QUIET for arg in ("-c", f"{name}={value}"))],
        user=user, stdout=subprocess.DEVNULL, stderr=(log := open(folder / "server.log", "w")),
    )
    figures: dict[str, list[float]] = {name: [] for name in names}
    parts: dict[str, dict[str, float]] = {}
    try:
        deadline = time.monotonic() + 300
        # Its port opens before it takes queries (recovery first, slow under valgrind): ask it.
        ready = [str(server.bin_dir / "pg_isready"), "-q", "-h", "127.0.0.1", "-p", str(server.port)]
        while subprocess.run(ready).returncode != 0:
            if postmaster.poll() is not None or time.monotonic() > deadline:
                raise NoFigure(f"the server did not start under valgrind; see {folder / 'server.log'}")
            time.sleep(0.2)  # polling for the port
        asyncio.run(_quiet(urls["as is"]))
        # A run of each script first, not counted: the first backend to run a script after the server's
        # start reads its tables' and catalogues' pages into shared buffers, which the later ones find
        # there, and only its window of 10 would pay for that (docs/reference/performance.md has by how much).
        for name in names:
            run_pgbench(binary, urls[name], files[name], WINDOWS[0], folder)
        for repeat in range(1, repeats + 1):
            for name in names:
                fewer, more = (run_pgbench(binary, urls[name], files[name], n, folder) for n in WINDOWS)
                counts = [Count(n, 0, callgrind_total(p.read_text())) for n, p in zip(WINDOWS, (fewer, more))]
                figures[name].append(per_unit(*counts))
                print(f"{name}, repeat {repeat}: {counts[0].instructions:,} and {counts[1].instructions:,} "
                      f"instructions for {WINDOWS[0]} and {WINDOWS[1]} payments: "
                      f"{figures[name][-1]:,.0f} per payment", flush=True)
                a, b = annotate(fewer), annotate(more)
                if repeat == 1 and a is not None and b is not None:
                    parts[name] = {f: (b.get(f, 0) - a.get(f, 0)) / (WINDOWS[1] - WINDOWS[0]) for f in FUNCTIONS}
    finally:
        postmaster.terminate()
        postmaster.wait(timeout=120)
        log.close()
    per_payment = {name: agreed(name, figures[name], tolerance) for name in names}
    width = max(map(len, names))
    print("\nthe server's instructions per new payment (callgrind, one backend, windows of 10 and 110)")
    for name in names:
        print(f"  {name:>{width}}: {per_payment[name]:12,.0f}  (repeats within {spread(figures[name]):.2%})")
    print(f"  as is ÷ naive twin: {per_payment['as is'] / per_payment['naive twin']:.3f}")
    for name in names[len(SCRIPTS):]:
        saved = per_payment["as is"] - per_payment[name]
        print(f"  {name:>{width}}: ÷ as is {per_payment[name] / per_payment['as is']:.3f}, so the part costs "
              f"{saved:,.0f} ({saved / per_payment['as is']:.1%}); ÷ naive twin "
              f"{per_payment[name] / per_payment['naive twin']:.3f}")
    if not parts:
        print("no callgrind_annotate: no split by function")
        return
    print(f"\n{'inclusive, per payment':>24}  " + "  ".join(f"{n:>19}" for n in names))
    for f in FUNCTIONS:
        print(f"{f:>24}  " + "  ".join(f"{parts[n][f]:12,.0f} ({parts[n][f] / parts[n]['PostgresMain']:4.0%})"
                                         for n in names))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--variant", action="append", default=[], metavar="VARIANT",
                        choices=[v.name for v in db_parts.VARIANTS if v.name not in SCRIPTS],
                        help="also count this variant of bench/db_parts.py beside `as is` (again for more)")
    args = parser.parse_args()
    try:
        measure(args.repeats, args.tolerance, tuple(args.variant))
    except NoFigure as exc:
        print(f"NO FIGURE: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc


if __name__ == "__main__":
    main()
