"""THE REDIS TWIN: a deliberately unsafe payment service, for comparison only.

Never copy this. It is the naive twin's flow (naive_twin/) behind an
idempotency store in Redis, as many services build it, so that
`make demo-redis-window` can show the double charge that keeping the keys
and the payments in two stores allows: the payment commits in PostgreSQL,
the process dies before Redis hears that it did, and the retry pays again.
"""
