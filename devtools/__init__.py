"""Development tooling, not the payment path.

What `make run`, the tests, the demos and the bench share to start the system
on one machine: an embedded PostgreSQL (embedded_db), the process harness
(processes), the system's parts started in order and stopped in reverse
(system), `payments run` itself (run), and the payment-body factory (bodies);
nginx in front of several API replicas (nginx), `make cluster` (cluster),
and the chaos soak (soak) with its three-way audit (audit).
The service (app/) never imports it; only `payments run` does, inside the
command.
"""
