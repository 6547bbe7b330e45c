"""Development tooling, not the payment path.

What `make run`, the tests, the demos and the bench share to start the system
on one machine: an embedded PostgreSQL (embedded_db), the process harness
(processes), the system's parts started in order and stopped in reverse
(system), `make run` itself (run), and the payment-body factory (bodies);
nginx in front of several API replicas (nginx), `make cluster` (cluster),
and the chaos soak (soak) with its three-way audit (audit).
It stands above the service: it imports app/ (the admin operations of
app/admin.py, the settings), and nothing in app/ imports it or starts it.
"""
