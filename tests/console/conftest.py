"""The console's tests: an API process with the console switched on, beside the session's two (which have it off)."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from devtools.processes import Process
from devtools.system import System

# Made up for the run: the console opens with this and nothing else.
OPERATOR_TOKEN = secrets.token_urlsafe(32)


@pytest.fixture(autouse=True)
async def _fresh_state(clean) -> None:
    """Every test here starts from empty tables and empty fault plans."""


@pytest.fixture(scope="module")
def console_api(system: System, stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """An API process with OPERATOR_TOKEN set (and one attempt per payment, so a fault parks at once)."""
    scoped = system.scope(tmp_path_factory.mktemp("console"))
    try:
        yield scoped.start_api("api-console", OPERATOR_TOKEN=OPERATOR_TOKEN, MAX_ATTEMPTS="1")
    finally:
        scoped.stop()
