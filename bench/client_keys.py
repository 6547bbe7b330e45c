"""What the foreign keys into the client row cost the database: pgbench of one payment's SQL, with them and without.

    python -m bench.client_keys [--rounds 4] [--seconds 15] [--clients 32]

Not on a request's path: the measurement behind migration 0013, which
dropped every foreign key from a table written per operation into `client`.
A foreign key is checked by locking the referenced row FOR KEY SHARE in the
inserting transaction; all of a client's payments lock its one row.

On a database of its own on the embedded PostgreSQL of EMBEDDED_PG_PORT
(started if it is not running; DATABASE_URL is not touched), migrated to
this tree's head, with one client. The script pgbench runs is the service's
own SQL for one new payment, recorded from its request path by
bench/ceiling.py (the caller's lookup, HANDLER1, CHARGE_CAPTURED,
PAYOUT_SENT, each a transaction of its own, prepared). Two variants
alternate, in opposite order each round, so that drift on a shared machine
falls on both alike:

    keys      the head's schema with the three foreign keys a payment's rows
              had into `client` put back (idempotency_key, payment, event)
    no keys   the head's schema as it is

It prints each round's payments/s (pgbench's transactions/s: one
transaction is one payment's four statements) and the median ratio,
no keys ÷ keys. The database is dropped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics

import asyncpg

from app.admin import create_client, migrate_database
from bench import ceiling
from devtools import embedded_db

DATABASE = "payments_bench_client_keys"
# The keys a new payment's rows had into client before migration 0013.
PAYMENT_KEYS = (
    ("idempotency_key", "idempotency_key_client_id_fkey"),
    ("payment", "payment_client_id_fkey"),
    ("event", "event_client_id_fkey"),
)
VARIANTS = ("keys", "no keys")


async def _sql(url: str, *statements: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        for statement in statements:
            await conn.execute(statement)
    finally:
        await conn.close()


async def _set_keys(url: str, on: bool) -> None:
    statements = [f"ALTER TABLE {table} DROP CONSTRAINT IF EXISTS {name}" for table, name in PAYMENT_KEYS]
    if on:
        statements += [f"ALTER TABLE {table} ADD CONSTRAINT {name} FOREIGN KEY (client_id) REFERENCES client (id)"
                       for table, name in PAYMENT_KEYS]
    # A checkpoint now, not in the middle of the next round.
    await _sql(url, *statements, "CHECKPOINT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--clients", type=int, default=32)
    args = parser.parse_args()

    server = embedded_db.default_server()
    embedded_db.start(server)
    admin = f"postgresql://postgres@127.0.0.1:{server.port}/postgres"
    url = f"postgresql://postgres@127.0.0.1:{server.port}/{DATABASE}"
    embedded_db.create_database(admin, DATABASE, recreate=True)
    try:
        migrate_database(url)
        client_id, api_key = create_client(url, "pgbench")
        script, issuers = asyncio.run(ceiling.write_script(api_key, client_id))
        print(f"pgbench of {script}: {', '.join(issuers)}; {args.clients} clients, {args.rounds} rounds of {args.seconds:g} s")
        binary = ceiling.pgbench_binary(server)
        assert binary, "no pgbench beside the embedded server"
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for n in range(args.rounds):
            for variant in VARIANTS if n % 2 == 0 else VARIANTS[::-1]:
                asyncio.run(_set_keys(url, on=variant == "keys"))
                run = ceiling.run_pgbench(binary, url, args.clients, 2, args.seconds)
                output, _ = run.communicate()
                found = re.search(r"tps = ([\d.]+)", output)
                failed = re.search(r"number of failed transactions: (\d+)", output)
                if run.returncode != 0 or not found or (failed and failed.group(1) != "0"):
                    raise SystemExit(f"NO FIGURE: pgbench failed in round {n + 1} ({variant}):\n{output[-2000:]}")
                rates[variant].append(float(found.group(1)))
                print(f"round {n + 1} {variant:>7}: {rates[variant][-1]:7.1f} payments/s"
                      f"  (load average {os.getloadavg()[0]:.1f})", flush=True)
        ratios = [without / with_ for with_, without in zip(rates["keys"], rates["no keys"], strict=True)]
        print(f"median payments/s: keys {statistics.median(rates['keys']):.1f}, "
              f"no keys {statistics.median(rates['no keys']):.1f}; "
              f"no keys ÷ keys, median of the rounds' ratios: {statistics.median(ratios):.3f}"
              f" (rounds {', '.join(f'{r:.3f}' for r in ratios)})")
    finally:
        embedded_db.drop_database(admin, DATABASE)


if __name__ == "__main__":
    main()
