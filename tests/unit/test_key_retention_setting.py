"""KEY_RETENTION_HOURS shorter than a client may retry, or than the rail may book, refuses start-up.

A key reaped while its client still retries it turns the retry into a new
request: refused as a duplicate reference, but no longer answered with the
payment's own response. A parked payout's key must outlive the statements
that can still book it. So the setting has a floor, checked by every command
as it starts (app/config.py::Settings), with a message that names it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

import payments_client
from app.config import CLIENT_RETRY_WINDOW_HOURS, Settings

PAYMENTS = str(Path(sys.executable).parent / "payments")
ANY_POSTGRES = "postgresql://nobody@127.0.0.1:1/nothing"  # never reached: refused before


def test_the_default_keeps_keys_at_least_72_hours_and_outlasts_both_floors():
    settings = Settings(database_url=ANY_POSTGRES)
    assert settings.key_retention_hours >= 72
    assert settings.key_retention_hours >= CLIENT_RETRY_WINDOW_HOURS
    assert settings.key_retention_hours >= 24 * settings.reconcile_booking_days


def test_the_service_and_the_shipped_client_state_the_same_retry_window():
    assert payments_client.RETRY_WINDOW_HOURS == CLIENT_RETRY_WINDOW_HOURS


@pytest.mark.parametrize(
    "settings, floor",
    [({"key_retention_hours": 12}, 72), ({"key_retention_hours": 96, "reconcile_booking_days": 5}, 120)],
)
def test_a_retention_below_the_retry_window_or_the_booking_horizon_is_refused(settings, floor):
    with pytest.raises(ValidationError, match=f"keep keys at least {floor} h"):
        Settings(database_url=ANY_POSTGRES, **settings)


@pytest.mark.parametrize("command", [["api", "--port", "1"], ["worker"], ["keys", "reap"]])
def test_a_short_retention_refuses_start_up_naming_the_setting(command):
    result = subprocess.run(
        [PAYMENTS, *command],
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": ANY_POSTGRES, "KEY_RETENTION_HOURS": "23"},
        capture_output=True, text=True, timeout=60,
    )

    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "KEY_RETENTION_HOURS" in output and "keep keys at least 72 h" in output
    assert "Traceback" not in output
