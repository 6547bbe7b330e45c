"""The console's pages: GET only (but logging in and out), HTML, read-only.

    /console                     recent operations, filterable, paged by keyset
    /console/payments/{id}       one operation: its timeline as a diagram, the
                                 payment and what is left to refund, its ledger
                                 (balanced?), the PSP's and the rail's records
                                 for it, its refunds (each with its own timeline)
    /console/parked              the parked (indeterminate) queue, and the backlog
    /console/reconciliation      reconciliation runs and breaks
    /console/webhooks            webhook deliveries by state: dead (for a
                                 person), pending, delivered, cancelled
    /console/login, /logout      the operator token, once, for a session
                                 (app/console/sessions.py); logout ends it

Every POST is refused (403) unless it comes from the console's own pages
(auth.same_origin). Every page first reads what it needs (app/readmodel, one
SELECT each, the connection back in the pool when it returns); only the
operation page then asks the PSP and the rail (records.py), with no
connection held.

The pages read through `services.read_model` (DATABASE_READ_URL: perhaps a
standby, a moment behind the primary: docs/failover.md#reads-on-a-standby).
Logging in, the session check of every request and logging out use
`services.engine`, the primary, always: a session revoked on the primary
but still open on a lagging standby would outlive its logout.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs, urlencode

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import RedirectResponse, Response
from fastapi.templating import Jinja2Templates
from jinja2 import Environment, PackageLoader, StrictUndefined

from app.console import auth, records, sessions, timeline
from app.db.transaction import atomic, one_statement, read
from app.payments.models import CURRENCIES
from app.payments.recovery_points import ALL as RECOVERY_POINTS
from app.problems import CROSS_ORIGIN_REQUEST, ProblemError
from app.readmodel import queries
from app.services import Services

# No script may run on these pages (there is none), nothing may frame them,
# and forms post only here: an injected tag could neither run nor send
# anything elsewhere. The pages are never cached: they show live money.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _ts(value: Any) -> str:
    """A timestamp as UTC, to the millisecond: what the database's clock said."""
    if value is None:
        return "-"
    when = value if isinstance(value, datetime) else datetime.fromisoformat(str(value))
    return when.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _money(minor: Any, currency: str | None) -> str:
    if minor is None or currency is None:
        return "-"
    exponent = CURRENCIES.get(currency, 2)
    return f"{int(minor) / 10**exponent:,.{exponent}f} {currency}"


def _masked(iban: str | None) -> str:
    return "-" if not iban else f"{iban[:4]}…{iban[-4:]}"


environment = Environment(
    loader=PackageLoader("app.console", "templates"),
    # Every value a page shows came from a row or from a rail, and may hold
    # anything a client sent (a reference, a name): all of it is escaped.
    autoescape=True,
    undefined=StrictUndefined,
)
environment.filters.update(ts=_ts, money=_money, masked=_masked)
templates = Jinja2Templates(env=environment)

class Refusal(Exception):
    """A page that is not shown: the console is disabled, or the caller is not the operator."""

    def __init__(self, response: Response) -> None:
        self.response = response


async def from_the_console(request: Request) -> None:
    """Every console route's first check: a POST from another site or origin is refused (403), and changes nothing.

    A ProblemError, answered as problem+json by the app's own handler (app/api/errors.py)."""
    if not auth.same_origin(request.method, request.headers):
        raise ProblemError(
            CROSS_ORIGIN_REQUEST, f"{request.method} {request.url.path} came from another site or origin",
            headers={"Cache-Control": "no-store"},
        )


# On the router, so that a POST added later is checked as well.
router = APIRouter(prefix="/console", include_in_schema=False, dependencies=[Depends(from_the_console)])


def page(request: Request, name: str, context: dict[str, Any], status_code: int = 200) -> Response:
    return templates.TemplateResponse(request, name, context, status_code=status_code, headers=HEADERS)


def services_of(request: Request) -> Services:
    return request.app.state.services


async def operator(request: Request) -> Services:
    """The services, if the caller holds the operator token (header) or a live session (cookie); else refused."""
    services = services_of(request)
    token = services.settings.operator_token
    if token is None:
        raise Refusal(page(request, "disabled.html", {}, 404))
    if auth.is_operator_token(auth.bearer(request.headers.get("authorization")), token):
        return services
    cookie = request.cookies.get(auth.COOKIE)
    if cookie and await read(services.engine, sessions.is_open, cookie, token):
        return services
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    raise Refusal(page(request, "login.html", {"next": here, "error": None}, 401))


Operator = Depends(operator)


# -- logging in ------------------------------------------------------------------------------------


async def _logged_in(request: Request, services: Services, target: str | None) -> Response:
    """A new session, and its id in a cookie. Secure when the request came over TLS: to uvicorn directly,
    or through a proxy in FORWARDED_ALLOW_IPS that said so in X-Forwarded-Proto (uvicorn then sets the scheme)."""
    settings = services.settings
    assert settings.operator_token is not None
    seconds = settings.console_session_seconds
    session_id = await atomic(services.engine, sessions.open_session, settings.operator_token, seconds)
    response = RedirectResponse(auth.safe_next(target), status_code=303, headers=HEADERS)
    response.set_cookie(
        auth.COOKIE, session_id, max_age=seconds,
        path="/console", httponly=True, samesite="strict", secure=request.url.scheme == "https",
    )
    return response


@router.get("/login")
async def login_form(request: Request, token: str | None = None, next: str | None = None) -> Response:
    """The login form; with `?token=` (the link `make run` prints), log in at once.

    The token then leaves the address bar at once (a redirect), but it has
    been in a URL: a proxy's access log or the browser's history may keep it.
    On a shared deployment, use the form or the Bearer header instead.
    """
    services = services_of(request)
    configured = services.settings.operator_token
    if configured is None:
        return page(request, "disabled.html", {}, 404)
    if token is not None:
        if auth.is_operator_token(token, configured):
            return await _logged_in(request, services, next)
        return page(request, "login.html", {"next": auth.safe_next(next), "error": "That is not the operator token."}, 401)
    return page(request, "login.html", {"next": auth.safe_next(next), "error": None})


@router.post("/login")
async def login(request: Request) -> Response:
    services = services_of(request)
    configured = services.settings.operator_token
    if configured is None:
        return page(request, "disabled.html", {}, 404)
    # A urlencoded form, parsed here (the body is capped at 16 KiB upstream,
    # app/api/body_limit.py): no multipart parser for one field.
    form = parse_qs((await request.body()).decode("utf-8", "replace"), max_num_fields=4)
    given = (form.get("token") or [None])[0]
    target = (form.get("next") or [None])[0]
    if auth.is_operator_token(given, configured):
        return await _logged_in(request, services, target)
    return page(request, "login.html", {"next": auth.safe_next(target), "error": "That is not the operator token."}, 401)


@router.post("/logout")
async def logout(request: Request) -> Response:
    """End the session at once (its cookie opens nothing from now on), and delete the cookie."""
    services = services_of(request)
    if services.settings.operator_token is not None:
        await one_statement(services.engine, sessions.revoke, request.cookies.get(auth.COOKIE))
    response = RedirectResponse("/console/login", status_code=303, headers=HEADERS)
    response.delete_cookie(auth.COOKIE, path="/console", httponly=True, samesite="strict")
    return response


# -- the pages -------------------------------------------------------------------------------------


def _filters(request: Request) -> tuple[queries.Filters, uuid.UUID | None, list[str]]:
    """The list's filters from the query string; what could not be understood is reported, not guessed."""
    q = request.query_params
    problems: list[str] = []
    state = q.get("state") or None
    if state is not None and state not in queries.STATES:
        problems.append(f"state must be one of {', '.join(queries.STATES)}")
        state = None
    point = q.get("recovery_point") or None
    if point is not None and point not in RECOVERY_POINTS:
        problems.append(f"recovery point must be one of {', '.join(RECOVERY_POINTS)}")
        point = None
    client_id = None
    if q.get("client"):
        try:
            client_id = int(q["client"])
        except ValueError:
            problems.append("client must be a client id")
    parked = {"yes": True, "no": False}.get(q.get("parked") or "", None)
    if q.get("parked") and parked is None:
        problems.append("parked must be yes or no")
    before = None
    if q.get("before"):
        try:
            before = uuid.UUID(q["before"])
        except ValueError:
            problems.append("before must be a payment id")
    return queries.Filters(state, point, client_id, parked), before, problems


@router.get("")
async def operations(request: Request, services: Services = Operator) -> Response:
    filters, before, problems = _filters(request)
    result = await read(services.read_model, queries.operations, filters, before=before)
    clients = await read(services.read_model, queries.clients)
    chosen = {k: v for k, v in request.query_params.items() if k != "before" and v}
    older = None
    if result.older is not None:
        older = "/console?" + urlencode({**chosen, "before": str(result.older)})
    return page(request, "operations.html", {
        "nav": "operations", "page": result, "filters": filters, "chosen": chosen, "older": older,
        "first_page": before is None, "newest": "/console?" + urlencode(chosen) if chosen else "/console",
        "clients": clients, "states": queries.STATES, "recovery_points": RECOVERY_POINTS, "problems": problems,
        "page_size": queries.PAGE_SIZE,
    }, 400 if problems else 200)


@router.get("/payments/{payment_id}")
async def operation(request: Request, payment_id: str, services: Services = Operator) -> Response:
    try:
        pid = uuid.UUID(payment_id)
    except ValueError:
        pid = None
    found = pid and await read(services.read_model, queries.operation, pid)
    if not found:
        return page(request, "not_found.html", {"nav": "operations", "what": f"payment {payment_id}"}, 404)
    # The reads are done and their connection is back in the pool: only now the PSP and the rail.
    deduplicates = services.rail.deduplicates(_IbanOnly(found.payment.get("beneficiary_iban", "")))
    events = await read(services.read_model, queries.payment_events, pid)
    held = await records.records(services.psp, services.rail, found.payment, rail_deduplicates=deduplicates,
                                 refunds=found.refunds)
    diagram = timeline.layout(found.timeline, found.payment, finished=found.row.state == "finished",
                              lease_live=found.row.lease_live)
    # Each refund's own key row drawn the same way, its K5 read from the refund
    # row; none once the key is reaped (the refund row stays, its history goes).
    refunds = [(r, None if r["key_row"] is None else timeline.layout(
        r["key_row"]["timeline"], r, finished=r["key_row"]["state"] == "finished",
        lease_live=r["key_row"]["lease_live"])) for r in found.refunds]
    return page(request, "operation.html", {
        "nav": "operations", "op": found, "p": found.payment, "records": held, "diagram": diagram,
        "legacy": not deduplicates, "events": events, "refunds": refunds,
    })


class _IbanOnly:
    """What Rail.deduplicates reads of a payment."""

    def __init__(self, iban: str) -> None:
        self.beneficiary_iban = iban


@router.get("/parked")
async def parked(request: Request, services: Services = Operator) -> Response:
    rows, total = await read(services.read_model, queries.parked)
    backlog = await read(services.read_model, queries.backlog)
    return page(request, "parked.html", {"nav": "parked", "rows": rows, "total": total, "backlog": backlog})


@router.get("/reconciliation")
async def reconciliation(request: Request, services: Services = Operator) -> Response:
    runs = await read(services.read_model, queries.runs)
    breaks = await read(services.read_model, queries.breaks)
    return page(request, "reconciliation.html", {"nav": "reconciliation", "runs": runs, "breaks": breaks})


@router.get("/webhooks")
async def webhooks(request: Request, state: str = "dead", services: Services = Operator) -> Response:
    if state not in queries.DELIVERY_STATES:
        state = "dead"
    limit = 100
    rows = await read(services.read_model, queries.deliveries, state, limit=limit)
    undelivered = await read(services.read_model, queries.undelivered)
    return page(request, "webhooks.html", {
        "nav": "webhooks", "rows": rows, "state": state, "states": queries.DELIVERY_STATES,
        "undelivered": undelivered, "limit": limit,
    })


def install(app: FastAPI) -> None:
    """Mount the console on `app`: its routes, and its refusals answered as pages."""

    async def refused(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, Refusal)
        return exc.response

    app.add_exception_handler(Refusal, refused)
    app.include_router(router)

