"""Settings, read from the environment once, in `create_app` or a CLI command.

Nothing reads the environment at import time, so tests and tools can build an
app with explicit settings and several apps can live in one process.
"""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator
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


class Settings(BaseSettings):
    """Every knob of the service, documented in README.md#configuration."""

    # hide_input_in_errors: a refused setting's error must not print what it
    # was given (DATABASE_URL holds a password); the messages name the problem.
    model_config = SettingsConfigDict(env_file=None, extra="ignore", hide_input_in_errors=True)

    database_url: str = Field(
        description="PostgreSQL holding the key table, payments and ledger."
    )
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
    # (app/api/replay_shortcut.py): the same answer as the route's, at a
    # fraction of the CPU (docs/performance.md). false: the route answers them.
    replay_shortcut: bool = True
    db_pool_size: int = Field(default=20, ge=1)
    # The caller lookup's own asyncpg pool (app/db/engine.py): one short read
    # per POST, so a few connections serve thousands of requests a second.
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
    # Deliveries one worker has in flight at once.
    webhook_concurrency: int = Field(default=16, ge=1)
    # The rail's notifications of returned payouts (POST /v1/rail/notifications)
    # are signed with this shared secret (Standard Webhooks, whsec_...); unset,
    # every notification is refused with 401 and returns arrive only through
    # reconciliation's reading of the statements.
    rail_notification_secret: str | None = Field(default=None, pattern=r"^whsec_[A-Za-z0-9+/=]+$")
    # Crash tests and demos only: die at this named point (app.payments.crash_points;
    # the commands check the name at start-up, app/cli.py::_settings).
    payments_crash_at: str | None = None

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

    @model_validator(mode="after")
    def _lease_outlasts_a_post(self) -> Settings:
        # A claim that ran out while its POST was still waiting would let a
        # second dispatcher deliver the same event at the same time.
        if self.webhook_lease_seconds <= self.webhook_timeout_seconds:
            raise ValueError("WEBHOOK_LEASE_SECONDS must be longer than WEBHOOK_TIMEOUT_SECONDS")
        return self

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, value: str) -> str:
        return asyncpg_url(value)
