"""A crash point that does not exist refuses start-up, for every command that can reach one.

PAYMENTS_CRASH_AT kills a process at a named point (app/payments/crash_points.py).
A misspelt name would never match, so a crash test or a demo would silently
not crash, and prove nothing. The settings cannot check the name themselves
(they sit below the payment path and name none of its points), so the
commands check it as they start (app/cli.py::_settings).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PAYMENTS = str(Path(sys.executable).parent / "payments")
ANY_POSTGRES = "postgresql://nobody@127.0.0.1:1/nothing"  # never reached: refused before


@pytest.mark.parametrize("command", [["api", "--port", "1"], ["worker"], ["reconcile"]])
def test_an_unknown_crash_point_refuses_start_up_naming_the_setting(command):
    result = subprocess.run(
        [PAYMENTS, *command],
        env={"PATH": "/usr/bin:/bin", "DATABASE_URL": ANY_POSTGRES, "PAYMENTS_CRASH_AT": "after-call-EXT9"},
        capture_output=True, text=True, timeout=60,
    )

    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "PAYMENTS_CRASH_AT" in output and "unknown crash point 'after-call-EXT9'" in output
    assert "Traceback" not in output
