"""Every code path and test name the docs cite exists.

The docs teach by pointing at the code: `app/payments/runner.py::drive`,
`runner.py::_call`, `api::test_a_retry_replays_the_stored_response_byte_for_byte`,
links such as `[phases.py](../app/payments/phases.py)`. A rename that forgets
a page leaves a reader hunting for something that is not there. These tests
read every Markdown page and fail on the first reference that no longer
resolves. A link to a heading (`outbox-inbox.md#rotating-a-signing-secret`),
from a page or from the code, must find that heading: a heading reworded
leaves its old links pointing at the top of the page.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SOURCE_DIRS = ("app", "fake_rails", "naive_twin", "redis_twin", "payments_client", "demos", "bench", "tests", "migrations")

CODE_REF = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.py)::([A-Za-z_][\w.]*)")
TEST_NAME = re.compile(r"\b(test_[a-z0-9_]+)\b(?!\.py)")
LINK = re.compile(r"\]\((?!https?:|#|mailto:)([^)#\s]+)(?:#[^)]*)?\)")
# A link to a heading in a page: `](page.md#heading)`, or `](#heading)` in the same page.
PAGE_ANCHOR = re.compile(r"\]\((?!https?:|mailto:)([^)#\s]*)#([^)\s]+)\)")
# The same named from the code: `docs/outbox-inbox.md#egress-where-the-dispatcher-may-connect`.
CODE_ANCHOR = re.compile(r"((?:[\w.-]+/)*[\w.-]+\.md)#([a-z0-9_-]+)")


@cache
def python_files() -> list[Path]:
    return [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py") if ".venv" not in p.parts]


@cache
def defined_names(path: Path) -> frozenset[str]:
    """Top-level functions, classes and assignments, and Class.member for class bodies."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()

    def add_targets(node: ast.AST, prefix: str) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for target in targets:
            if isinstance(target, ast.Name):
                names.add(prefix + target.id)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names.add(node.name)
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(f"{node.name}.{member.name}")
                elif isinstance(member, (ast.Assign, ast.AnnAssign)):
                    add_targets(member, f"{node.name}.")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            add_targets(node, "")
    return frozenset(names)


@cache
def defined_test_names() -> frozenset[str]:
    return frozenset(
        name for p in (ROOT / "tests").rglob("test_*.py") for name in defined_names(p) if name.startswith("test_")
    )


def candidates(cited: str) -> list[Path]:
    """The files a citation may mean: a path from the root, or a file name found anywhere in the code."""
    if "/" in cited:
        return [p for p in (ROOT / cited, ROOT / "app" / cited, ROOT / "tests" / cited) if p.is_file()]
    return [p for p in python_files() if p.name == cited]


def citations(pattern: re.Pattern) -> list[tuple[str, tuple[str, ...]]]:
    return [
        (f"{page.relative_to(ROOT)}", match.groups())
        for page in PAGES
        for match in pattern.finditer(page.read_text())
    ]


def test_every_cited_code_path_exists():
    missing = sorted(
        {
            (page, f"{path}::{name}")
            for page, (path, name) in citations(CODE_REF)
            if not any(name.rstrip(".") in defined_names(f) for f in candidates(path))
        }
    )
    assert missing == [], missing


def test_every_cited_test_name_exists():
    modules = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    missing = sorted(
        {(page, name) for page, (name,) in citations(TEST_NAME) if name not in defined_test_names() | modules}
    )
    assert missing == [], missing


def test_every_relative_link_points_at_a_file():
    broken = []
    for page in PAGES:
        for match in LINK.finditer(page.read_text()):
            target = (page.parent / match.group(1)).resolve()
            if not target.exists():
                broken.append((str(page.relative_to(ROOT)), match.group(1)))
    assert broken == [], broken


def heading_id(heading: str) -> str:
    """The id a Markdown renderer (GitHub's) gives a heading: its text, lower case, punctuation dropped, spaces as -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def heading_ids(page: Path) -> frozenset[str]:
    """Every heading's id in a page; a repeated one gets -1, -2, ... as the renderer numbers them."""
    ids: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        heading = None if in_code else re.match(r"#{1,6} (.+)", line)
        if heading:
            base = heading_id(heading.group(1))
            ids.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return frozenset(ids)


def test_every_link_to_a_heading_finds_it():
    broken = []
    for page in PAGES:
        for match in PAGE_ANCHOR.finditer(page.read_text()):
            target = (page.parent / match.group(1)).resolve() if match.group(1) else page
            if target.suffix == ".md" and target.is_file() and match.group(2) not in heading_ids(target):
                broken.append((str(page.relative_to(ROOT)), match.group(0)))
    sources = [*python_files(), *(ROOT / "devtools").rglob("*.py"), ROOT / "Makefile"]
    for source in (s for s in sources if s != Path(__file__)):  # not this module's own examples
        for match in CODE_ANCHOR.finditer(source.read_text()):
            target = ROOT / match.group(1)
            if not target.is_file() or match.group(2) not in heading_ids(target):
                broken.append((str(source.relative_to(ROOT)), match.group(0)))
    assert broken == [], broken
