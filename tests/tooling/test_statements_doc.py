"""docs/reference/statements.md shows exactly the statements the phases run ("what runs is what you read")."""

from __future__ import annotations

from devtools import statements


def test_the_statements_page_is_what_the_phases_run():
    """Fails when a phase's statement changes and the page was not made again (python -m devtools.statements)."""
    assert statements.PAGE.read_text() == statements.render()


def test_the_page_shows_every_phase_statement_with_its_fence_and_its_writes():
    page = statements.PAGE.read_text()
    for _, _, statement in statements.sections():
        assert statement.sql in page
        assert statement.sql.startswith("WITH fence AS (")
    assert len(statements.sections()) == 10
