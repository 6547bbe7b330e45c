"""`make demo-crash` without a terminal: its console link stays alive for DEMO_KEEP_SECONDS, or it says how to keep it.

Without a terminal there is no Enter to wait for: the demo used to stop the
system at once, right after printing a link into it.
"""

from __future__ import annotations

import io
import time
from types import SimpleNamespace

import pytest
import typer

from demos import crash

OUTCOME = SimpleNamespace(final=SimpleNamespace(payment={"id": "0f8fad5b-d9cb-469f-a165-70867728950e"}),
                          api_url="http://127.0.0.1:1")
SYSTEM = SimpleNamespace(operator_token="t" * 32)


def test_without_a_terminal_the_system_stays_up_for_demo_keep_seconds(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO())  # not a terminal
    monkeypatch.setenv("DEMO_KEEP_SECONDS", "1.5")

    started = time.monotonic()
    crash.show_in_console(SYSTEM, OUTCOME, crash.demo_keep_seconds())

    assert time.monotonic() - started >= 1.5
    said = " ".join(capsys.readouterr().out.split())
    assert "/console/login?" in said
    assert "The system stays up for 1.5 s (DEMO_KEEP_SECONDS)" in said


def test_without_a_terminal_and_no_demo_keep_seconds_it_says_how_to_keep_the_link_alive(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO())
    monkeypatch.delenv("DEMO_KEEP_SECONDS", raising=False)

    crash.show_in_console(SYSTEM, OUTCOME, crash.demo_keep_seconds())

    said = " ".join(capsys.readouterr().out.split())
    assert "the system stops now, and the link with it; DEMO_KEEP_SECONDS=600 keeps it up for 10 minutes" in said


@pytest.mark.parametrize("value", ["soon", "-1", "1e9"])
def test_a_demo_keep_seconds_that_is_not_a_number_of_seconds_is_refused(monkeypatch, value):
    monkeypatch.setenv("DEMO_KEEP_SECONDS", value)

    with pytest.raises(typer.Exit) as refused:
        crash.demo_keep_seconds()
    assert refused.value.exit_code == 2
