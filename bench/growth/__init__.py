"""`make bench-growth`: does the service stay as fast when the key table holds 10 million keys?

The key table is the busiest table the service owns: every payment claims a
row in it, and every retry reads it. Its daily partitions (migration 0006)
are there so that a large table costs no more per request than a small one,
and so that old keys leave by dropping a day instead of deleting rows. This
bench measures both claims, on this machine, in one run:

    layout.py    the retention window's days, and the daily partitions they need
    preload.py   millions of realistic key rows and payments, written inside
                 PostgreSQL (INSERT ... SELECT generate_series), not through the API
    reaping.py   one day dropped by the project's own reaper vs the same rows
                 DELETEd from an identical day: time, WAL, what VACUUM leaves
    run.py       the side-by-side API runs (an empty database against the
                 preloaded one, alternating), the checks, the report, the JSON

`python -m bench.growth --help` for the parameters.
"""
