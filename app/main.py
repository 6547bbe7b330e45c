"""create_app(settings): wiring only. Builds the engine, the HTTP client and the
rail clients once per process, and hands them to the routes."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig

from app.api import errors
from app.api.body_limit import BodyLimit
from app.api.in_flight import InFlight, TrackInFlight
from app.api.replay_shortcut import ReplayShortcut
from app.api.routes import router
from app.config import Settings
from app.problems import CATALOGUE
from app.services import open_services

DESCRIPTION = """
A payments API that moves money **exactly once**, however often a request is
retried and wherever a process dies. Send every `POST /v1/payments` with an
`Idempotency-Key` you generate once per payment; retry with the same key.

Errors are `application/problem+json` (RFC 9457). Problem types:

""" + "\n".join(f"- `{p.uri}` ({p.status}): {p.title}" for p in CATALOGUE.values())


# FastAPI looks for OpenTelemetry providers on every request (it reads the
# environment each time); this service exports none, so the look is switched
# off. It was about 2% of a replay's CPU (docs/reference/performance.md). The naive twin
# and the fakes switch it off too, so every variant pays the same framework.
NO_TELEMETRY: TelemetryConfig = {"tracing": False, "metrics": False, "logs": False}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    in_flight = InFlight()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async with open_services(settings) as services:
            app.state.services = services
            try:
                yield
            finally:
                # uvicorn has just cancelled the requests still running after
                # SHUTDOWN_GRACE_SECONDS; let each give its lease back before
                # the engine is disposed (app/api/in_flight.py).
                await in_flight.settle()

    app = FastAPI(
        title="Exactly-once payments",
        version="0.1.0",
        description=DESCRIPTION,
        lifespan=lifespan,
        telemetry=NO_TELEMETRY,
    )
    errors.install(app)
    app.include_router(router)
    if settings.replay_shortcut:
        # An optimisation, not part of the idea: retries of finished payments
        # are answered here, before routing, with the route's own read and
        # decision (app/api/replay_shortcut.py); everything else passes
        # through untouched. REPLAY_SHORTCUT=false leaves the route to answer
        # them, with the same bytes.
        app.add_middleware(ReplayShortcut)
    # Then the body cap, outside the shortcut: a body over the cap is refused
    # (413) before the shortcut, FastAPI or authentication reads it
    # (app/api/body_limit.py).
    app.add_middleware(BodyLimit)
    # Added last, so outermost: every request's task is known to the
    # lifespan's shutdown, which lets cancelled payments give their leases back.
    app.add_middleware(TrackInFlight, in_flight=in_flight)
    _document_required_key(app)
    return app


def _document_required_key(app: FastAPI) -> None:
    """Mark Idempotency-Key as required in the OpenAPI document.

    The dependency declares it optional only so that a missing header is
    answered with our own problem type (idempotency-key-missing) rather than a
    generic validation error; for clients it is required.
    """
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for parameter in schema["paths"]["/v1/payments"]["post"]["parameters"]:
                if parameter["name"] == "Idempotency-Key":
                    parameter["required"] = True
                    parameter["schema"] = {"type": "string", "minLength": 1, "maxLength": 255}
                    parameter["example"] = "8e03978e-40d5-43e8-bc93-6894a57f9324"
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
