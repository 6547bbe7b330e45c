"""Benchmarks of the payment path; `make bench` runs `bench.run`."""
