"""The `redis-twin` command: serve THE REDIS TWIN (redis_twin/app.py). For `make demo-redis-window` only.

A program of its own, as the naive twin is (naive_twin/cli.py): the service
knows nothing of it. Served the way `payments api` serves the service
(app/cli.py::serve), with no /metrics. It needs REDIS_URL; redis_twin/server.py
starts a Redis for it.
"""

from __future__ import annotations

import typer

cli = typer.Typer(add_completion=False)


@cli.command()
def redis_twin(
    host: str = typer.Option("127.0.0.1", help="Interface to listen on."),
    port: int = typer.Option(8011, help="Port to listen on."),
) -> None:
    """Serve THE REDIS TWIN: the naive flow behind keys in Redis, unsafe. For demos only."""
    from app.cli import serve
    from redis_twin.app import redis_url

    redis_url()  # refuse to start here, with a clear message, not in the worker
    serve("redis_twin.app:create_app", host, port, 1, metered=False)


def main() -> None:
    cli()
