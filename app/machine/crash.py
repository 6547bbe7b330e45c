"""Dying on purpose at a named point, for crash tests and demos (the points: app/payments/crash_points.py).

A process started with `PAYMENTS_CRASH_AT=<point>` calls `os._exit` the first
time it reaches that point: no `finally` blocks, no connection clean-up, no
response, exactly what a SIGKILL or a power cut would leave. The point is
read from the environment once, at start-up; nothing in a request can
choose or trigger one.
"""

from __future__ import annotations

import os
import sys


def reached(configured: str | None, point: str) -> None:
    """Die here, at once and without clean-up, if this process was told to."""
    if configured == point:
        sys.stderr.write(f"PAYMENTS_CRASH_AT={point}: exiting now, as a crash would\n")
        sys.stderr.flush()
        os._exit(137)
