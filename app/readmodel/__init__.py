"""What the operator console reads: the key table, payments, the ledger, reconciliation.

Read-only and off the payment path: nothing here writes, and nothing on a
payment's path imports it. Each query is one SELECT run through
`app.db.transaction.read`, so no connection outlives it (the console calls
the PSP and the rail only after its reads are done).
"""
