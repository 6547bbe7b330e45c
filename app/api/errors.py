"""Every error leaves as `application/problem+json` (RFC 9457).

Where it sits: the handlers `install` puts on the app, which Starlette runs
around the routes: our own ProblemError, request validation (400), HTTP
exceptions (404, 405), the database going away (503 with Retry-After, as
app/db/errors.py decides), a client gone before its body arrived (one INFO
line, a 499 nobody receives), and anything else as a bug's generic 500. The
middlewares outside them answer for themselves, with `problem_response` and
`unavailable_response`. docs/reference/http-edge.md#errors-problemjson-and-where-each-is-caught
explains which handler sees which exception. The routes describe the
problems they may answer with in the OpenAPI document by `problem_doc`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import asyncpg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from sqlalchemy import exc as sa
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from app.db.errors import database_unavailable, describe, loggable, row_moved
from app.observability import metrics
from app.problems import (
    CATALOGUE, INTERNAL_ERROR, INVALID_REQUEST, KEY_TABLE_UNAVAILABLE, METHOD_NOT_ALLOWED, NOT_FOUND,
    SERVICE_UNAVAILABLE, ProblemError, ProblemType, problem_body,
)

log = logging.getLogger(__name__)
PROBLEM_JSON = "application/problem+json"

# A body with thousands of unknown fields has thousands of errors; listing
# them all would make the answer many times bigger than the request. The
# first few say what is wrong; `errors_omitted` says how many more there were.
MAX_LISTED_ERRORS = 20


def problem_doc(*slugs: str) -> dict[str, Any]:
    """A route's OpenAPI entry for one status: the problems it may answer with, each as an example body.

    The examples are the catalogue's own words (app/problems.py), so the
    document a client reads and the body it gets cannot drift apart.
    """
    problems = [CATALOGUE[slug] for slug in slugs]
    return {
        "content": {PROBLEM_JSON: {"examples": {p.slug: {"value": {
            "type": p.uri, "title": p.title, "status": p.status, "detail": p.description,
        }} for p in problems}}},
        "description": " / ".join(p.title for p in problems),
    }


def problem_response(
    problem: ProblemType,
    detail: str,
    *,
    instance: str | None = None,
    headers: dict[str, str] | None = None,
    **extensions: Any,
) -> Response:
    # Every problem answer is built here, so this counts them all, by type
    # (the 409s, 422s and 503s an operator alerts on: docs/operations.md).
    metrics.counter(metrics.PROBLEMS, problem.slug).inc()
    body = problem_body(problem, detail, instance=instance, **extensions)
    return Response(
        content=json.dumps(body, default=str),
        status_code=problem.status,
        media_type=PROBLEM_JSON,
        headers=headers,
    )


def validation_problem(exc: RequestValidationError, instance: str) -> Response:
    """400 invalid-request listing at most MAX_LISTED_ERRORS of the body's errors."""
    found = exc.errors()
    errors = [
        {"location": list(e.get("loc", ())), "message": e.get("msg", ""), "type": e.get("type", "")}
        for e in found[:MAX_LISTED_ERRORS]
    ]
    extensions: dict[str, Any] = {"errors": errors}
    if len(found) > MAX_LISTED_ERRORS:
        extensions["errors_omitted"] = len(found) - MAX_LISTED_ERRORS
    return problem_response(
        INVALID_REQUEST,
        "; ".join(f"{'.'.join(map(str, e['location']))}: {e['message']}" for e in errors)[:1000],
        instance=instance,
        **extensions,
    )


# What a request meets when the database is away: SQLAlchemy's errors, the
# driver's own (the caller lookup runs on asyncpg directly), and the bare
# socket errors that asyncpg raises, unwrapped, when it cannot connect.
DATABASE_ERRORS: tuple[type[BaseException], ...] = (
    sa.DBAPIError, sa.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError, OSError,
)
# Used when the service's settings cannot be read (the app's start-up failed).
DEFAULT_RETRY_AFTER_SECONDS = 1
# nginx's status for "the client closed the connection before the answer":
# what the request metrics record for a request whose body never came.
CLIENT_CLOSED_REQUEST = 499


def unavailable_response(request_path: str, exc: BaseException, retry_after: int) -> Response:
    """503 service-unavailable: the database could not be reached; the client should retry, same key."""
    log.warning("database unavailable on %s: %s", request_path, describe(exc))
    return problem_response(
        SERVICE_UNAVAILABLE,
        "the service cannot reach its database; retry with the same Idempotency-Key",
        instance=request_path,
        headers={"Retry-After": str(retry_after)},
    )


def retry_after_seconds(app: FastAPI) -> int:
    services = getattr(app.state, "services", None)
    return services.settings.retry_after_seconds if services else DEFAULT_RETRY_AFTER_SECONDS


def install(app: FastAPI) -> None:
    @app.exception_handler(ProblemError)
    async def _problem(request: Request, exc: ProblemError) -> Response:
        return problem_response(
            exc.problem, exc.detail, instance=request.url.path, headers=exc.headers, **exc.extensions
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        return validation_problem(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 400:
            # FastAPI's own "error parsing the body" (bytes that are not UTF-8 JSON).
            return problem_response(
                INVALID_REQUEST, str(exc.detail), instance=request.url.path,
                errors=[{"location": ["body"], "message": str(exc.detail), "type": "body_unparseable"}],
            )
        problem = {404: NOT_FOUND, 405: METHOD_NOT_ALLOWED}.get(exc.status_code)
        if problem is None:
            body = {"type": "about:blank", "title": str(exc.detail), "status": exc.status_code}
            return Response(json.dumps(body), exc.status_code, media_type=PROBLEM_JSON, headers=exc.headers)
        return problem_response(problem, str(exc.detail), instance=request.url.path, headers=exc.headers)

    async def _database(request: Request, exc: Exception) -> Response:
        if database_unavailable(exc):
            return unavailable_response(request.url.path, exc, retry_after_seconds(request.app))
        if row_moved(exc):
            # The reaper moved the key row as we wrote it; nothing was written.
            return problem_response(
                KEY_TABLE_UNAVAILABLE, "the key row was being moved; retry with the same Idempotency-Key",
                instance=request.url.path, headers={"Retry-After": str(retry_after_seconds(request.app))},
            )
        return await _bug(request, exc)  # a bad statement, a refused PSP connection: a bug's 500

    for exc_type in DATABASE_ERRORS:
        app.add_exception_handler(exc_type, _database)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # Anyone can do this as often as they like: a line with a traceback
        # each time would let them fill the log; no line would hide it.
        log.info("request body did not arrive (the client went away or was cut off): %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> Response:
        if database_unavailable(exc):
            # Raised outside the routes (in a middleware): still an outage, not a bug.
            return unavailable_response(request.url.path, exc, retry_after_seconds(request.app))
        log.error("unhandled error on %s %s\n%s", request.method, request.url.path, loggable(exc))
        return problem_response(INTERNAL_ERROR, "an unexpected error occurred", instance=request.url.path)
