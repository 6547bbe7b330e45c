"""create_app(settings): wiring only. Builds the engine, the HTTP client and the
rail clients once per process, and hands them to the routes."""

from __future__ import annotations

import asyncio
import logging
import os
from contextlib import asynccontextmanager, nullcontext

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig
from fastapi_offline import FastAPIOffline

from app.api import errors
from app.api.batch_routes import BATCH_MAX_BODY_BYTES
from app.api.batch_routes import PATH as BATCHES_PATH
from app.api.batch_routes import router as batch_router
from app.api.body_limit import BodyLimit
from app.api.in_flight import InFlight, TrackInFlight
from app.api.metrics import RequestMetrics
from app.api.rail_notifications import router as rail_router
from app.api.routes import payment_examples, refund_examples, router
from app.console import routes as console
from app.config import Settings, redacted_url
from app.db.errors import database_problem
from app.fastpath import replay_shortcut
from app.fastpath.lookup_pool import LookupPool
from app.observability import metrics
from app.problems import CATALOGUE
from app.services import Services, database_answers, open_services

log = logging.getLogger(__name__)
# How long the start-up probe waits for the database before it says it does
# not answer (the API serves meanwhile, and /healthz says 503 until it does).
STARTUP_PROBE_SECONDS = 5

DESCRIPTION = """
A payments API that moves money **exactly once**, however often a request is
retried and wherever a process dies. Send every `POST /v1/payments` and
`POST /v1/payments/{id}/refunds` with an `Idempotency-Key` you generate once
per operation; retry with the same key. A key belongs to the one operation
it was first used for: sent to another endpoint, it is refused (422).

Errors are `application/problem+json` (RFC 9457). Problem types:

""" + "\n".join(f"- `{p.uri}` ({p.status}): {p.title}" for p in CATALOGUE.values())


OPENAPI_TAGS = [
    {"name": "payments", "description": "Create a payment, exactly once, and read it back."},
    {"name": "refunds", "description": "Refund a payment, in full or in part, exactly once; its refunds never add up "
     "to more than its charge."},
    {"name": "payment batches", "description": "A file of payments (a payroll run), every row validated first, "
     "each row paid exactly once under its natural key, however often the file is sent."},
    {"name": "events", "description": "The decisions about your payments, as a feed; webhooks carry the same events."},
    {"name": "idempotency keys", "description": "An operation's state machine row and timeline, for learners and operators."},
    {"name": "meta", "description": "What a problem `type` means; whether the service can reach its database."},
    {"name": "rail", "description": "For the rail only: its signed notifications of returned payouts, through our inbox."},
]

# FastAPI looks for OpenTelemetry providers on every request (it reads the
# environment each time); this service exports none, so the look is switched
# off. The naive twin and the fakes switch it off too, so every variant pays
# the same framework.
NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    in_flight = InFlight()
    # The replay shortcut's own pool (app/fastpath/): no shortcut, no pool.
    lookups = LookupPool(settings) if settings.replay_shortcut else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with open_services(settings) as services, lookups or nullcontext():
            app.state.services = services
            log.info("API process %d started", os.getpid())
            # Said in the background: serving does not wait for it.
            probe = asyncio.create_task(_say_whether_the_database_answers(services))
            try:
                yield
            finally:
                probe.cancel()
                # uvicorn has just cancelled the requests still running after
                # SHUTDOWN_GRACE_SECONDS; let each give its lease back before
                # the engine is disposed (app/api/in_flight.py).
                await in_flight.settle()
                metrics.process_exiting()

    # FastAPI, with /docs (Swagger UI) and /redoc served from assets that
    # ship in the fastapi-offline package: FastAPI's own pages load them from
    # a CDN, and are blank on a machine with no internet.
    app = FastAPIOffline(
        title="Exactly-once payments",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        telemetry=NO_TELEMETRY,
        openapi_tags=OPENAPI_TAGS,
    )
    errors.install(app)
    app.include_router(router)
    app.include_router(batch_router)
    # The operator console (docs/console.md): HTML pages under /console,
    # disabled (404) unless OPERATOR_TOKEN is set.
    console.install(app)
    app.include_router(rail_router)
    if lookups is not None:
        # An optimisation, not part of the idea (app/fastpath/): retries of
        # finished payments answered before routing, with the same bytes.
        replay_shortcut.install(app, lookups)
    # Then the body cap, outside the shortcut: a body over the cap is refused
    # (413) before the shortcut, FastAPI or authentication reads it
    # (app/api/body_limit.py).
    app.add_middleware(BodyLimit, per_path={BATCHES_PATH: BATCH_MAX_BODY_BYTES})
    # Added last, so outermost: every request's task is known to the
    # lifespan's shutdown, which lets cancelled payments give their leases back.
    app.add_middleware(TrackInFlight, in_flight=in_flight)
    if settings.metrics_enabled:
        # Outermost of all: every answer is counted, the shortcut's and the
        # body cap's too (app/api/metrics.py). /metrics is served by
        # `payments api` on a port of its own, never here (app/cli.py).
        app.add_middleware(RequestMetrics)
    _document_the_api_as_it_answers(app)
    return app


async def _say_whether_the_database_answers(services: Services) -> None:
    """One line at start-up: the database answers, or why not (the first thing a new user needs to know)."""
    url = services.settings.database_url
    try:
        await asyncio.wait_for(database_answers(services), STARTUP_PROBE_SECONDS)
    except TimeoutError:
        log.warning("the database at %s does not answer within %g s; /healthz answers 503 until it does",
                    redacted_url(url), STARTUP_PROBE_SECONDS)
    except Exception as exc:
        problem = database_problem(exc, url) or f"the database at {redacted_url(url)} does not answer: {type(exc).__name__}"
        log.warning("%s; /healthz answers 503 until it answers", problem)
    else:
        log.info("the database at %s answers", redacted_url(url))


def _document_the_api_as_it_answers(app: FastAPI) -> None:
    """Make the OpenAPI document say what the API really does.

    - Idempotency-Key is required. The dependency declares it optional only
      so that a missing header is answered with our own problem type
      (idempotency-key-missing) rather than a generic validation error.
    - No `HTTPValidationError`: FastAPI lists a 422 of that shape on every
      operation with a parameter, but this API answers a malformed request
      with a 400 problem+json (`/problems/invalid-request`), and uses 422 only
      for a key reused with another body, which the operation documents.
    - The 201's examples are real final answers (app/api/routes.py:
      payment_examples), set here because FastAPI drops the nulls (`failure`)
      of examples it is given; without them the UIs show `processing`.
    """
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path, examples in (("/v1/payments", payment_examples()),
                                   ("/v1/payments/{payment_id}/refunds", refund_examples())):
                post = schema["paths"][path]["post"]
                for parameter in post["parameters"]:
                    if parameter["name"] == "Idempotency-Key":
                        parameter["required"] = True
                        parameter["schema"] = {"type": "string", "minLength": 1, "maxLength": 255}
                        parameter["example"] = "8e03978e-40d5-43e8-bc93-6894a57f9324"
                post["responses"]["201"]["content"]["application/json"]["examples"] = {
                    name: example for name, example in examples.items() if name != "pending"
                }
                if "pending" in examples:
                    post["responses"]["202"]["content"]["application/json"]["examples"] = {
                        "pending": examples["pending"]
                    }
            for operations in schema["paths"].values():
                for operation in operations.values():
                    responses = operation.get("responses", {})
                    if "HTTPValidationError" in str(responses.get("422", {}).get("content", {})):
                        del responses["422"]
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
