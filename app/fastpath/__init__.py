"""Optimisations, behind one door. The service is correct without each of them.

Nothing on a request's path imports this package: app/main.py installs it
when REPLAY_SHORTCUT is on (the default), and the routes, their dependencies
and the service read as if it were not there. With REPLAY_SHORTCUT=false
every answer is the same, byte for byte; the tests run one API each way
(tests/conftest.py). What each part saves, and the measurement
(docs/reference/performance.md#the-optimisations-behind-one-door):

- replay_shortcut.py: a retry of a finished payment is answered before
  FastAPI runs, saving the framework's routing, dependency solving and
  SQLAlchemy on the commonest retry; a request it passes on takes its read
  with it, so a new payment still reads once.
- lookup_pool.py: that one read runs on asyncpg itself, from a pool of its
  own that sends no reset query when a connection goes back, saving
  SQLAlchemy's execution around it and a second round trip.

One more follows the same switch but lives beside the engine, because a
statement is sent there: app/db/driver.py sends each phase's lone statement
to asyncpg itself instead of through SQLAlchemy's execution (app/db/engine.py
turns it on with REPLAY_SHORTCUT).

Two more are not on a request's path at all, and not switched by
REPLAY_SHORTCUT: app/cli.py::serve serves every process with them (the
naive twin's too: they are how a process is served, not how a payment is
made).

- reuse_port.py: with `--workers N`, on Linux, each worker process listens
  on a socket of its own on the one port, so the kernel spreads the
  connections over the workers instead of the first to wake taking them,
  and a worker over its share closes the excess after an answer; no worker
  idles while another is the bottleneck.
- frozen_start.py: what a process builds at start (its modules, the app)
  is frozen out of Python's cyclic garbage collector's walks.
"""
