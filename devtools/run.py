"""Development tooling, not the payment path: `make run`, the whole system on one machine.

`python -m devtools.run` (what `make run` runs) first checks that every port
it needs is free (one that is not stops it, exit 2, before anything starts or
is printed), then starts the whole system with
devtools/system.py: the embedded PostgreSQL unless DATABASE_URL names a
server (its `payments` database, kept from run to run), migrations, a demo
client whose key is kept in .data/ (with a webhook endpoint at the fake
merchant), the fake PSP, the fake rail, the fake merchant, the API, the
worker, a NATS server (unless NATS_URL names one) and a batch consumer on
the ports given, then prints how to pay once and a link into the
operator console (OPERATOR_TOKEN, generated and kept in .data/ when it is not
set). Ctrl-C, a closed terminal (SIGHUP) or a SIGTERM stops every process it
started and the embedded PostgreSQL if it started it; a process that exits on
its own stops them too, and the run exits 1.

Its children get the user's environment (plus where the database and the
fakes are), so the settings of README.md#configuration apply to `make run`.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import secrets
import signal
import socket
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

from rich.console import Console

from app import admin
from app.outbox import egress
from devtools.bodies import payment_body
from devtools.processes import NotHealthy, Process
from devtools.system import System


def main(argv: list[str] | None = None) -> None:
    """`python -m devtools.run [--api-port N] ...`: the ports default to API_PORT, PSP_PORT, RAIL_PORT, MERCHANT_PORT."""
    parser = argparse.ArgumentParser(prog="python -m devtools.run", description=__doc__.splitlines()[0])
    for option, variable, default in (("--api-port", "API_PORT", 8000), ("--psp-port", "PSP_PORT", 8101),
                                      ("--rail-port", "RAIL_PORT", 8102), ("--merchant-port", "MERCHANT_PORT", 8103)):
        # A string default goes through `type` too: a bad variable is refused like a bad option.
        parser.add_argument(option, type=int, default=os.environ.get(variable, str(default)),
                            help=f"default {default}, or {variable}")
    args = parser.parse_args(argv)
    console = Console()
    ports = {"API_PORT": args.api_port, "PSP_PORT": args.psp_port, "RAIL_PORT": args.rail_port,
             "MERCHANT_PORT": args.merchant_port,
             "API_METRICS_PORT": int(os.environ.get("API_METRICS_PORT", "8201")),
             "WORKER_METRICS_PORT": int(os.environ.get("WORKER_METRICS_PORT", "8200"))}
    if not os.environ.get("NATS_URL"):
        ports["NATS_PORT"] = int(os.environ.get("NATS_PORT", "8104"))
    refuse_taken_ports(ports)
    run(console, args.api_port, args.psp_port, args.rail_port, args.merchant_port)


def refuse_taken_ports(ports: dict[str, int]) -> None:
    """Exit 2 with one line if any of `ports` is in use: called before anything is started or printed,
    so a second `make run` never prints a banner (and a curl) that would go to the first one."""
    if taken := taken_ports(ports):
        Console(stderr=True).print(
            "cannot start: " + ", ".join(f"{name} {port}" for name, port in taken)
            + " already in use (another `make run`?); stop it, or choose other ports (README.md#configuration)",
            style="red", soft_wrap=True, markup=False, highlight=False)
        raise SystemExit(2)


def taken_ports(ports: dict[str, int]) -> list[tuple[str, int]]:
    """The (variable, port) pairs of `ports` that something already listens on, on 127.0.0.1 (where all of them serve)."""
    taken = []
    for name, port in ports.items():
        with socket.socket() as probe:
            # As the servers themselves bind: a port left in TIME_WAIT by the
            # last run is free; one that something listens on is not.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                taken.append((name, port))
    return taken


def run(console: Console, api_port: int, psp_port: int, rail_port: int, merchant_port: int = 8103) -> None:
    """Start everything: database, migrations, fake PSP, fake rail, fake merchant, API, worker; until Ctrl-C."""
    operator_token = os.environ.get("OPERATOR_TOKEN") or kept_operator_token()
    # A person reads these processes' lines at the terminal: the readable
    # log format, unless LOG_FORMAT says otherwise (README.md#configuration).
    system = System(environ={"LOG_FORMAT": "console"} | dict(os.environ, OPERATOR_TOKEN=operator_token),
                    own_process_groups=True)  # a Ctrl-C is ours to act on: supervise()
    metrics_port = os.environ.get("WORKER_METRICS_PORT", "8200")
    api_metrics_port = os.environ.get("API_METRICS_PORT", "8201")

    def start() -> None:
        url = open_database(system, console)
        api_key = demo_api_key(url)
        # The demo client's webhooks go to the fake merchant, which is told
        # the signing secret: a learner sees a payment's webhook arrive
        # (and be applied once) without setting anything up.
        secret = demo_webhook_secret(system, url, api_key, f"http://127.0.0.1:{merchant_port}/webhooks")
        # The rail notifies the API of returned payouts, signed with a secret
        # both are given (this run's own, unless RAIL_NOTIFICATION_SECRET is set).
        rail_secret = os.environ.get("RAIL_NOTIFICATION_SECRET") or (
            "whsec_" + base64.b64encode(os.urandom(32)).decode())
        system.settings["RAIL_NOTIFICATION_SECRET"] = rail_secret
        assert system.environ is not None
        system.environ["FAKE_RAIL_NOTIFY_SECRET"] = rail_secret
        notify_url = f"http://127.0.0.1:{api_port}/v1/rail/notifications"
        system.start_fakes(psp_port=psp_port, rail_port=rail_port, rail_args=("--notify-url", notify_url))
        system.start_merchant(port=merchant_port, secrets=[secret])
        system.start_api("API", port=api_port, API_METRICS_PORT=api_metrics_port)
        system.start_worker("worker", WORKER_METRICS_PORT=metrics_port)
        # Payment batches (docs/batches.md): NATS_URL's broker, else one from
        # the wheel with its streams in .data/nats, and one consumer. The
        # server's own output (a start-up banner, then little) goes to a
        # file: the terminal is for our processes' lines.
        data = Path(os.environ.get("PAYMENTS_DATA_DIR", ".data"))
        broker = system.start_nats(data / "nats", port=int(os.environ.get("NATS_PORT", "8104")),
                                   log=data / "nats-server.log")
        system.start_consumer("consumer")
        own_log = f"; the server's log: {broker.process.log}" if broker.process else ""  # none for NATS_URL's
        _print_welcome(console, api_port, psp_port, rail_port, merchant_port, api_key, metrics_port=metrics_port,
                       api_metrics_port=api_metrics_port,
                       nats=f"{broker.url}   (payment batches: `payments consume` is running; docs/batches.md"
                            f"{own_log})")
        print_console_link(console, f"http://127.0.0.1:{api_port}", operator_token)
        console.print(STOP_HINT)

    supervise(system, console, start)


def open_database(system: System, console: Console) -> str:
    """The `payments` database `make run` keeps from run to run (DATABASE_URL's, else embedded), migrated; its URL."""
    url = os.environ.get("DATABASE_URL")
    if url:
        return system.use_database(url)
    with console.status("starting embedded PostgreSQL"):
        postgres = system.start_postgres()
    url = system.create_database("payments", fresh=False)
    console.print(f"PostgreSQL (embedded) at {url}" + ("" if postgres.started else " (already running)"))
    return url


def supervise(system: System, console: Console, start: Callable[[], None],
              restart: Callable[[Process], bool] = lambda process: False) -> None:
    """`start` the system, then watch it until Ctrl-C, SIGTERM, SIGHUP or a process exits; always stop it all.

    Stopped in reverse, one by one: the consumer while its broker is still
    up, the API and the worker while their database is. A system made with
    `own_process_groups` keeps its processes out of the terminal's reach,
    so a Ctrl-C stops only this loop, which then stops them in that order;
    without it, the Ctrl-C reaches every process at once, and a consumer
    sees its broker go before it is told to stop.

    A process `restart` names (a NATS cluster's node, which a person kills to
    see the cluster carry on) is started again when it exits, instead.
    """
    failed = False
    try:
        try:
            start()
        except NotHealthy as exc:
            raise SystemExit(str(exc)) from None
        # A closed terminal (SIGHUP) or a polite kill (SIGTERM) must clean up
        # like Ctrl-C does, or the children would outlive us.
        signal.signal(signal.SIGTERM, _interrupt)
        signal.signal(signal.SIGHUP, _interrupt)
        while True:
            gone = [process for process in system.processes if not process.running]
            if any(not restart(process) for process in gone):
                break
            for process in gone:
                console.print(f"[yellow]{process.name} exited (code {process.popen.returncode}); starting it again[/]")
                try:
                    process.start()
                except NotHealthy as exc:
                    console.print(f"[red]{exc}[/]")
            time.sleep(0.5)
        exited = [process for process in system.processes if not process.running]
        console.print(f"[red]{', '.join(process.name for process in exited)} exited; stopping everything[/]")
        # One whose output goes to a file (the NATS server's) would otherwise
        # be gone without a word on the terminal: its last lines, here.
        for process in exited:
            if tail := process.tail(10):
                console.print(f"the end of {process.log}:\n{tail}", markup=False, highlight=False)
        failed = True
    except KeyboardInterrupt:
        console.print("\nstopping")
    finally:
        # A second Ctrl-C (or SIGTERM) during the clean-up must not cut it
        # short: that would leave PostgreSQL or a child running. Any child
        # that does not stop within its grace is killed, so this ends.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        system.stop()
        if system.postgres is not None and system.postgres.started:
            console.print("embedded PostgreSQL stopped (data kept in .data/)")
    if failed:  # not stopped by the user: a caller (or make) must see it did not run
        raise SystemExit(1)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def demo_api_key(url: str) -> str:
    """The demo client's key: kept in .data/ so the next `make run` prints the same one."""
    # One file per database, so switching DATABASE_URL back and forth keeps both keys.
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    path = Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")) / f"demo-api-key-{digest}"
    if path.exists():
        api_key = path.read_text().strip()
        if admin.client_of_key(url, api_key) is not None:
            return api_key
    _, api_key = admin.create_client(url, "demo")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(api_key + "\n")
    return api_key


STOP_HINT = "\nCtrl-C stops every process started here."


def kept_operator_token() -> str:
    """An operator token for the console, kept in .data/ (readable by its owner only) so a
    browser's login survives the next `make run`."""
    path = Path(os.environ.get("PAYMENTS_DATA_DIR", ".data")) / "operator-token"
    if path.exists() and len(token := path.read_text().strip()) >= 32:
        return token
    token = secrets.token_urlsafe(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch(mode=0o600)
    path.write_text(token + "\n")
    return token


def print_console_link(console: Console, api_url: str, operator_token: str, page: str = "/console") -> None:
    """A link that logs a browser into the operator console and opens `page`.

    The token is in the link (as Jupyter's are), for a developer's own
    machine: the console swaps it for a cookie and redirects at once, but
    the browser's history keeps the link. docs/console.md says more.
    """
    link = f"{api_url}/console/login?{urlencode({'token': operator_token, 'next': page})}"
    console.print("\nOperator console (read-only; this link logs a browser in with OPERATOR_TOKEN):")
    console.print(link, soft_wrap=True, highlight=False, markup=False)


def demo_webhook_secret(system: System, url: str, api_key: str, webhook_url: str) -> str:
    """Point the webhook endpoint of the demo client (the one `api_key` is of) at `webhook_url` (created the
    first time); its signing secret.

    Registered under the development egress policy (the fake merchant is on
    loopback, over http), sealed with the system's WEBHOOK_SECRETS_KEY.
    """
    # By id, not by name: earlier runs (a lost key file) may have left other clients named "demo".
    client_id = admin.client_of_key(url, api_key)
    assert client_id is not None
    admin.set_webhook(url, client_id, webhook_url, policy=egress.development(), secrets_key=system.secrets_key)
    endpoint = admin.webhook_endpoint(url, client_id, system.secrets_key)
    if endpoint is None or endpoint[1] is None:
        raise SystemExit("the demo client's webhook secret does not open with WEBHOOK_SECRETS_KEY "
                         f"(.data/webhook-secrets-key changed?): `payments clients set-webhook {client_id} URL "
                         "--rotate-secret`")
    return endpoint[1]


def _print_welcome(console: Console, api_port: int, psp_port: int, rail_port: int, merchant_port: int,
                   api_key: str, *, metrics_port: str = "8200", api_metrics_port: str = "8201", nats: str) -> None:
    console.rule("[bold green]exactly-once payments is running")
    console.print(f"API        http://127.0.0.1:{api_port}   (OpenAPI UI: http://127.0.0.1:{api_port}/docs)")
    console.print(f"fake PSP   http://127.0.0.1:{psp_port}   (records: /_admin/charges)")
    console.print(f"fake rail  http://127.0.0.1:{rail_port}   (records: /_admin/transfers; return a payout: "
                  "POST /_admin/return {\"end_to_end_reference\": ..., \"reason_code\": \"AC04\"})")
    console.print(f"merchant   http://127.0.0.1:{merchant_port}   (the demo client's webhooks: /_admin/received, /_admin/inbox)")
    console.print("worker     resumes any payment whose owner died, reconciles, delivers webhooks")
    console.print(f"NATS       {nats}")
    console.print(f"metrics    http://127.0.0.1:{api_metrics_port}/metrics (API), http://127.0.0.1:{metrics_port}/metrics "
                  "(worker): docs/operations.md")
    print_pay_once(console, f"http://127.0.0.1:{api_port}", api_key)


def print_pay_once(console: Console, api_url: str, api_key: str) -> None:
    """The demo client's key and a curl command that pays once through `api_url`; how to stop."""
    key = f"demo-{uuid.uuid4()}"
    body = json.dumps(payment_body(f"order-{uuid.uuid4().hex[:8]}"))
    console.print(f"API key    [bold]{api_key}[/]  (client 'demo')")
    console.print("\nPay once (paste it twice: the second answer is a replay, with Idempotent-Replayed: true):\n")
    console.print(
        f"curl -sS -i -X POST {api_url}/v1/payments \\\n"
        f"  -H 'Authorization: Bearer {api_key}' \\\n"
        f"  -H 'Idempotency-Key: {key}' \\\n"
        f"  -H 'Content-Type: application/json' \\\n"
        f"  -d '{body}'",
        soft_wrap=True, highlight=False, markup=False,
    )


if __name__ == "__main__":
    main()
