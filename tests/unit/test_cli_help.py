"""`payments --help` read through a pipe: whole lines, no `<bool>` beside a flag, every loop of the worker named.

Run for real, with no terminal (stdout is a pipe) and no COLUMNS, as a log,
`less` or a script would read it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PAYMENTS = str(Path(sys.executable).parent / "payments")


def _help(*command: str) -> str:
    result = subprocess.run([PAYMENTS, *command, "--help"], env={"PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result
    return result.stdout


def test_help_without_a_terminal_is_not_cut_at_80_columns_and_shows_no_type_beside_a_flag():
    said = _help()

    assert "<bool>" not in said
    # Longer than 80 columns with its box: cut there, it was split over two lines.
    assert "List reconciliation breaks: what could not be settled safely, for a person to look at." in said
    assert "<bool>" not in _help("keys", "reap")


def test_the_worker_help_names_its_four_loops():
    said = " ".join(_help("worker").split())

    for loop in ("crash recovery", "reconciliation", "webhooks", "key table upkeep"):
        assert loop in said, said
