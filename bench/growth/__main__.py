"""`python -m bench.growth`: see bench/growth/run.py."""

from bench.growth.run import cli

cli()
