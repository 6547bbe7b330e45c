"""What the service tells the people who run it: Prometheus metrics and structured logs.

A leaf every layer may import (pyproject.toml's import contracts): the API
counts requests and replays, the engine counts takeovers, releases and
parks, the rail clients time their calls, the worker reports its backlog,
and each of them logs through the same JSON lines that carry the payment
they are about. It imports nothing of the service's own: it is handed plain
values (a recovery point, an outcome class, a client id).
"""
