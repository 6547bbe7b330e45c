"""A DATABASE_URL holds a password: no message about it, however it is wrong, repeats it.

The commands run for real (as subprocesses); none of them reaches a database.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config import Settings, asyncpg_url, redacted_url

PAYMENTS = str(Path(sys.executable).parent / "payments")


def _payments(*args: str, database_url: str) -> tuple[int, str]:
    result = subprocess.run(
        [PAYMENTS, *args], env={"PATH": "/usr/bin:/bin", "DATABASE_URL": database_url},
        capture_output=True, text=True, timeout=120,
    )
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("url", ["mysql://user:s3cret@host/db", "user:s3cret@host/db", "s3cret"])
def test_a_url_that_is_not_postgresql_is_refused_without_repeating_it(url):
    with pytest.raises(ValueError) as raised:
        asyncpg_url(url)

    assert "not a PostgreSQL URL" in str(raised.value)
    assert "s3cret" not in str(raised.value)


def test_a_url_printed_for_a_person_has_its_password_hidden():
    assert redacted_url("postgresql://u:s3cret@db.example:5432/payments") == "postgresql://u:***@db.example:5432/payments"
    assert redacted_url("mysql://user:s3cret@host/db") == "(DATABASE_URL)"


def test_the_settings_refuse_such_a_url_without_printing_it():
    with pytest.raises(ValidationError) as raised:
        Settings(database_url="mysql://user:s3cret@host/db")

    assert "not a PostgreSQL URL" in str(raised.value)
    assert "s3cret" not in str(raised.value)  # pydantic prints the input value unless told not to


@pytest.mark.parametrize("command", [["api", "--port", "1"], ["migrate"]])
def test_a_mistyped_database_url_stops_the_command_with_a_message_that_hides_the_password(command):
    code, output = _payments(*command, database_url="mysql://user:s3cret@host/db")

    assert code == 2, output
    assert "DATABASE_URL is not a PostgreSQL URL (mysql://...)" in output
    assert "s3cret" not in output and "Traceback" not in output


def test_an_unreachable_database_is_named_without_its_password():
    code, output = _payments("migrate", database_url="postgresql://u:s3cret@127.0.0.1:1/x")

    assert code == 2, output  # README.md#configuration: a database that cannot be used refuses with exit 2
    assert "cannot migrate: cannot reach the database at postgresql://u:***@127.0.0.1:1/x" in output
    assert "s3cret" not in output
