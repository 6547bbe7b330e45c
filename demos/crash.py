"""`python -m demos.crash --point <point> [--mode retry|worker]`: one crash, told step by step.

Starts the whole system (see demos.system), kills the API at the named point
while it handles one payment, shows what survived, resumes, and proves the
payment happened exactly once. Exit status 0 on PASS, 1 on FAIL.
`payments crash-points --explain` lists the points; docs/reference/client.md has a sample.
"""

from __future__ import annotations

import sys
import tempfile
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
    with session(console, System()) as system:
        outcome = run_point(system, point, mode.value, console, Path(tempfile.mkdtemp(prefix="client-")) / "store.json")
        show_in_console(system, outcome)
    if outcome.passed:
        console.print(f"[bold green]PASS[/] {point} ({mode.value}): one payment, money moved exactly once, "
                      f"replay byte-identical ({outcome.seconds:.1f} s)")
    else:
        console.print(f"[bold red]FAIL[/] {point} ({mode.value}): see the checks above")
        raise typer.Exit(1)


def show_in_console(system: System, outcome) -> None:
    """The crashed payment's page in the operator console; kept up until Enter when a person is watching."""
    payment = outcome.final.payment if outcome.final else None
    if payment is None or outcome.api_url is None:
        return
    console.print("\nThe crashed payment in the operator console (its timeline shows the crash and the takeover):")
    print_console_link(console, outcome.api_url, system.operator_token, f"/console/payments/{payment['id']}")
    if sys.stdin.isatty():
        console.input("\n[bold]The system stays up while you look. Press Enter to stop it.[/] ")
    else:
        console.print("[dim](no terminal to wait on: the system stops now, and the link with it)[/]")


if __name__ == "__main__":
    typer.run(main)
