"""What each part of a new payment costs the database: pgbench of its SQL, one part taken out at a time.

    python -m bench.db_parts [--rounds 5] [--seconds 8] [--clients 32] [--only VARIANT ...]

Not on a request's path: the measurement behind "the database's CPU per
payment, the safe service's against the naive twin's" in
docs/reference/performance.md. `make bench` finds the safe service's
database backends spending more CPU per payment than the twin's; this says
on which part of the payment's SQL, with nothing but PostgreSQL and pgbench
running (no Python service, no fakes), so that the parts can be weighed
against each other.

On databases of its own (one per schema below) on the embedded PostgreSQL
of EMBEDDED_PG_PORT (started if it is not running; DATABASE_URL is not
touched), migrated to this tree's head, each with one client. The starting
point is the script bench/ceiling.py records from the service's own request
path (the caller's lookup, HANDLER1, CHARGE_CAPTURED, PAYOUT_SENT); each
variant takes one part out of it, or changes the schema under it:

    as is              the recorded script on the head's schema
    no lookup          without the caller's lookup (its first statement)
    no key row         no key table at all: the lookup finds the client only,
                       HANDLER1 inserts the payment without a claim, and the
                       two recording statements find the payment by its id
                       instead of through the key row's fence
    no event           the finishing statement without its event (and the
                       webhook queue's join, which needs the event)
    2 key partitions   the key table with two day partitions instead of the
                       eight a fresh database has (the legacy one and seven
                       days ahead): before migration 0015 a look for a key
                       probed every partition; since, the days after
                       tomorrow are pruned, so this should cost nothing
    no keys to payment the foreign keys of ledger_entry and event into
                       payment dropped (each checked per inserted row)
    payment: its key   payment with its primary key only, as the twin's
      only             table is (no unique reference, no unique end-to-end
                       reference): what those two indexes cost the insert
                       (since migration 0014 the updates are HOT with them
                       too); HANDLER1 loses its ON CONFLICT, which needs the
                       reference's index
    before 0014        the payment's indexes and HANDLER1 as they were
                       before migration 0014: the reference's unique index
                       conditioned on `status`, the index of parked payments,
                       and the end-to-end reference written by the charge's
                       statement, not with the payment, so that neither of
                       the payment's updates can be HOT: what that migration
                       saved
    claim: the insert  HANDLER1's claim as a lone INSERT ... ON CONFLICT DO
      alone            NOTHING into the key table, without
                       claim_idempotency_key around it: no function call, no
                       advisory lock, no look for the key in every day's
                       partition (the look that makes a key unique across
                       days, which no index can; so not a safe claim, only
                       what those three cost)
    no timeline        the key row's two updates append no entry to its
                       timeline (the claim still writes the first)
    no advance         CHARGE_CAPTURED's fence locks the key row (SELECT ...
                       FOR UPDATE, the same conditions) instead of updating
                       it: what recording EXT2_SENT in the key row costs,
                       which the design requires before the payout is sent
    before 0015        both looks for the key (the caller's lookup, the
                       claim's) in every day's partition, the empty days
                       ahead included, as before migration 0015:
                       key_table_last_day() made to answer 'infinity', so
                       that nothing is pruned
    rules in functions the CHECK constraints between a row's columns (payment's
                       three, the ledger leg's and the key row's one each)
                       as one PL/pgSQL function a table, called by one CHECK:
                       PostgreSQL reads every CHECK expression back from its
                       stored text on each statement that writes its table,
                       and compiles a PL/pgSQL function once per connection;
                       the same rules, only the constraints' names change
    naive twin         the twin's own statements (its lookup, its insert, two
                       updates, two ledger postings), on its own tables

Each variant runs right beside a run of `as is`, first in one round and
second in the next, and is judged by the ratio of the two: a 2-CPU virtual
machine's speed drifts by more than some of these parts cost within a
minute or two, far less between two runs side by side. Every run starts
from empty tables and a checkpoint, so each measures the same thing: the
first seconds of a young database (a table's size moves its cost, and
`as is` runs as often as all the others together). Each run is measured three
ways: payments/s (pgbench's transactions/s: one transaction is one
payment's statements, each committed on its own as the service commits
them), the PostgreSQL server's CPU per payment (all its processes:
backends, WAL writer, checkpointer, autovacuum; pgbench's own CPU is not
in it), with the part of it spent in the kernel (sockets, the WAL's writes
and flushes, backends waiting on and waking each other), and the bytes of
WAL the server wrote per payment (every database's: a run that overlaps
the server's own work, a checkpoint's whole pages or autovacuum, writes
more, so this figure jumps between runs too; bench/explain.py counts each statement's WAL exactly). The CPU
figure is the one to read: pgbench shares the two CPUs, so its rate says
less. Every statement is prepared, on connections with the
service's own settings (`plan_cache_mode`, as app/db/engine.py sets it).
The databases are dropped at the end.

A part's share is 1 - (the variant's CPU per payment ÷ that of the `as is`
run beside it), the median of the rounds: what taking it out saves. Shares
do not add up exactly (the key row's fence and the lookup's key are counted
in both "no lookup" and "no key row", say).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import psutil

from app.admin import create_client, migrate_database
from app.client_accounts import _BY_HASH, hash_api_key
from app.config import libpq_url
from bench import ceiling
from devtools import embedded_db

DATABASE = "payments_bench_db_parts"
SCRIPTS = ceiling.SCRIPT.parent / "db_parts"
# The statements of the recorded script, by what starts their comment line.
LOOKUP, HANDLER1, CHARGE, PAYOUT = "-- 1. ", "-- 2. ", "-- 3. ", "-- 4. "
# The key row's fence in a recording statement, up to the CTE that follows it.
_FENCE = re.compile(r"WITH fence AS \(\n\s+UPDATE idempotency_key\n.*?RETURNING payment_id\n\)", re.S)
# HANDLER1's fence: the claim.
_CLAIM = re.compile(r"WITH fence AS \(\n\s+SELECT claimed\.lease_token.*?\n\), created AS", re.S)


@dataclass
class Variant:
    name: str
    database: str  # the schema it runs on: a key of SCHEMAS
    edit: Callable[[str], str] = lambda script: script
    twin: bool = False
    rates: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    kernel_ms: list[float] = field(default_factory=list)  # the part of cpu_ms spent in the kernel
    wal_bytes: list[float] = field(default_factory=list)


def _statements(script: str) -> tuple[str, dict[str, str]]:
    """The script's preamble and its statements by their comment's prefix."""
    head, *rest = re.split(r"(?m)^(?=-- \d+\. )", script)
    return head, {part[:6]: part for part in rest}


def _join(head: str, parts: dict[str, str]) -> str:
    return head + "".join(parts[k] for k in sorted(parts))


def without_lookup(script: str) -> str:
    head, parts = _statements(script)
    del parts[LOOKUP]
    return _join(head, parts)


def without_key_row(script: str) -> str:
    head, parts = _statements(script)
    api_key_hash = re.search(r"c\.api_key_hash = ('[^']*')", parts[LOOKUP])
    assert api_key_hash, "the lookup names no api_key_hash"
    parts[LOOKUP] = ("-- 1. the client only\n"
                     f"SELECT id AS caller_id FROM client WHERE api_key_hash = {api_key_hash.group(1)} \\gset s1_\n")
    handler1, n = _CLAIM.subn("WITH fence AS (SELECT 1), created AS", parts[HANDLER1])
    assert n == 1, "HANDLER1 has no claim to take out"
    parts[HANDLER1] = handler1.replace("fence.lease_token, fence.stored_on AS key_stored_on, ", "")
    by_id = f"WITH fence AS (SELECT {ceiling.VARYING['payment_id']} AS payment_id)"
    for statement in (CHARGE, PAYOUT):
        parts[statement], n = _FENCE.subn(by_id, parts[statement])
        assert n == 1, f"statement {statement} has no key row's fence"
    return _join(head, parts)


def without_event(script: str) -> str:
    head, parts = _statements(script)
    lines = parts[PAYOUT].splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("), emitted AS ("))
    end = next(i for i, line in enumerate(lines) if i > start and line.startswith(")\n"))
    parts[PAYOUT] = "".join(lines[:start] + lines[end:])
    return _join(head, parts)


def without_on_conflict(script: str) -> str:
    """HANDLER1 without its ON CONFLICT clause, which needs the partial unique index on the reference."""
    head, parts = _statements(script)
    parts[HANDLER1], n = re.subn(r"\n\s*ON CONFLICT \(client_id, reference\)[^\n]*DO NOTHING", "", parts[HANDLER1])
    assert n == 1, "HANDLER1 has no ON CONFLICT on the reference"
    return _join(head, parts)


def before_0014(script: str) -> str:
    """HANDLER1 as it was before migration 0014: the end-to-end reference left NULL, the old ON CONFLICT."""
    head, parts = _statements(script)
    handler1, n = re.subn(r", end_to_end_reference\)", ")", parts[HANDLER1])
    assert n == 1, "HANDLER1 inserts no end-to-end reference"
    e2e = re.escape(ceiling.VARYING["end_to_end_reference"])
    handler1, n = re.subn(rf", {e2e}(\s+FROM fence)", r"\1", handler1)
    assert n == 1, "HANDLER1's end-to-end reference is not its last value"
    handler1, n = re.subn(r"WHERE holds_reference DO NOTHING", "WHERE status NOT IN ('declined', 'failed') DO NOTHING",
                          handler1)
    assert n == 1, "HANDLER1 has no ON CONFLICT on holds_reference"
    parts[HANDLER1] = handler1
    return _join(head, parts)


def claim_insert_alone(script: str) -> str:
    """HANDLER1's claim as the bare INSERT that claim_idempotency_key makes, with the same values."""
    head, parts = _statements(script)
    call = re.search(r"claim_idempotency_key\((.*?)\) AS claimed\(lease_token\)", parts[HANDLER1], re.S)
    assert call, "HANDLER1 does not call claim_idempotency_key"
    # Its seven arguments, split at the commas outside parentheses.
    client, key, endpoint, request_hash, recovery_point, payment_id, seconds = (
        a.strip() for a in re.split(r",(?![^(]*\))", call.group(1)))
    fence = f"""WITH fence AS (
    INSERT INTO idempotency_key
        (client_id, key, stored_on, endpoint, request_hash, state, recovery_point, payment_id,
         lease_token, lease_expires_at, timeline)
    VALUES ({client}, {key}, key_table_day(), {endpoint}, {request_hash}, 'started', {recovery_point}, {payment_id},
            gen_random_uuid(), now() + make_interval(secs => {seconds}),
            jsonb_build_array(jsonb_build_object(
                'at', now(), 'event', 'claimed', 'recovery_point', {recovery_point}, 'attempt', 1)))
    ON CONFLICT DO NOTHING
    RETURNING lease_token, stored_on
), created AS"""
    parts[HANDLER1], n = _CLAIM.subn(lambda _: fence, parts[HANDLER1])
    assert n == 1, "HANDLER1 has no claim to replace"
    return _join(head, parts)


def without_timeline(script: str) -> str:
    head, parts = _statements(script)
    for statement in (CHARGE, PAYOUT):
        parts[statement], n = re.subn(r",\n\s+timeline = timeline \|\| jsonb_build_object\([^\n]*\)\n", "\n",
                                      parts[statement])
        assert n == 1, f"statement {statement} appends no timeline entry"
    return _join(head, parts)


def without_advance(script: str) -> str:
    """CHARGE_CAPTURED's fence as a row lock on the key row, under the same conditions, instead of its UPDATE."""
    head, parts = _statements(script)
    where = re.search(r"UPDATE idempotency_key\n.*?(WHERE client_id.*?)\n\s+RETURNING payment_id", parts[CHARGE], re.S)
    assert where, "CHARGE_CAPTURED's fence is not an UPDATE of the key row"
    lock = f"WITH fence AS (\n    SELECT payment_id FROM idempotency_key\n     {where.group(1)}\n       FOR UPDATE\n)"
    parts[CHARGE], n = _FENCE.subn(lambda _: lock, parts[CHARGE])
    assert n == 1, "CHARGE_CAPTURED has no key row's fence"
    return _join(head, parts)


def twin_script(api_key_hash: bytes) -> str:
    """The naive twin's statements for one paid payment, as naive_twin/app.py runs them."""
    from naive_twin import app as twin  # its SQL, not a copy of it

    k = ceiling.VARYING
    values = {
        "hash": ceiling.literal(api_key_hash), "id": k["payment_id"], "client_id": "1",
        "reference": k["reference"], "amount": "1250", "currency": "'EUR'", "fee": "43", "net": "1207",
        "card_token": "'tok_visa'", "beneficiary_name": "'Ada Lovelace'",
        "beneficiary_iban": "'DE89370400440532013000'", "charge_id": k["charge_id"], "e2e": k["e2e"],
        "transfer_id": k["transfer_id"], "payment_id": k["payment_id"],
    }

    def render(sql: str, **more: str) -> str:
        return re.sub(r"(?<!:):(\w+)", lambda m: {**values, **more}[m.group(1)], " ".join(sql.split())) + ";\n"

    def post(accounts: list[str], debits: list[int], credits: list[int], posting: str) -> str:
        return render(str(twin._POST), posting=f"'{posting}'", accounts=ceiling.literal(accounts),
                      debits=ceiling.literal(debits), credits=ceiling.literal(credits))

    return "".join([
        "\\set k random(1, 9223372036854775806)\n",
        render(str(_BY_HASH)),
        render(str(twin._INSERT)),
        render(str(twin._CHARGED)),
        post(["psp_receivable", "beneficiary_payable", "fee_revenue"], [1250, 0, 0], [0, 1207, 43], "charge_captured"),
        render(str(twin._PAID)),
        post(["beneficiary_payable", "rail_settlement"], [1207, 0], [0, 1207], "payout_sent"),
    ])


VARIANTS = [
    Variant("as is", "head"),
    Variant("no lookup", "head", without_lookup),
    Variant("no key row", "head", without_key_row),
    Variant("no event", "head", without_event),
    Variant("2 key partitions", "2 partitions"),
    Variant("no keys to payment", "no payment keys"),
    Variant("payment: its key only", "payment key only", without_on_conflict),
    Variant("before 0014", "before 0014", before_0014),
    Variant("before 0015", "before 0015"),
    Variant("claim: the insert alone", "head", claim_insert_alone),
    Variant("no timeline", "head", without_timeline),
    Variant("no advance", "head", without_advance),
    Variant("rules in functions", "rules in functions"),
    Variant("naive twin", "head", twin=True),
]
SCHEMAS = {
    "head": [],
    # Today's partition (the legacy one reaches to tomorrow on a database migrated today) and tomorrow's.
    "2 partitions": ["drop days"],
    "no payment keys": ["ALTER TABLE ledger_entry DROP CONSTRAINT ledger_entry_payment_id_fkey",
                        "ALTER TABLE event DROP CONSTRAINT event_payment_id_fkey"],
    # payment with its primary key alone, as the twin's table.
    # The indexes of payment before migration 0014 (its downgrade's, less the column).
    "before 0014": ["DROP INDEX payment_reference_in_force",
                    "CREATE UNIQUE INDEX payment_reference_in_force ON payment (client_id, reference) "
                    "WHERE status NOT IN ('declined', 'failed')",
                    "CREATE INDEX payment_indeterminate ON payment (payout_instructed_at) WHERE status = 'indeterminate'"],
    # No bound on the day a key row can be stored on: every partition is looked in, as before 0015.
    "before 0015": ["CREATE OR REPLACE FUNCTION key_table_last_day() RETURNS date LANGUAGE sql STABLE "
                    "AS $$ SELECT date 'infinity' $$"],
    "payment key only": ["DROP INDEX payment_reference_in_force",
                         "ALTER TABLE payment DROP CONSTRAINT payment_end_to_end_reference_key"],
    # The rules between a row's columns as one PL/pgSQL function a table, which PostgreSQL compiles once
    # per connection, instead of CHECK expressions it reads back from their stored text on every
    # statement that writes a row: the same rules, one constraint a table instead of five in all.
    "rules in functions": [
        """CREATE FUNCTION payment_rules_hold(amount bigint, fee bigint, net bigint, refunded bigint, status text,
                                              holds_reference boolean) RETURNS boolean
           LANGUAGE plpgsql IMMUTABLE AS $$
           BEGIN
             RETURN net = amount - fee AND refunded BETWEEN 0 AND amount
                AND holds_reference = (status NOT IN ('declined', 'failed'));
           END $$""",
        "ALTER TABLE payment DROP CONSTRAINT payment_check, DROP CONSTRAINT payment_refunded_within_amount, "
        "DROP CONSTRAINT payment_holds_reference_by_status, ADD CONSTRAINT payment_rules "
        "CHECK (payment_rules_hold(amount_minor, fee_minor, net_minor, refunded_minor, status, holds_reference))",
        """CREATE FUNCTION leg_rules_hold(debit bigint, credit bigint) RETURNS boolean LANGUAGE plpgsql IMMUTABLE
           AS $$ BEGIN RETURN (debit = 0) <> (credit = 0); END $$""",
        "ALTER TABLE ledger_entry DROP CONSTRAINT ledger_entry_check, "
        "ADD CONSTRAINT ledger_entry_rules CHECK (leg_rules_hold(debit_minor, credit_minor))",
        """CREATE FUNCTION key_rules_hold(state text, code integer, body text) RETURNS boolean
           LANGUAGE plpgsql IMMUTABLE
           AS $$ BEGIN RETURN (state = 'finished') = (code IS NOT NULL AND body IS NOT NULL); END $$""",
        "ALTER TABLE idempotency_key DROP CONSTRAINT idempotency_key_check, "
        "ADD CONSTRAINT idempotency_key_rules CHECK (key_rules_hold(state, response_code, response_body))",
    ],
}


# What a run leaves behind, emptied before the next (the tables that point at
# these go with them).
FRESH = "TRUNCATE idempotency_key, payment, naive.payment, naive.ledger_entry CASCADE"


async def _sql(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            if statement == "drop days":
                names = await conn.fetch(
                    "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                    "WHERE i.inhparent = 'idempotency_key'::regclass AND c.relname <> 'idempotency_key_legacy' "
                    "ORDER BY c.relname OFFSET 1")
                for (name,) in names:
                    await conn.execute(f"DROP TABLE {name}")
            else:
                await conn.execute(statement)
    finally:
        await conn.close()


async def _wal_position(url: str) -> str:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval("SELECT CAST(pg_current_wal_insert_lsn() AS text)")
    finally:
        await conn.close()


async def _wal_since(url: str, lsn: str) -> float:
    """Bytes of WAL the server has written since `lsn` (every database's, and the server's own)."""
    conn = await asyncpg.connect(url)
    try:
        return float(await conn.fetchval("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), CAST(CAST($1 AS text) AS pg_lsn))",
                                         lsn))
    finally:
        await conn.close()


def prepare(url: str, schema: str, api_key: str | None = None) -> str:
    """Migrate the (empty) database at `url`, give it client 1 and `schema`'s changes; the client's API key.

    Given an API key, client 1 answers to it, so that one recorded script
    serves every schema's database; else to the one it was made with.
    """
    migrate_database(url)
    client_id, made = create_client(url, "pgbench")
    assert client_id == 1, "the twin's statements name client 1"
    api_key = api_key or made
    asyncio.run(_sql(url, f"UPDATE client SET api_key_hash = '\\x{hash_api_key(api_key).hex()}'", *SCHEMAS[schema]))
    return api_key


def write_scripts(api_key: str) -> tuple[dict[str, Path], list[str]]:
    """Record one new payment's statements and write every variant's script: (scripts by variant, issuers)."""
    recorded, issuers = asyncio.run(ceiling.write_script(api_key, 1))
    script = recorded.read_text()
    SCRIPTS.mkdir(parents=True, exist_ok=True)
    files = {}
    for v in VARIANTS:
        files[v.name] = SCRIPTS / (re.sub(r"\W+", "_", v.name) + ".pgbench")
        files[v.name].write_text(twin_script(hash_api_key(api_key)) if v.twin else v.edit(script))
    return files, issuers


def server_cpu(postmaster: psutil.Process, processes: int) -> tuple[float, float]:
    """CPU seconds of the server so far, in its own code and in the kernel's (user, system): the postmaster,
    its live children and those it has reaped.

    First waits until no more than `processes` children are left (the
    server's own, with no client connected): a backend that has exited but
    is not reaped yet is in neither count, and would be lost to the run it
    served. The kernel's share is the sockets, the WAL's writes and
    flushes, and the waits and wake-ups between backends; the rest is
    PostgreSQL's own work on the statements (what bench/server_instructions.py
    counts, one backend at a time).
    """
    deadline = time.monotonic() + 30
    while len(postmaster.children()) > processes:
        if time.monotonic() > deadline:
            raise SystemExit("NO FIGURE: the server's backends did not end within 30 s of pgbench's")
        time.sleep(0.05)  # polling for the condition, not waiting a guess
    t = postmaster.cpu_times()
    user, system = t.user + t.children_user, t.system + t.children_system
    for child in postmaster.children():
        try:
            c = child.cpu_times()
        except psutil.Error:
            continue  # ended just now: counted once the postmaster reaps it
        user, system = user + c.user, system + c.system
    return user, system


def pgbench(binary: str, url: str, script: Path, clients: int, seconds: float = 0, transactions: int = 0,
            ) -> tuple[float, int]:
    """Run `script` for `seconds`, or `transactions` per client: payments (transactions) per second, and how
    many. A failed transaction fails the run."""
    length = f"--transactions={transactions}" if transactions else f"--time={max(1, round(seconds))}"
    argv = [binary, "--no-vacuum", "--protocol=prepared", f"--client={clients}", f"--jobs={min(clients, 2)}",
            length, f"--file={script}", libpq_url(url)]
    run = subprocess.run(argv, capture_output=True, text=True, env=ceiling.pgbench_environment())
    found = re.search(r"tps = ([\d.]+)", run.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", run.stdout)
    done = re.search(r"number of transactions actually processed: (\d+)", run.stdout)
    if run.returncode != 0 or not found or not done or (failed and failed.group(1) != "0"):
        raise SystemExit(f"NO FIGURE: pgbench failed on {script.name}:\n{(run.stdout + run.stderr)[-2000:]}")
    return float(found.group(1)), int(done.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--only", action="append", choices=[v.name for v in VARIANTS[1:]], metavar="VARIANT",
                        help="run only this variant beside `as is` (again for more); every variant by default")
    args = parser.parse_args()

    server = embedded_db.default_server()
    embedded_db.start(server)
    admin = server.url("postgres")
    urls = {schema: server.url(f"{DATABASE}_{n}") for n, schema in enumerate(SCHEMAS)}
    for url in urls.values():
        embedded_db.create_database(admin, url.rsplit("/", 1)[1], recreate=True)
    try:
        api_key = None
        for schema, url in urls.items():
            api_key = prepare(url, schema, api_key)
        assert api_key
        files, issuers = write_scripts(api_key)
        binary = ceiling.pgbench_binary(server)
        assert binary, "no pgbench beside the embedded server"
        postmaster = psutil.Process(int((server.data_dir / "postmaster.pid").read_text().split()[0]))
        own = len(postmaster.children())  # checkpointer, WAL writer, autovacuum launcher...: no client now
        base, others = VARIANTS[0], [v for v in VARIANTS[1:] if not args.only or v.name in args.only]
        print(f"pgbench of {', '.join(issuers)} and {len(others)} variants ({SCRIPTS}); "
              f"{args.clients} clients, {args.rounds} rounds, each variant beside a run of `as is` in each, "
              f"{args.seconds:g} s a run", flush=True)

        def run(v: Variant, n: int) -> float:
            # Every run starts from empty tables: else `as is`, which runs beside
            # every variant, would be measured on a database several times the
            # size of the other schemas', and a table's size moves its cost.
            asyncio.run(_sql(urls[v.database], FRESH, "CHECKPOINT"))
            lsn = asyncio.run(_wal_position(admin))
            user, system = server_cpu(postmaster, own)
            rate, payments = pgbench(binary, urls[v.database], files[v.name], args.clients, args.seconds)
            v.rates.append(rate)
            after = server_cpu(postmaster, own)
            v.cpu_ms.append((sum(after) - user - system) * 1000 / payments)
            v.kernel_ms.append((after[1] - system) * 1000 / payments)
            v.wal_bytes.append(asyncio.run(_wal_since(admin, lsn)) / payments)
            print(f"round {n + 1} {v.name:>22}: {rate:7.1f} payments/s, server CPU {v.cpu_ms[-1]:.3f} ms "
                  f"({v.kernel_ms[-1]:.3f} of it in the kernel) and {v.wal_bytes[-1]:,.0f} bytes of WAL a payment "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
            return v.cpu_ms[-1]

        # Each variant runs right beside a run of `as is`, in turn first and
        # second: this machine's speed drifts by more than some parts cost
        # within the minute or two of a round, far less within a pair.
        ratios: dict[str, list[float]] = {v.name: [] for v in others}
        for n in range(args.rounds):
            for v in others[n % len(others):] + others[:n % len(others)]:
                if n % 2 == 0:
                    as_is, cpu = run(base, n), run(v, n)
                else:
                    cpu, as_is = run(v, n), run(base, n)
                ratios[v.name].append(cpu / as_is)
        print(f"\n{'variant':>22}  payments/s  WAL bytes a payment  server CPU ms a payment (in the kernel)  "
              f"÷ as is beside it (median of the rounds' ratios)")
        print(f"{base.name:>22}  {statistics.median(base.rates):10.1f}  {statistics.median(base.wal_bytes):19,.0f}  "
              f"{statistics.median(base.cpu_ms):23.3f} ({statistics.median(base.kernel_ms):.3f})")
        for v in others:
            r = ratios[v.name]
            print(f"{v.name:>22}  {statistics.median(v.rates):10.1f}  {statistics.median(v.wal_bytes):19,.0f}  "
                  f"{statistics.median(v.cpu_ms):23.3f} ({statistics.median(v.kernel_ms):.3f})  "
                  f"{statistics.median(r):.3f} (rounds {', '.join(f'{x:.3f}' for x in r)})")
    finally:
        for url in urls.values():
            embedded_db.drop_database(admin, url.rsplit("/", 1)[1])


if __name__ == "__main__":
    main()
