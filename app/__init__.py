"""A reference payments service that moves money exactly once.

A request enters through `app.api`, is admitted by the idempotency key protocol
(`app.idempotency`), and is driven through the phases its machine declares
(`app.payments.payment`) by the engine (`app.machine.engine`), which calls
the PSP and the rail through `app.rails`.
`app.db.transaction` is the one place that opens and commits transactions.
"""
