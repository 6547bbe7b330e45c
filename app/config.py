"""Settings, read from the environment once, in `create_app` or a CLI command.

Nothing reads the environment at import time, so tests and tools can build an
app with explicit settings and several apps can live in one process.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import ssl
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.iban import normalise_all


def asyncpg_url(url: str) -> str:
    """SQLAlchemy's spelling of a PostgreSQL URL that uses the asyncpg driver."""
    for prefix in ("postgresql+asyncpg://", "postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    # Only the scheme is repeated: the rest of a database URL holds its
    # password, and this message ends up on a terminal or in a log.
    scheme, sep, _ = url.partition("://")
    shown = f" ({scheme}://...)" if sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]{0,31}", scheme) else ""
    raise ValueError(f"not a PostgreSQL URL{shown}: expected postgresql://user:password@host:port/database")


def redacted_url(url: str) -> str:
    """A database URL fit to print: its password replaced by ***."""
    from sqlalchemy.engine import make_url

    try:
        return make_url(asyncpg_url(url)).set(drivername="postgresql").render_as_string(hide_password=True)
    except Exception:  # not a URL we can take apart: show none of it
        return "(DATABASE_URL)"


def libpq_url(url: str) -> str:
    """The driver-free spelling, for asyncpg itself, psql and pgbench."""
    return "postgresql://" + asyncpg_url(url)[len("postgresql+asyncpg://") :]


MIN_OPERATOR_TOKEN_LENGTH = 32
# The shortest key a whsec_ secret may decode to (the Standard Webhooks
# format's own floor).
MIN_WHSEC_KEY_BYTES = 24

# How long after its first attempt a client may still retry (or resume) an
# operation with its stored key: the documented budget of a client
# (docs/reference/client.md#how-long-a-key-is-honoured; payments_client's
# RETRY_WINDOW_HOURS says the same). A key kept for less could be reaped
# while its client still retries it.
CLIENT_RETRY_WINDOW_HOURS = 24


class Settings(BaseSettings):
    """Every knob of the service, documented in README.md#configuration."""

    # hide_input_in_errors: a refused setting's error must not print what it
    # was given (DATABASE_URL holds a password); the messages name the problem.
    model_config = SettingsConfigDict(env_file=None, extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        description="PostgreSQL holding the key table, payments and ledger."
    )
    # Where the operator console's pages and the read model read, and nothing
    # else: a standby that may lag (docs/failover.md#reads-on-a-standby).
    # Unset, they read DATABASE_URL. A payment's path and the console's
    # sessions never read here: a client reads its own writes, and a logout
    # takes effect at once, only on the primary.
    database_read_url: str | None = None
    psp_url: str = "http://127.0.0.1:8101"
    rail_url: str = "http://127.0.0.1:8102"
    # What the rail can do, from configuration (we cannot ask it). A legacy
    # rail neither deduplicates by Idempotency-Key nor answers status probes,
    # so a transfer to it is sent once and never blindly retried: a timeout or
    # a lost response parks the payment for reconciliation. RAIL_LEGACY makes
    # the whole rail legacy; RAIL_LEGACY_ACCOUNTS (comma-separated IBANs, in
    # electronic or print form) only the payouts to those accounts.
    rail_legacy: bool = False
    rail_legacy_accounts: str = ""

    # A lease must outlast the slowest phase plus its external call, or a live
    # owner would be taken over while it is still working (it would then be
    # fenced off, so this costs time, never money).
    # 30 s covers the slowest phase: a 5 s call, two inline retries and a 5 s
    # probe. A client should keep retrying for longer than this (the shipped
    # payments_client does), or it may give up just before a takeover.
    lease_seconds: float = Field(default=30.0, gt=0)
    # How long one external call may take before its outcome counts as unknown.
    psp_timeout_seconds: float = Field(default=5.0, gt=0)
    rail_timeout_seconds: float = Field(default=5.0, gt=0)
    # Inline retries, with the same derived key, of a 429/503 answered before
    # anything was applied. Bounded so a request never waits for long.
    transient_retries: int = Field(default=2, ge=0, le=5)
    # What a client is told to wait before retrying a request still in flight.
    retry_after_seconds: int = Field(default=1, ge=1)
    # `payments api` on SIGTERM: stop accepting, give requests in flight this
    # long to finish, then cancel them; a cancelled payment gives its lease
    # back before the process exits (app/api/in_flight.py), so a retry on
    # another replica resumes it at once instead of waiting out LEASE_SECONDS.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # Answer retries of finished payments before the framework runs
    # (app/fastpath/replay_shortcut.py), an optimisation: the same answer as
    # the route's, for less CPU (docs/reference/performance.md). false: the
    # route answers them.
    replay_shortcut: bool = True
    db_pool_size: int = Field(default=20, ge=1)
    # How long one phase's statements and commit may take at the database
    # before the service drops the connection (no cancel request) and answers
    # 503 with Retry-After (app/db/transaction.py::_bounded). What it bounds:
    # a commit that waits for a synchronous standby when none is left. A
    # request can meet it twice (a phase, then the release of its lease), so
    # twice this stays under a balancer's read timeout (devtools/nginx.py).
    db_phase_timeout_seconds: float = Field(default=2.0, gt=0)
    # What one client can make an API process hold (README.md#bounds-on-input,
    # app/api/http_protocol.py). A request body must arrive within
    # BODY_TIMEOUT_SECONDS of its headers (408 after it). One peer (an IPv4
    # address, or an IPv6 /64) may hold MAX_CONNECTIONS_PER_PEER connections
    # at once per process (429 past it), except the trusted proxies of
    # FORWARDED_ALLOW_IPS: every connection of a balancer comes from its own
    # address, and behind one the per-client bounds are the balancer's
    # (devtools/nginx.py). The same list is whose X-Forwarded-For uvicorn
    # believes. Past LIMIT_CONCURRENCY connections or requests in all, a
    # process answers 503.
    body_timeout_seconds: float = Field(default=10.0, gt=0)
    max_connections_per_peer: int = Field(default=100, ge=1)
    forwarded_allow_ips: str = "127.0.0.1,::1"
    limit_concurrency: int = Field(default=1000, ge=1)
    # The replay shortcut's own asyncpg pool (app/fastpath/lookup_pool.py):
    # one short read per POST, so a few connections serve many requests.
    db_lookup_pool_size: int = Field(default=4, ge=1)

    # After this many attempts whose outcome stayed unknown, an operation is
    # parked as indeterminate for reconciliation instead of being retried.
    max_attempts: int = Field(default=8, ge=1)
    # A parked operation whose external system answers probes (a PSP charge
    # or refund, a payout to a deduplicating rail) is asked again this often
    # by the worker, and driven on once it answers: a PSP outage longer than
    # the attempts allow heals by itself, with no person involved.
    parked_recheck_seconds: float = Field(default=300.0, gt=0)
    # The recovery worker's backoff between attempts: base * 2^(n-1), capped.
    backoff_base_seconds: float = Field(default=1.0, gt=0)
    backoff_cap_seconds: float = Field(default=300.0, gt=0)
    # The recovery worker: how often it sweeps, how old a stranded operation
    # must be before it is touched, and how many it drives at once.
    worker_poll_seconds: float = Field(default=1.0, gt=0)
    worker_min_age_seconds: float = Field(default=2.0, ge=0)
    worker_concurrency: int = Field(default=8, ge=1)
    # Reconciliation inside `payments worker`: how often it checks whether the
    # recent closed days still need their run, and how long a run's lease lasts.
    reconcile_every_seconds: float = Field(default=60.0, gt=0)
    # The rail's booking horizon: how many days after its instruction a payout
    # may still be booked (cut-off, weekends, holidays). A payout is declared
    # absent only once every statement in its horizon is final.
    reconcile_booking_days: int = Field(default=3, ge=1, le=14)
    reconcile_lease_seconds: float = Field(default=300.0, gt=0)
    # How long a finished key is kept (from its claim, and from its finish)
    # before the worker's daily tick drops the day's partition that holds it
    # (docs/key-table.md#how-long-a-key-is-kept). Started and parked keys are
    # never removed. At least the client's retry window and the rail's booking
    # horizon: start-up refuses less.
    key_retention_hours: float = Field(default=72.0, gt=0)
    # How often `payments worker` checks whether today's partition upkeep
    # (create ahead, reap) has run; the durable tick makes it once per day.
    key_reap_every_seconds: float = Field(default=300.0, gt=0)
    # Webhooks (app/workers/webhooks.py): how long a merchant's endpoint
    # may take to answer before the attempt counts as a timeout, and how long
    # a dispatcher's claim on a delivery lasts (it must outlast the POST: a
    # dispatcher that dies mid-delivery leaves it to be redelivered after it).
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_lease_seconds: float = Field(default=30.0, gt=0)
    # The retry schedule: after failed attempt n, wait base * 2^(n-1), capped,
    # with jitter (a random half); give up after `webhook_max_attempts` and
    # mark the delivery dead, for a person (`payments events redeliver`).
    # The defaults retry for about 1 to 2 days (docs/outbox-inbox.md).
    webhook_max_attempts: int = Field(default=16, ge=1)
    webhook_backoff_base_seconds: float = Field(default=30.0, gt=0)
    webhook_backoff_cap_seconds: float = Field(default=21600.0, gt=0)
    # POSTs one worker has in flight at once (a list POST is one); a read of the
    # cursor takes at most as many events to send as its free slots carry.
    webhook_concurrency: int = Field(default=16, ge=1)
    # How long the dispatcher rests once it has read every event behind its
    # cursor, before it reads again: while it keeps up, a webhook's first
    # attempt leaves within about this of its payment's commit (plus its
    # POST). Shorter means more reads, each of fewer events.
    webhook_poll_seconds: float = Field(default=0.5, gt=0)
    # Payment batches over NATS JetStream (`payments consume`, docs/batches.md).
    # NATS_URL: the broker; `make run` and the tests start their own unless set.
    # The broker redelivers a row not acknowledged within the ack wait, so the
    # ack wait must outlast one row's payment (its calls and phases); a row
    # that fails the same way on every delivery is dead-lettered after
    # `batch_max_deliveries`. A consumer pays this many rows at once.
    # NATS_URL may name every node of a cluster, comma-separated, so that a
    # consumer moves to a live node when its own dies; the streams are then
    # kept on BATCH_STREAM_REPLICAS nodes (3 on a three-node cluster), so a
    # node's death loses no stored row.
    nats_url: str = "nats://127.0.0.1:4222"
    batch_stream_replicas: int = Field(default=1, ge=1, le=5)
    batch_ack_wait_seconds: float = Field(default=60.0, gt=0)
    batch_max_deliveries: int = Field(default=5, ge=1)
    batch_consumer_concurrency: int = Field(default=16, ge=1)
    # The egress policy (app/outbox/egress.py, docs/outbox-inbox.md#egress-where-the-dispatcher-may-connect):
    # a webhook URL is https and reaches public addresses only, checked on
    # the resolved address of every connection. Development only: http
    # allowed, and these comma-separated networks allowed too (the fake
    # merchant on loopback: devtools sets both for `make run` and the tests).
    webhook_allow_http: bool = False
    webhook_allowed_networks: str = ""
    # A PEM bundle of the CAs the dispatcher trusts for https, instead of
    # the system's (a private CA; the tests' throwaway one).
    webhook_ca_file: str | None = None
    # Webhook signing secrets are sealed at rest with this key (Fernet: 32
    # bytes, url-safe base64; several, comma-separated, while rotating it:
    # the first seals, all open). Needed by `payments worker` and the
    # commands that register or reseal endpoints, never by the API.
    webhook_secrets_key: SecretStr | None = None
    # After `--rotate-secret`, how long the old secret is still sent beside
    # the new one (both signatures in webhook-signature).
    webhook_secret_overlap_hours: float = Field(default=24.0, ge=0)
    # What the service tells its operators (docs/operations.md). Metrics:
    # the API's /metrics on API_METRICS_HOST:PORT, a port of its own and never
    # the public one (anyone who reaches the API would read them), and the
    # worker's on WORKER_METRICS_HOST:PORT; false turns both off. Logs:
    # LOG_FORMAT json (one object per line) or console (readable; what
    # `make run` uses); LOG_LEVEL for the service's own loggers.
    metrics_enabled: bool = True
    api_metrics_host: str = "127.0.0.1"
    api_metrics_port: int = Field(default=8201, ge=1, le=65535)
    worker_metrics_host: str = "127.0.0.1"
    worker_metrics_port: int = Field(default=8200, ge=1, le=65535)
    log_format: Literal["json", "console"] = "json"
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    # The rail's notifications of returned payouts (POST /v1/rail/notifications)
    # are signed with this shared secret (Standard Webhooks, whsec_...); unset,
    # every notification is refused with 401 and returns arrive only through
    # reconciliation's reading of the statements.
    rail_notification_secret: str | None = Field(default=None, pattern=r"^whsec_[A-Za-z0-9+/=]+$")
    # Crash tests and demos only: die at this named point (app.payments.crash_points;
    # the commands check the name at start-up, app/cli.py::_settings).
    payments_crash_at: str | None = None

    # The operator console (app/console/, docs/console.md): read-only pages
    # behind this one token, sent as `Authorization: Bearer <token>` or through
    # the console's login form. Unset, the console is disabled (404): it is
    # never open to whoever can reach the port. A secret, so never printed by a
    # refused setting. `make run` generates one when none is set.
    operator_token: SecretStr | None = None
    # How long a console login lasts (app/console/sessions.py): one working
    # day of on-call by default, then log in again. Logging out, or a new
    # OPERATOR_TOKEN, ends a session sooner.
    console_session_seconds: int = Field(default=12 * 3600, ge=60, le=30 * 24 * 3600)

    @property
    def legacy_accounts(self) -> frozenset[str]:
        """The legacy accounts' IBANs, normalised (app/iban.py) like every beneficiary's."""
        return frozenset(a for a in self.rail_legacy_accounts.split(",") if a)

    @field_validator("rail_legacy_accounts")
    @classmethod
    def _legacy_ibans(cls, value: str) -> str:
        # Normalised, so "gb82 west 1234 ..." matches the normalised beneficiary
        # IBAN of a payment (an exact comparison would miss it, and a legacy
        # payout would be retried as if the rail deduplicated: a second payout).
        # An entry that is not an IBAN refuses start-up rather than being
        # silently never matched.
        return ",".join(sorted(normalise_all(value)))

    @property
    def trusted_proxies(self) -> list[str]:
        """FORWARDED_ALLOW_IPS as a list: addresses and networks, or ["*"] for any."""
        entries = [entry.strip() for entry in self.forwarded_allow_ips.split(",") if entry.strip()]
        return ["*"] if "*" in entries else entries

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses_or_networks(cls, value: str) -> str:
        # uvicorn takes an entry that is not an address as a literal that
        # never matches: a typo would silently trust nobody, and throttle
        # the balancer as if it were one client.
        for entry in (e.strip() for e in value.split(",")):
            if entry and entry != "*":
                try:
                    ipaddress.ip_network(entry)
                except ValueError:
                    raise ValueError(f"{entry!r} is not an IP address or network (e.g. 10.0.0.0/8), nor *") from None
        return value

    @field_validator("rail_notification_secret")
    @classmethod
    def _strong_notification_secret(cls, value: str | None) -> str | None:
        # A short key is a guessable one: whoever guesses it can notify us of
        # returns that never happened. The Standard Webhooks format allows 24
        # to 64 bytes.
        if value is None:
            return None
        try:
            length = len(base64.b64decode(value.removeprefix("whsec_"), validate=True))
        except (binascii.Error, ValueError):
            raise ValueError("is whsec_ followed by base64") from None
        if length < MIN_WHSEC_KEY_BYTES:
            raise ValueError(f"its key is {length} bytes, at least {MIN_WHSEC_KEY_BYTES} are needed "
                             f"(try: echo whsec_$(openssl rand -base64 32))")
        return value

    @field_validator("webhook_allowed_networks")
    @classmethod
    def _networks(cls, value: str) -> str:
        try:
            return ",".join(str(ipaddress.ip_network(n.strip(), strict=False)) for n in value.split(",") if n.strip())
        except ValueError as exc:
            raise ValueError(f"comma-separated addresses or networks (127.0.0.0/8,::1): {exc}") from None

    @field_validator("webhook_ca_file")
    @classmethod
    def _ca_file(cls, value: str | None) -> str | None:
        if not value:
            return None
        try:
            ssl.create_default_context(cafile=value)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load {value} as a PEM bundle of CA certificates: {exc}") from None
        return value

    @field_validator("webhook_secrets_key")
    @classmethod
    def _fernet_keys(cls, value: SecretStr | None) -> SecretStr | None:
        from cryptography.fernet import Fernet

        if value is None or not value.get_secret_value().strip():
            return None
        try:
            for key in value.get_secret_value().split(","):
                Fernet(key.strip())
        except (ValueError, binascii.Error):
            raise ValueError("is one or more comma-separated Fernet keys, 32 bytes in url-safe base64 each "
                             "(try: openssl rand -base64 32 | tr '+/' '-_')") from None
        return value

    @field_validator("operator_token")
    @classmethod
    def _operator_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None or not value.get_secret_value():
            return None  # OPERATOR_TOKEN= (empty) leaves the console disabled
        token = value.get_secret_value()
        # The console shows every client's payments: a token short enough to
        # guess would open all of them.
        if len(token) < MIN_OPERATOR_TOKEN_LENGTH:
            raise ValueError(f"must be at least {MIN_OPERATOR_TOKEN_LENGTH} characters (try: openssl rand -hex 24)")
        return value

    @field_validator("key_retention_hours")
    @classmethod
    def _retention_outlasts_retries(cls, value: float, info: ValidationInfo) -> float:
        # A key removed while its client may still retry it turns that retry
        # into a new request (refused as a duplicate reference, but no longer
        # answered with the payment's own response); and a parked payout's key
        # must outlive the statements that can still book it.
        booking_days = info.data.get("reconcile_booking_days", 0)
        floor = max(CLIENT_RETRY_WINDOW_HOURS, 24 * booking_days)
        if value < floor:
            raise ValueError(
                f"{value:g} h is shorter than clients retry a key ({CLIENT_RETRY_WINDOW_HOURS} h) or the rail "
                f"may book a payout (RECONCILE_BOOKING_DAYS={booking_days}, {24 * booking_days} h); "
                f"keep keys at least {floor} h"
            )
        return value

    @model_validator(mode="after")
    def _lease_outlasts_a_post(self) -> Settings:
        # A claim that ran out while its POST was still waiting would let a
        # second dispatcher deliver the same event at the same time.
        if self.webhook_lease_seconds <= self.webhook_timeout_seconds:
            raise ValueError("WEBHOOK_LEASE_SECONDS must be longer than WEBHOOK_TIMEOUT_SECONDS")
        return self

    @field_validator("log_format", "log_level", mode="before")
    @classmethod
    def _any_case(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        return value.lower() if value.lower() in ("json", "console") else value.upper()

    @field_validator("database_url", "database_read_url")
    @classmethod
    def _postgres_only(cls, value: str | None) -> str | None:
        # An empty DATABASE_READ_URL is unset, as a blank line in an env file means.
        return asyncpg_url(value) if value else None
