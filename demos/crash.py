"""`python -m demos.crash --point <point> [--mode retry|worker]`: one crash, told step by step.

Starts the whole system (see demos.system), kills the API at the named point
while it handles one payment, shows what survived, resumes, and proves the
payment happened exactly once. Exit status 0 on PASS, 1 on FAIL. At the end
it links to the payment's page in the operator console, and keeps the system
up while a person looks: until Enter at a terminal, else for DEMO_KEEP_SECONDS
(default 0: it stops at once, and says how to keep it up).
`payments crash-points --explain` lists the points; docs/reference/client.md has a sample.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from enum import Enum
from pathlib import Path

import typer

from app.payments.crash_points import POINTS
from demos.story import on_request_path, run_point, terminal
from demos.system import System, session
from devtools.run import print_console_link

console = terminal()


class Mode(str, Enum):
    retry = "retry"
    worker = "worker"


def main(
    point: str = typer.Option(..., "--point", help="A crash point; `payments crash-points --explain` lists them."),
    mode: Mode = typer.Option(Mode.retry, "--mode", help="retry: the client retries; worker: the recovery worker."),
) -> None:
    """Kill the API between two phases of a payment, then watch it complete exactly once."""
    if point not in POINTS:
        console.print(f"[red]unknown crash point {point!r}[/]; the points are:")
        for name, meaning in POINTS.items():
            console.print(f"  [bold]{name:26}[/] {meaning}")
        raise typer.Exit(2)
    if not on_request_path(point):
        console.print(f"[yellow]{point}[/] is not on the payment request path ({POINTS[point]}); "
                      "this demo crashes the API while it handles a payment, so it cannot reach it.")
        raise typer.Exit(2)
    keep_seconds = demo_keep_seconds()
    with session(console, System()) as system:
        outcome = run_point(system, point, mode.value, console, Path(tempfile.mkdtemp(prefix="client-")) / "store.json")
        show_in_console(system, outcome, keep_seconds)
    if outcome.passed:
        console.print(f"[bold green]PASS[/] {point} ({mode.value}): one payment, money moved exactly once, "
                      f"replay byte-identical ({outcome.seconds:.1f} s)")
    else:
        console.print(f"[bold red]FAIL[/] {point} ({mode.value}): see the checks above")
        raise typer.Exit(1)


def demo_keep_seconds() -> float:
    """DEMO_KEEP_SECONDS: how long the system stays up after the demo when no terminal waits for Enter (default 0)."""
    value = os.environ.get("DEMO_KEEP_SECONDS", "0")
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 86400:
        console.print(f"[red]DEMO_KEEP_SECONDS must be a number of seconds from 0 to 86400, not {value!r}[/]")
        raise typer.Exit(2)
    return seconds


def show_in_console(system: System, outcome, keep_seconds: float = 0) -> None:
    """The crashed payment's page in the operator console, and the system kept up while a person looks at it:
    until Enter at a terminal, else for `keep_seconds` (Ctrl-C or SIGTERM sooner)."""
    payment = outcome.final.payment if outcome.final else None
    if payment is None or outcome.api_url is None:
        return
    console.print("\nThe crashed payment in the operator console (its timeline shows the crash and the takeover):")
    print_console_link(console, outcome.api_url, system.operator_token, f"/console/payments/{payment['id']}")
    if sys.stdin.isatty():
        console.input("\n[bold]The system stays up while you look. Press Enter to stop it.[/] ")
    elif keep_seconds > 0:
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + keep_seconds))
        console.print(f"\n[bold]The system stays up for {keep_seconds:g} s (DEMO_KEEP_SECONDS), until {until}, "
                      "while you look[/]; Ctrl-C stops it sooner.")
        # A polite kill ends the wait as Ctrl-C does, so the system is still stopped cleanly.
        previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
        try:
            time.sleep(keep_seconds)  # the point is to wait: a person is reading the page
        except KeyboardInterrupt:
            console.print("stopping")
        finally:
            signal.signal(signal.SIGTERM, previous)
    else:
        console.print("[dim](no terminal to wait on: the system stops now, and the link with it; "
                      "DEMO_KEEP_SECONDS=600 keeps it up for 10 minutes)[/]")


if __name__ == "__main__":
    typer.run(main)
