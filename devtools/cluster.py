"""Development tooling, not the payment path: `make cluster`, the system as several replicas behind nginx.

`python -m devtools.cluster --replicas 3` (what `make cluster REPLICAS=3`
runs) starts what `make run` starts (devtools/run.py: the embedded
PostgreSQL unless DATABASE_URL is set, its `payments` database, the demo
client, the fake PSP and rail) but with N `payments api` replicas on free
ports, two `payments worker` processes, and nginx in front of the replicas
(devtools/nginx.py) on the port given, so the curl it prints goes through
the balancer. It is built on devtools/system.py like everything else that
starts the system; nginx's configuration, pid and logs are in a directory
under .data/ (printed), rewritten on every start.

Two workers, because production runs more than one: both sweep for stranded
payments and both try to claim each reconciliation window, and the leases
and the durable tick make exactly one of them act on each.

Payment batches (docs/batches.md#a-three-node-cluster): a NATS JetStream
cluster of three nodes from the wheel (`--nats-nodes`; their client ports
from `--nats-port` up, cluster routes on loopback, each node's streams in
.data/nats-cluster/node-N), the batch streams kept on all three, and two
`payments consume` (`--consumers`) given every node's URL, so that a node's
death costs a leader election, never a stored row. `make run` starts one
node: a cluster is for seeing what a node's death does. With NATS_URL set,
that broker is used and none is started.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from devtools import nginx
from devtools.run import (
    STOP_HINT, demo_api_key, kept_operator_token, open_database, print_console_link, print_pay_once,
    refuse_taken_ports, supervise,
)
from devtools.system import System


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options `make cluster` and `make cluster-ha` share."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--replicas", type=int, default=3, help="API replicas behind nginx (default 3)")
    parser.add_argument("--workers", type=int, default=2, help="recovery workers (default 2)")
    parser.add_argument("--port", type=int, default=8000, help="nginx's port (default 8000)")
    parser.add_argument("--psp-port", type=int, default=8101)
    parser.add_argument("--rail-port", type=int, default=8102)
    return parser


def main() -> None:
    options = parser("python -m devtools.cluster", __doc__.splitlines()[0])
    options.add_argument("--nats-nodes", type=int, default=3,
                         help="NATS JetStream nodes in one cluster, for the batches (default 3; 0: none)")
    options.add_argument("--nats-port", type=int, default=8104,
                         help="the first node's client port; the next nodes' follow (default 8104)")
    options.add_argument("--consumers", type=int, default=2, help="`payments consume` processes (default 2)")
    args = options.parse_args()
    run_cluster(args, Console(), lambda system, console: (open_database(system, console), None))


def run_cluster(args: argparse.Namespace, console: Console,
                databases: Callable[[System, Console], tuple[str, str | None]],
                title: str = "", banner: Callable[[Console], None] = lambda console: None) -> None:
    """The replicas, the workers and nginx on the database `databases` opens (its URL, and the fakes' records'
    URL: None keeps them in the service's database), until Ctrl-C; `banner` adds lines to what is printed."""
    if nginx.find_nginx() is None:
        console.print(f"[red]{nginx.INSTALL_HINT}[/]")
        raise SystemExit(2)
    if args.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    nats_nodes = 0 if os.environ.get("NATS_URL") else getattr(args, "nats_nodes", 0)
    nats_ports = [getattr(args, "nats_port", 0) + n for n in range(nats_nodes)]
    refuse_taken_ports({"--port": args.port, "--psp-port": args.psp_port, "--rail-port": args.rail_port}
                       | {f"NATS node {n}": port for n, port in enumerate(nats_ports, 1)})

    operator_token = os.environ.get("OPERATOR_TOKEN") or kept_operator_token()
    # Read at a terminal: the readable log format, unless LOG_FORMAT says otherwise.
    system = System(environ={"LOG_FORMAT": "console"} | dict(os.environ, OPERATOR_TOKEN=operator_token),
                    own_process_groups=True)  # a Ctrl-C is ours to act on: supervise()
    directory = Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")).resolve() / "nginx"

    def start() -> None:
        database_url, records_url = databases(system, console)
        api_key = demo_api_key(database_url)
        system.start_fakes(records_url=records_url, psp_port=args.psp_port, rail_port=args.rail_port)
        apis = [system.start_api(f"API {n}") for n in range(1, args.replicas + 1)]
        for n in range(1, args.workers + 1):
            system.start_worker(f"worker {n}")
        balancer = system.start_nginx(apis, directory, port=args.port)
        consumers = getattr(args, "consumers", 0)
        nats_directory = directory.parent / "nats-cluster"  # each node's store and log
        if nats_nodes:
            with console.status(f"starting a {nats_nodes}-node NATS JetStream cluster"):
                system.start_nats_cluster(nats_directory, nats_nodes, ports=nats_ports, logs=nats_directory)
        elif consumers:
            system.start_nats(directory.parent / "nats")  # NATS_URL's
        for n in range(1, consumers + 1):
            system.start_consumer(f"consumer {n}")
        console.rule(f"[bold green]exactly-once payments: {args.replicas} replicas behind nginx{title}")
        console.print(f"nginx      {balancer.url}   (config, pid and logs: {directory})")
        for api in apis:
            console.print(f"{api.name:<10} {api.url}")
        console.print(f"fake PSP   {system.psp.url}   (records: /_admin/charges)")
        console.print(f"fake rail  {system.rail.url}   (records: /_admin/transfers)")
        console.print(f"workers    {args.workers}, each resuming any payment whose owner died")
        if consumers:
            console.print(f"NATS       {system.nats_url}   ({nats_nodes or 'NATS_URL'}"
                          f"{' nodes, the batch streams on ' + str(system.nats_replicas) if nats_nodes else ''}; "
                          f"{consumers} `payments consume`; docs/batches.md)")
        if nats_nodes:
            nodes = [p for p in system.processes if p.name.startswith("nats-")]
            console.print("           a node killed (" + ", ".join(f"{p.name} pid {p.pid}" for p in nodes)
                          + ") is started again; the batches carry on meanwhile")
            console.print(f"           the nodes' logs: {nats_directory}/nats-N.log")
        banner(console)
        print_pay_once(console, balancer.url, api_key)
        print_console_link(console, balancer.url, operator_token)
        console.print(STOP_HINT)

    # A node of the NATS cluster that dies is started again on its store, as
    # a service manager would; meanwhile the other two carry the batches on.
    supervise(system, console, start, restart=lambda process: process.name.startswith("nats-"))

if __name__ == "__main__":
    main()
