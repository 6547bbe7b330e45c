"""bench/server_instructions.py: which backend's counts are a run's, and the split by function it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import db_parts
from bench.instructions import NoFigure
from bench.server_instructions import databases, inclusive, the_runs_backend

# callgrind_annotate --inclusive=yes, as it prints the embedded server's functions (shortened).
ANNOTATED = """\
--------------------------------------------------------------------------------
376,493,254 (100.0%)  PROGRAM TOTALS
--------------------------------------------------------------------------------
420,456,659 (111.7%)  ???:ExecProcNodeFirst'2 [/x/pginstall/bin/postgres]
365,441,885 (97.06%)  ???:PostgresMain [/x/pginstall/bin/postgres]
 78,114,960 (20.75%)  ???:ExecutorStart [/x/pginstall/bin/postgres]
 77,812,000 (20.67%)  ???:ExecConstraints'2 [/x/pginstall/bin/postgres]
 77,767,393 (20.66%)  ???:ExecConstraints [/x/pginstall/bin/postgres]
 14,564,414 ( 3.87%)  ./csu/../csu/libc-start.c:stringToNode [/usr/lib/x86_64-linux-gnu/libc.so.6]
"""


def test_a_functions_count_is_its_own_entry_not_its_recursions_nor_a_longer_name():
    found = inclusive(ANNOTATED, ("PostgresMain", "ExecutorStart", "ExecConstraints", "stringToNode", "ExecProcNode"))

    assert found == {"PostgresMain": 365_441_885, "ExecutorStart": 78_114_960, "ExecConstraints": 77_767_393,
                     "stringToNode": 14_564_414}


def test_the_runs_backend_is_the_one_that_wrote_rows_and_two_such_are_no_figure():
    pgbench_setup = "fn=(1) PostgresMain\nfn=(2) InitPostgres\ntotals: 11000000\n"
    client = "fn=(1) PostgresMain\nfn=(3) ExecModifyTable\ntotals: 70000000\n"

    assert the_runs_backend({Path("a"): pgbench_setup}) is None  # not written yet
    assert the_runs_backend({Path("a"): pgbench_setup, Path("b"): client}) == Path("b")
    with pytest.raises(NoFigure):
        the_runs_backend({Path("b"): client, Path("c"): client})


def test_each_variant_is_counted_on_a_database_of_its_own_schema():
    """The head's scripts share db_parts' database; a variant that changes the schema gets its own, one per
    schema. Bugs caught: a schema variant counted on the head's tables (its change never made), two
    schemas on one database, a misspelt variant counted as nothing."""
    on = databases(("as is", "naive twin", "no lookup", "rules in functions", "2 key partitions"))

    assert on["as is"] == on["naive twin"] == on["no lookup"] == db_parts.DATABASE
    assert len({on["as is"], on["rules in functions"], on["2 key partitions"]}) == 3
    with pytest.raises(NoFigure, match="no such variant"):
        databases(("as is", "no such part"))
