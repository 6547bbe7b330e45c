"""The bench's page images, by relation: which pages a payment's full-page images are of.

`bench.costs.tally` reads pg_waldump's lines; these are lines as
PostgreSQL 18's pg_waldump prints them, the service database being 16385
and the fakes' 16384.
"""

from __future__ import annotations

from bench.costs import tally

SERVICE = 16385
TABLES = {16407: "payment", 16434: "payment", 16442: "idempotency_key", 16479: "ledger_entry"}
RELATIONS = {16407: "payment", 16434: "payment_end_to_end_reference_key", 16442: "idempotency_key",
             16479: "ledger_entry"}


def record(rmgr: str, size: int, xid: int, desc: str) -> str:
    return (f"rmgr: {rmgr:<11} len (rec/tot):     53/{size:>6}, tx: {xid:>10}, lsn: 0/41001B60, "
            f"prev 0/41001B18, desc: {desc}")


def commit(xid: int) -> str:
    return record("Transaction", 34, xid, "COMMIT 2026-12-04 22:48:56.124931 UTC")


LINES = [
    # A payment's transaction: a heap insert with its page's image, an index
    # insert with one, and one without.
    record("Heap", 7010, 100, "INSERT off: 59, flags: 0x00, blkref #0: rel 1663/16385/16479 blk 5061 FPW"),
    record("Btree", 4305, 100, "INSERT_LEAF off: 23, blkref #0: rel 1663/16385/16434 blk 113 FPW"),
    record("Btree", 64, 100, "INSERT_LEAF off: 24, blkref #0: rel 1663/16385/16434 blk 114"),
    # A split: three blocks, two of them with an image, each half the record.
    record("Btree", 12546, 100, "SPLIT_L level: 0, firstrightoff: 68, newitemoff: 11, postingoff: 0, "
                                "blkref #0: rel 1663/16385/16434 blk 504 FPW, blkref #1: rel 1663/16385/16434 "
                                "blk 874, blkref #2: rel 1663/16385/16407 blk 213 FPW"),
    # A hint bit's image of a free space map, in the same transaction.
    record("XLOG", 8241, 100, "FPI_FOR_HINT , blkref #0: rel 1663/16385/16442 fork fsm blk 4 FPW"),
    commit(100),
    # The fakes' database: not the service's.
    record("Btree", 7529, 101, "INSERT_LEAF off: 30, blkref #0: rel 1663/16384/16434 blk 364 FPW"),
    commit(101),
    # A transaction of ours that never committed: not a payment's.
    record("Heap", 6000, 102, "INSERT off: 2, flags: 0x00, blkref #0: rel 1663/16385/16407 blk 7 FPW"),
]


def test_each_image_is_counted_under_its_own_relation_an_index_apart_from_its_table():
    counted = tally(LINES, SERVICE, TABLES, RELATIONS)

    assert counted.transactions == 1
    assert counted.fpi_by_relation == {
        "ledger_entry": 7010,
        "payment_end_to_end_reference_key": 4305 + 6273,
        "payment": 6273,
        "idempotency_key (fsm)": 8241,
    }
    assert counted.fpi_bytes == 7010 + 4305 + 12546 + 8241, "the images' records, each once"
    assert counted.wal_bytes == 7010 + 4305 + 64 + 12546 + 8241 + 34


def test_a_file_the_bench_does_not_know_is_named_by_its_number():
    counted = tally([record("Heap", 7000, 7, "INSERT off: 1, blkref #0: rel 1663/16385/99999 blk 1 FPW"), commit(7)],
                    SERVICE, TABLES, RELATIONS)

    assert counted.fpi_by_relation == {"file 99999": 7000}
