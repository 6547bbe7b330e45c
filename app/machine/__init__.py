"""The engine every operation runs on: declared recovery points, phases and calls, and the rules beneath them.

An operation (a payment, the refund that compensates a returned payout)
declares its machine in a module of its own (`declare.Machine`); the engine
(`engine.py`) drives any such machine with the same rules: the fence, the
lease, attempts and backoff, park and heal, release on shutdown, crash
points and log fields. `statements.py` builds each phase's single statement
from one fence fragment, the phase's own writes and one outbox fragment.
"""
