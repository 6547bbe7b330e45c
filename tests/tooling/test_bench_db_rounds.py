"""bench/db_rounds.py: the index levels it reads, and the last round over the first.

The levels come from pageinspect on a real server: an index that gains a
level is how a round's buffers can step up once without a cost that grows
with every payment, so the bench must name the step, and must not name one
that did not happen.
"""

from __future__ import annotations

import asyncio

import asyncpg

from bench import db_rounds, system


async def _run(url: str, sql: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def test_an_index_that_splits_its_root_is_named_as_a_level_deeper_and_an_index_that_does_not_is_not(scratch: str):
    asyncio.run(_run(scratch, "CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE u (id int PRIMARY KEY);"
                              "INSERT INTO t VALUES (1); INSERT INTO u VALUES (1)"))
    before = asyncio.run(db_rounds.index_levels(scratch))
    assert before == {"public.t_pkey": 0, "public.u_pkey": 0}

    # A few thousand integers overflow a root that is also its only leaf; u's index is not touched.
    asyncio.run(_run(scratch, "INSERT INTO t SELECT generate_series(2, 5000)"))
    after = asyncio.run(db_rounds.index_levels(scratch))

    assert db_rounds.deeper(after, before) == {"public.t_pkey": [0, 1]}
    assert db_rounds.deeper(after, after) == {}
    assert db_rounds.deeper(after, None) == {}


def test_the_last_round_over_the_first_is_read_per_database_and_a_missing_figure_stays_missing():
    service, rails = db_rounds.DATABASES
    rounds = [
        {"databases": {service: {"buffers_per_payment": 100.0, "cpu_ms_per_payment": 2.0},
                       rails: {"cpu_ms_per_payment": 1.0}}},
        {"databases": {service: {"buffers_per_payment": 120.0, "cpu_ms_per_payment": 1.9},
                       rails: {"cpu_ms_per_payment": 1.05}}},
        {"databases": {service: {"buffers_per_payment": 108.0, "cpu_ms_per_payment": 1.8},
                       rails: {"cpu_ms_per_payment": 1.1}}},
    ]

    ratios = db_rounds.last_over_first({"rounds": rounds})

    assert ratios[service] == {"buffers_per_payment": 1.08, "cpu_ms_per_payment": 0.9}
    assert ratios[rails] == {"buffers_per_payment": None, "cpu_ms_per_payment": 1.1}


def test_the_servers_other_sessions_are_counted_from_inside_an_event_loop(server_url: str):
    """bench/db_rounds.py stops the embedded server from inside its event loop, after counting the sessions
    of other databases (a test run's, which it must not break). Bug caught: that count called asyncio.run
    inside the running loop, which refuses; the bench ended in a traceback and left the server running."""

    async def from_a_loop() -> int:
        conn = await asyncpg.connect(server_url)  # a session of a database that is not the bench's
        try:
            return system._other_sessions(server_url)
        finally:
            await conn.close()

    assert asyncio.run(from_a_loop()) >= 1
