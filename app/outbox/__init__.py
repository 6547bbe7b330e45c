"""The outbox: what a client must hear about, written with the decision, delivered after the commit.

Where it sits: beside the key table and the ledger, below the payment phases.
A phase that decides something a client must hear about (app/payments/phases.py,
app/payments/phases.py::indeterminate) writes an `event` row in the same
statement or transaction as the decision (events.py). Nothing is sent then:
the worker's dispatcher (app/workers/webhooks.py) later reads the events
behind its cursor, POSTs each one signed (delivery.py) with no transaction
held, and writes the attempt; a failed one becomes a delivery row it
retries. `GET /v1/events` reads the same rows (events.py::feed).
"""
