"""What the tooling tests that need a real server share: an empty database of their own."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from devtools import embedded_db


@pytest.fixture
def scratch(server_url: str) -> Iterator[str]:
    """An empty database on the tests' server, made for one test and dropped after it: its URL.

    One name per process: pytest-xdist's workers run side by side, and one
    worker's tests one after the other.
    """
    name = f"payments_tooling_scratch_{os.getpid()}"
    embedded_db.create_database(server_url, name, recreate=True)
    yield f"{server_url.rsplit('/', 1)[0]}/{name}"
    embedded_db.drop_database(server_url, name)
