"""The `naive-twin` command: serve THE NAIVE TWIN (naive_twin/app.py). For `make bench` and `make demo-naive-crash` only.

A program of its own, not a command of the service: the service knows
nothing of its counter-example. It is served the way `payments api` serves
the service (app/cli.py::serve: the same settings, server and bounds), with
no /metrics, so the bench compares the two flows and nothing else.
"""

from __future__ import annotations

import typer

cli = typer.Typer(add_completion=False)


@cli.command()
def naive_twin(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8010, help="Port to listen on."),
    workers: int = typer.Option(1, help="Worker processes (uvicorn)."),
) -> None:
    """Serve THE NAIVE TWIN: the same flow with no protection. For benchmarks and demos only."""
    from app.cli import serve

    serve("naive_twin.app:create_app", host, port, workers, metered=False)


def main() -> None:
    cli()
