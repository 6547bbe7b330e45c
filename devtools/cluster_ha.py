"""Development tooling, not the payment path: `make cluster-ha`, the system on a PostgreSQL that fails over by itself.

`python -m devtools.cluster_ha --replicas 3` (what `make cluster-ha` runs)
starts the HA database of devtools/ha.py (three etcd members, three
PostgreSQL nodes under Patroni in synchronous mode, HAProxy routing to the
primary, and a second HAProxy listener routing the console's page reads to a
standby: DATABASE_READ_URL), then what `make cluster` starts (devtools/cluster.py: API
replicas and two workers behind nginx, the fake PSP and rail) with
DATABASE_URL at HAProxy. The fakes' records are on the embedded server of
`make run` (database `ha_rails`), outside the cluster: other people's
systems do not fail over with ours. docs/failover.md is the runbook.

The cluster is made anew on every start, in .data/ha (its data are not
kept): its ports can change from one start to the next, and etcd's members
know each other by them.
"""

from __future__ import annotations

import os
from pathlib import Path

from rich.console import Console

from devtools import embedded_db
from devtools.cluster import parser, run_cluster
from devtools.ha import INSTALL_HINT, HaCluster, find_programs
from devtools.system import System, with_database


def main() -> None:
    cli = parser("python -m devtools.cluster_ha", __doc__.splitlines()[0])
    cli.add_argument("--base-port", type=int, default=int(os.environ.get("HA_BASE_PORT", "0")),
                     help="etcd, PostgreSQL, Patroni and HAProxy on the 15 ports from here (default: free ones)")
    args = cli.parse_args()
    console = Console()
    if find_programs() is None:
        console.print(f"[red]{INSTALL_HINT}[/]")
        raise SystemExit(2)
    ha = HaCluster(Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")).resolve() / "ha", base_port=args.base_port,
                   own_process_groups=True)  # stopped after the APIs and workers, not by the Ctrl-C at once

    def databases(system: System, console: Console) -> tuple[str, str]:
        with console.status("starting etcd, three PostgreSQL nodes under Patroni, and HAProxy"):
            system.defer(ha.stop)
            ha.start()
        embedded_db.create_database(ha.url, "payments")
        url = system.use_database(with_database(ha.url, "payments"))
        # The console's pages read on a standby; everything else on the primary.
        system.settings["DATABASE_READ_URL"] = with_database(ha.read_url, "payments")
        with console.status("starting the embedded PostgreSQL for the fakes' records"):
            system.start_postgres()
        records = system.create_database("ha_rails", fresh=False, migrate=False)
        return url, records

    def banner(console: Console) -> None:
        leader = ha.leader()
        console.print(f"HAProxy    postgresql://127.0.0.1:{ha.haproxy_port}   (DATABASE_URL: the primary, "
                      f"now {leader.name if leader else '?'}; stats http://127.0.0.1:{ha.stats_port}/)")
        console.print(f"HAProxy    postgresql://127.0.0.1:{ha.read_port}   (DATABASE_READ_URL: a standby, for the "
                      f"console's pages; the primary if none is up)")
        for node in ha.nodes:
            console.print(f"{node.name:<10} postgresql://127.0.0.1:{node.pg_port}   Patroni {node.rest}")
        console.print(f"etcd       {ha.etcd_hosts}   (logs: {ha.logs})")
        console.print(f"see the leader:  {ha.patronictl()} list")
        console.print(f"switch over:     {ha.patronictl()} switchover --force")

    run_cluster(args, console, databases, " on Patroni (3 nodes, synchronous)", banner)


if __name__ == "__main__":
    main()
