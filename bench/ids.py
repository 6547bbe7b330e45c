"""`python -m bench.ids`: what time-ordered payment ids (UUIDv7) save over random ones (UUIDv4).

The payment table's primary key is a B-tree over its id. A random id lands
on a random leaf page of it: once the index outgrows the cache every insert
may read a page, pages split half full all over the index, and after each
checkpoint the first change to every page writes that whole page to the WAL
(a full-page image). A time-ordered id lands on the right-hand edge: the
same few pages are written again and again, and the index fills its pages.

Two copies of the payment table (the real one's columns, defaults and checks,
each with its own primary key) are filled side by side in one run, in rounds
that alternate, with the same rows but for the id: a UUIDv4 in one, a UUIDv7
(app/payments/phases.py::new_payment_id) in the other. Each round starts
after a CHECKPOINT, as production inserts do at some point after one, and
counts the WAL it writes (pg_current_wal_lsn before and after). At the end:
WAL bytes per row and the size of each primary key, and their ratios.

Runs in a scratch database of its own (`payments_bench_ids`), on DATABASE_URL's
server or the embedded one, dropped at the end.
"""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import asyncpg
import typer
from rich.console import Console
from rich.table import Table

from app.config import libpq_url
from app.payments.phases import new_payment_id
from devtools.system import System

DATABASE = "payments_bench_ids"
console = Console()

COLUMNS = (
    "id, client_id, reference, amount_minor, currency, fee_minor, net_minor, card_token, "
    "beneficiary_name, beneficiary_iban, status, psp_charge_key, created_at, updated_at"
)


def rows(ids: list[uuid.UUID], start: int) -> list[tuple]:
    now = datetime.now(UTC)
    return [
        (i, 1, f"order-{start + n}", 1250, "EUR", 43, 1207, "tok_visa", "Ada Lovelace",
         "DE89370400440532013000", "succeeded", "k" * 64, now, now)
        for n, i in enumerate(ids)
    ]


async def measure(url: str, total: int, rounds: int, batch: int) -> dict[str, dict[str, float]]:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("INSERT INTO client (id, name, api_key_hash) OVERRIDING SYSTEM VALUE VALUES (1, 'b', 'h')")
        for table in ("ids_v4", "ids_v7"):
            await conn.execute(
                f"CREATE TABLE {table} (LIKE payment INCLUDING DEFAULTS INCLUDING CONSTRAINTS); "
                f"ALTER TABLE {table} ADD PRIMARY KEY (id)"
            )
        wal = {"ids_v4": 0, "ids_v7": 0}
        per_round = total // rounds
        for r in range(rounds):
            for table, make in (("ids_v4", uuid.uuid4), ("ids_v7", new_payment_id)):
                await conn.execute("CHECKPOINT")
                before = await conn.fetchval("SELECT pg_current_wal_lsn()")
                for start in range(r * per_round, (r + 1) * per_round, batch):
                    await conn.copy_records_to_table(
                        table, records=rows([make() for _ in range(batch)], start), columns=COLUMNS.split(", ")
                    )
                after = await conn.fetchval("SELECT pg_current_wal_lsn()")
                wal[table] += await conn.fetchval("SELECT pg_wal_lsn_diff($1, $2)", after, before)
            console.print(f"round {r + 1}/{rounds}: {(r + 1) * per_round:,} rows in each table")
        out = {}
        for table in ("ids_v4", "ids_v7"):
            out[table] = {
                "rows": await conn.fetchval(f"SELECT count(*) FROM {table}"),
                "wal_bytes_per_row": float(wal[table]) / (per_round * rounds),
                "pkey_bytes": await conn.fetchval(f"SELECT pg_relation_size('{table}_pkey')"),
            }
        return out
    finally:
        await conn.close()


def main(
    rows_per_table: int = typer.Option(400_000, "--rows", help="Rows inserted into each table."),
    rounds: int = typer.Option(8, help="Alternating rounds (each after a CHECKPOINT)."),
    batch: int = typer.Option(100, help="Rows per COPY, i.e. per commit."),
) -> None:
    """Insert the same payments with UUIDv4 and with UUIDv7 ids, side by side; compare WAL and index size."""
    with System() as system:
        system.start_postgres()
        url = libpq_url(system.create_database(DATABASE, drop_at_end=True))
        result = asyncio.run(measure(url, rows_per_table, rounds, batch))
    v4, v7 = result["ids_v4"], result["ids_v7"]
    table = Table(title=f"payment ids: {v4['rows']:,} rows each, commits of {batch}, a CHECKPOINT before each of {rounds} rounds")
    for column in ("", "UUIDv4 (random)", "UUIDv7 (time-ordered)", "v7 ÷ v4"):
        table.add_column(column, justify="right")
    table.add_row("WAL bytes per row", f"{v4['wal_bytes_per_row']:,.0f}", f"{v7['wal_bytes_per_row']:,.0f}",
                  f"{v7['wal_bytes_per_row'] / v4['wal_bytes_per_row']:.2f}")
    table.add_row("primary key size", f"{v4['pkey_bytes'] / 2**20:,.1f} MiB", f"{v7['pkey_bytes'] / 2**20:,.1f} MiB",
                  f"{v7['pkey_bytes'] / v4['pkey_bytes']:.2f}")
    console.print(table)


if __name__ == "__main__":
    typer.run(main)
