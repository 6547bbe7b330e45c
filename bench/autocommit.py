"""What a lone statement's AUTOCOMMIT costs the API in CPU, three ways.

`app.db.transaction.one_statement` runs a phase without BEGIN and COMMIT, on
a connection set to AUTOCOMMIT. This prints the CPU of this process per
`SELECT 1` run that way, for the three ways SQLAlchemy offers to get such a
connection: set on the connection as it is checked out (what one_statement
does), from an AUTOCOMMIT copy of the engine made once and kept, and from
one made on every call. Each is measured in alternating rounds, so drift on
a shared machine falls on all three alike.

    python -m bench.autocommit [--statements 5000] [--rounds 4]

On the embedded PostgreSQL of EMBEDDED_PG_PORT (started if it is not running).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

from sqlalchemy import text

from app.config import Settings
from app.db.engine import build_engine
from devtools import embedded_db

_SELECT = text("SELECT 1")


async def measure(url: str, statements: int, rounds: int) -> dict[str, list[float]]:
    engine = build_engine(Settings(database_url=url.replace("postgresql://", "postgresql+asyncpg://", 1)))
    kept = engine.execution_options(isolation_level="AUTOCOMMIT")

    async def on_the_connection() -> None:
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(_SELECT)

    async def engine_copy_kept() -> None:
        async with kept.connect() as conn:
            await conn.execute(_SELECT)

    async def engine_copy_per_call() -> None:
        async with engine.execution_options(isolation_level="AUTOCOMMIT").connect() as conn:
            await conn.execute(_SELECT)

    ways: list[Callable[[], Awaitable[None]]] = [on_the_connection, engine_copy_kept, engine_copy_per_call]
    micros: dict[str, list[float]] = {way.__name__: [] for way in ways}
    try:
        for _ in range(rounds):
            for way in ways:
                for _ in range(statements // 10):  # warm: the pool filled, the statement prepared
                    await way()
                started = time.process_time()
                for _ in range(statements):
                    await way()
                micros[way.__name__].append((time.process_time() - started) / statements * 1e6)
    finally:
        await engine.dispose()
    return micros


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--statements", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    server = embedded_db.default_server()
    started = embedded_db.start(server)
    try:
        micros = asyncio.run(measure(server.url(), args.statements, args.rounds))
    finally:
        if started:
            embedded_db.stop(server)
    for way, each in micros.items():
        rounds = ", ".join(f"{m:.0f}" for m in each)
        print(f"{way:22} median {statistics.median(each):5.0f} us of CPU per statement (rounds: {rounds})")


if __name__ == "__main__":
    main()
