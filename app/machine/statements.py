"""Each phase's single statement, put together from one fence, the phase's own writes and one outbox.

A phase on the hot path is one SQL statement: a chain of data-modifying CTEs
that PostgreSQL runs, and commits, as one transaction. Every such statement
has the same shape, so only the middle is written by the phase:

    fence     the key row's UPDATE (or, in a start phase, the claim), which
              names our lease token: no row comes back if the lease was
              taken over (app/idempotency/key_table.py: ADVANCE_SQL, FINISH_SQL)
    ...       the phase's own writes, each reading FROM the fence, or from a
              write that does (the payment as `updated`, the ledger legs)
    emitted   the event a client must hear about (app/outbox/events.py:
              EMIT_SQL), only when the phase finishes

So a stale owner's statement changes no row at all, exactly as a rolled-back
transaction would, and the engine raises LeaseLost. The fence comes first,
so the key row is locked before the payment row in every phase: two
attempts can never deadlock each other.

docs/reference/statements.md shows every phase's statement whole, rendered
from these builders (tests/tooling/test_statements_doc.py keeps it true).
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncConnection

from app.db import driver
from app.idempotency.key_table import ADVANCE_SQL, CLAIM_SQL, FINISH_SQL
from app.outbox.events import EMIT_SQL


@dataclass(frozen=True)
class Statement:
    """One phase's statement: a fence, the phase's writes (CTEs, in order), and what it returns."""

    fence: str  # "claim", "advance" or "finish"
    writes: tuple[tuple[str, str], ...]  # (CTE name, its SQL)
    returning: str
    emits: bool = True  # a finish emits its event, unless it refuses the request (no event)

    @property
    def ctes(self) -> tuple[tuple[str, str], ...]:
        """Every CTE in order: the fence, the phase's writes, then the outbox when it finishes."""
        outbox = _OUTBOX if self.fence == "finish" and self.emits else ()
        return (("fence", _FENCES[self.fence]), *self.writes, *outbox)

    @cached_property
    def sql(self) -> str:
        parts = [f"{name} AS (\n{_indent(body)}\n)" for name, body in self.ctes]
        return "WITH " + ", ".join(parts) + "\n" + self.returning

    @cached_property
    def clause(self) -> TextClause:
        return text(self.sql)

    @cached_property
    def positional(self) -> driver.Positional:
        return driver.Positional.of(self.clause)

    async def fetch_one(self, conn: AsyncConnection, params: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Run this statement on `conn`: the one row it returns, or None (app/db/driver.py says how)."""
        return await driver.fetch_one(conn, self.clause, self.positional, params)


def claim(returning: str, **writes: str) -> Statement:
    """A start phase's statement: the claim of the key is its fence (no row if the key exists)."""
    return Statement("claim", tuple(writes.items()), returning)


def advance(**writes: str) -> Statement:
    """A statement that moves the operation to its next SENT point: the fence, then `writes`."""
    return Statement("advance", tuple(writes.items()), "SELECT * FROM updated")


def finish(**writes: str) -> Statement:
    """A statement that finishes the operation, stores its response and emits its event."""
    return Statement("finish", tuple(writes.items()), "SELECT * FROM updated")


def refusal() -> Statement:
    """A statement that finishes the operation with a refusal stored as its response, and emits nothing.

    For a request refused after its key was claimed (a refund larger than
    what is left): the refusal is that request's result, replayed to its
    retries, but no business row changed, so no client needs an event.
    """
    return Statement("finish", (), "SELECT * FROM fence", emits=False)


def reads_of(body: str) -> set[str]:
    """The relations a CTE reads from (its FROM and JOIN clauses): how a test sees what it hangs off."""
    return set(re.findall(r"\b(?:FROM|JOIN)\s+(\w+)", body))


def _indent(body: str) -> str:
    return textwrap.indent(textwrap.dedent(body).strip("\n"), "    ")


def _cte_of(fragment: str) -> tuple[tuple[str, str], ...]:
    """`name AS (...), name AS (...)` as (name, body) pairs; the outbox fragment is written that way."""
    found = re.findall(r"(\w+) AS \((.*?)\n    \)", fragment, flags=re.S)
    return tuple((name, body) for name, body in found)


_FENCES = {"claim": CLAIM_SQL, "advance": ADVANCE_SQL, "finish": FINISH_SQL}
_OUTBOX = _cte_of(EMIT_SQL)
