"""Each hot-path statement is written out whole in app/payments/sql.py; these checks keep the copies honest.

A reader sees every phase's statement as it runs, fence included, so the two
fences (advance, finish) and the claim appear several times. Written-out
copies can drift: one edited, the others not. These tests fail on the first
word that differs from the canonical text in app/idempotency/store.py, and
on a business write that does not hang off the fence.
"""

from __future__ import annotations

import re

import pytest

from app.idempotency import store
from app.outbox import events
from app.payments import sql


def words(statement: str) -> str:
    """The statement without comments, with all whitespace made single spaces."""
    statement = re.sub(r"--[^\n]*", "", statement)
    return re.sub(r"\s+", " ", statement).replace("( ", "(").replace(" )", ")").replace(" ,", ",").strip()


def first_cte(statement: str) -> str:
    """The body of the statement's first CTE (`WITH name AS (...)`), by matching parentheses."""
    text = words(statement)
    start = text.index(" AS (") + len(" AS (")
    depth = 1
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    raise AssertionError("unbalanced statement")


@pytest.mark.parametrize("name, fence", sorted(sql.FENCES.items()))
def test_each_statement_begins_with_the_fence_it_names_word_for_word(name, fence):
    assert first_cte(getattr(sql, name).text) == words(getattr(store, fence))


@pytest.mark.parametrize("name", sorted(n for n, f in sql.FENCES.items() if f != "CLAIM_SQL"))
def test_every_business_write_hangs_off_the_fence(name):
    text = words(getattr(sql, name).text)
    assert "UPDATE payment SET" in text and "FROM fence WHERE payment.id = fence.payment_id" in text
    if "INSERT INTO ledger_entry" in text:
        assert "FROM updated, unnest(" in text, "the ledger legs are written only for the payment the fence let through"


def test_the_ledger_legs_are_written_the_same_way_by_every_posting_phase():
    posted = {
        re.split(r"\), emitted AS |\) SELECT \* FROM updated", words(getattr(sql, n).text).split("posted AS ")[1])[0]
        for n in sql.FENCES if "posted AS" in getattr(sql, n).text
    }
    assert len(posted) == 1


def test_every_hot_path_statement_is_listed_with_its_fence():
    statements = {name for name, value in vars(sql).items() if hasattr(value, "text") and name.isupper()}
    assert statements == set(sql.FENCES)


@pytest.mark.parametrize("name", sql.EMITS)
def test_each_finishing_statement_writes_its_event_from_the_fence_word_for_word(name):
    text = words(getattr(sql, name).text)
    emitted = text[text.index("emitted AS ("):text.rindex(" SELECT * FROM updated")]
    assert emitted == words(events.EMIT_SQL)
    assert "FROM fence RETURNING id, client_id" in emitted, "no fence row, no event"


def test_only_the_finishing_statements_write_events():
    writing = {name for name in sql.FENCES if "INSERT INTO event" in getattr(sql, name).text}
    assert writing == set(sql.EMITS)
