"""`python -m demos.crash_all [--mode retry|worker]`: every crash point, one summary table.

One system start for all of them; between points every table (but the
client) and both fault plans are emptied, so each story starts clean. Each
point's full story (the same one `demos.crash` tells) goes to a file; the
terminal gets one line per point and the summary. Exit status 1 if any FAILs.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from app.payments.crash_points import POINTS
from demos.crash import Mode
from demos.story import Outcome, on_request_path, run_point, terminal
from demos.system import System, session

console = terminal()


def main(
    mode: Mode = typer.Option(Mode.retry, "--mode", help="retry: the client retries; worker: the recovery worker."),
) -> None:
    """Crash the API at every named point in turn and check each payment happened exactly once."""
    system = System()
    outcomes: list[Outcome] = []
    stories = system.logs / "stories"
    with session(console, system):
        stories.mkdir()
        points = [p for p in POINTS if on_request_path(p)]
        console.print(f"[bold]{len(points)} crash points on the payment request path, resumed by {mode.value}[/] "
                      f"(each point's full story: {stories}/<point>.txt)")
        for point in POINTS:
            if not on_request_path(point):
                console.print(f"  [dim]skip {point:24} not on the payment request path[/]")
                continue
            system.reset()
            path = stories / f"{point}.txt"
            with path.open("w") as f, console.status(f"{point}: crash, look, resume, prove"):
                story = Console(file=f, width=110, no_color=True)
                outcome = run_point(system, point, mode.value, story, Path(system.logs) / "client-store.json")
            outcomes.append(outcome)
            mark = "[green]PASS[/]" if outcome.passed else "[red]FAIL[/]"
            console.print(f"  {mark} {point:24} {outcome.seconds:5.1f} s"
                          + (f"  [red]{outcome.error}[/]" if outcome.error else ""))
    console.print(summary(outcomes, mode.value))
    console.print(f"[dim]each point's story: {stories}[/]")
    failed = [o.point for o in outcomes if not o.passed]
    if failed:
        console.print(f"[bold red]FAIL[/] {len(failed)} of {len(outcomes)}: {', '.join(failed)}")
        raise typer.Exit(1)
    console.print(f"[bold green]PASS[/] all {len(outcomes)} crash points: every payment charged once, paid out "
                  "once (refunded once where the rail rejected it), ledger balanced, replay byte-identical")


def summary(outcomes: list[Outcome], mode: str) -> Table:
    table = Table(title=f"kill between phases, resumed by {mode}", title_justify="left", box=box.SIMPLE_HEAD,
                  collapse_padding=True, pad_edge=False)
    for column in ("crash point", "left\nbehind", "resumed by", "charges", "transfers", "refunds",
                   "ledger\nbalanced", "replay\nidentical", "result"):
        table.add_column(column, justify="right" if column in ("charges", "transfers", "refunds") else "left",
                         no_wrap=column == "crash point")
    for o in outcomes:
        s = o.final
        table.add_row(
            o.point, o.left, o.resumed_by,
            *((str(len(s.charges)), str(len(s.transfers)), str(len(s.refunds))) if s else ("-", "-", "-")),
            ("yes" if s.balanced and s.ledger else "[red]no[/]") if s else "-",
            "yes" if o.replay_identical else "[red]no[/]",
            "[green]PASS[/]" if o.passed else "[red]FAIL[/]",
        )
    return table


if __name__ == "__main__":
    typer.run(main)
