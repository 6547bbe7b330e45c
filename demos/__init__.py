"""Kill-between-phases demos, for a person at a terminal.

    python -m demos.crash --point after-call-EXT1 [--mode retry|worker]
    python -m demos.crash_all [--mode retry|worker]
    python -m demos.client_bug

(or `make demo-crash POINT=...`, `make demo-crash-all`, `make demo-client-bug`).
Each starts real processes on free ports against a database of its own,
`payments_demo`, re-created on every run, and stops them all at the end.
docs/reference/client.md explains what they show.
"""
