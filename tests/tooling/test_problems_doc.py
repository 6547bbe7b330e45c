"""docs/reference/problems.md lists exactly the problem types the API answers with, each with its status.

A client's developer writes the handling of each `type` from that page. A
type the code answers with and the page leaves out is one they meet for the
first time in production; a row the code no longer uses is handling written
for nothing. So the table is checked against app/problems.py's catalogue,
slug by slug and status by status.
"""

from __future__ import annotations

import re
from pathlib import Path

from app.problems import CATALOGUE

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "problems.md"
ROW = re.compile(r"^\| `/problems/([a-z-]+)` \| (\d{3}) \|", re.MULTILINE)


def documented() -> dict[str, int]:
    rows = ROW.findall(PAGE.read_text())
    table = {slug: int(status) for slug, status in rows}
    assert len(table) == len(rows), "a problem type is listed twice"
    return table


def test_the_problems_page_lists_exactly_the_catalogue_with_each_status():
    assert documented() == {slug: t.status for slug, t in CATALOGUE.items()}
