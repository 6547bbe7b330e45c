"""CONSOLE_SESSION_SECONDS: twelve hours unless set, and bounded (app/config.py::Settings).

Under a minute a person is logged out while reading a page; over 30 days a
forgotten browser stays logged in to every client's payments for a month.
Both refuse start-up rather than being quietly clamped.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.config import Settings

ANY_POSTGRES = "postgresql://nobody@127.0.0.1:1/nothing"  # never reached


def test_a_console_session_lasts_twelve_hours_unless_set():
    assert Settings(database_url=ANY_POSTGRES).console_session_seconds == 12 * 3600
    assert Settings(database_url=ANY_POSTGRES, console_session_seconds=600).console_session_seconds == 600


@pytest.mark.parametrize("seconds", [0, 59, 30 * 24 * 3600 + 1])
def test_a_console_session_length_out_of_bounds_is_refused(seconds):
    with pytest.raises(ValidationError, match="console_session_seconds"):
        Settings(database_url=ANY_POSTGRES, console_session_seconds=seconds)
