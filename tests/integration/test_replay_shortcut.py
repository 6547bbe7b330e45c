"""The replay shortcut (app/fastpath/replay_shortcut.py): it answers only what it is sure of.

Two halves. Over HTTP, against the real API processes: a replay is the same
bytes whether the shortcut or the full path answers it. In process, against
the real database: the middleware is called directly, in front of a stand-in
for the rest of the application that records whether it was reached, so each
test can tell who answered. The shortcut must answer a retry of a finished
payment itself, and pass everything else on with its body intact and its
read handed over.
"""

from __future__ import annotations

import json
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from fastapi.security import HTTPAuthorizationCredentials

from app.api import deps
from app.authentication import CallerLookup, PaymentCaller
from app.config import Settings
from app.fastpath.lookup_pool import LookupPool
from app.fastpath.replay_shortcut import ReplayShortcut, bearer_api_key
from app.problems import ProblemError
from tests.support import charges, headers, key_row, payment_body, transfers

pytestmark = pytest.mark.usefixtures("stack")


@pytest.fixture
async def finished(http, stack, acme) -> dict[str, Any]:
    """A payment that has finished: its key, its body, and the response it got."""
    key, body = str(uuid.uuid4()), payment_body()
    response = await http.post(f"{stack.api}/v1/payments", json=body, headers=headers(acme, key))
    assert response.status_code == 201, response.text
    return {"key": key, "body": body, "response": response}


def _without_date(response) -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in response.headers.multi_items() if k != "date")


async def test_a_replay_is_the_same_bytes_whichever_path_answers_it(http, stack, db, acme, finished):
    url, key, body = f"{stack.api}/v1/payments", finished["key"], finished["body"]
    # The same JSON spelt differently: keys reordered, spaces added.
    respelt = json.dumps(dict(reversed(list(body.items()))), indent=2).encode()
    shortcut = await http.post(url, content=respelt, headers={**headers(acme, key), "Content-Type": "application/json"})

    async def chunks():  # no Content-Length: the shortcut passes it on, the full path answers
        yield respelt[:40]
        yield respelt[40:]

    full_path = await http.post(url, content=chunks(), headers={**headers(acme, key), "Content-Type": "application/json"})

    for replay in (shortcut, full_path):
        assert replay.status_code == 201
        assert replay.content == finished["response"].content
        assert replay.headers["Idempotent-Replayed"] == "true"
    assert _without_date(shortcut) == _without_date(full_path)
    assert len(await charges(db, body["reference"])) == 1


# --- In process: the middleware itself, on the real database -------------------------------------


class _Rest:
    """Stands in for everything behind the shortcut: notes each request and the body it receives."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def __call__(self, scope, receive, send) -> None:
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.calls.append({"scope": scope, "body": body})
        await send({"type": "http.response.start", "status": 299, "headers": []})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture
async def shortcut(database_url):
    rest = _Rest()
    app = SimpleNamespace(state=SimpleNamespace())
    async with LookupPool(Settings(database_url=database_url)) as lookups:
        yield ReplayShortcut(rest, lookups), rest, app


async def _call(shortcut, body: bytes, header_list: list[tuple[str, str]], *, method="POST",
                path="/v1/payments", chunk: int | None = None) -> tuple[int, dict[str, str], bytes, dict]:
    """One request through the middleware: (status, headers, body, the scope it ran with)."""
    middleware, _, app = shortcut
    scope = {"type": "http", "method": method, "path": path, "app": app,
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in header_list]}
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] if chunk else [body]
    messages = [{"type": "http.request", "body": p, "more_body": n < len(pieces) - 1} for n, p in enumerate(pieces)]
    sent: list[dict] = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    await middleware(scope, receive, send)
    start = sent[0]
    return (start["status"], {k.decode(): v.decode() for k, v in start["headers"]},
            b"".join(m.get("body", b"") for m in sent[1:]), scope)


def _headers(client, key: str | None, body: bytes, **extra: str) -> list[tuple[str, str]]:
    return [*headers(client, key).items(), ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))), *extra.items()]


@pytest.mark.parametrize("chunk", [None, 7], ids=["one message", "in 7-byte pieces"])
async def test_a_retry_of_a_finished_payment_is_answered_by_the_shortcut_alone(
    shortcut, db, acme, finished, chunk
):
    body = json.dumps(finished["body"], indent=1).encode()
    row_before = await key_row(db, acme.id, finished["key"])
    status, sent_headers, content, _ = await _call(shortcut, body, _headers(acme, finished["key"], body), chunk=chunk)

    assert status == 201 and content == finished["response"].content
    assert sent_headers["idempotent-replayed"] == "true"
    assert sent_headers["content-type"] == "application/json"
    assert shortcut[1].calls == []  # the rest of the application never saw it
    # A replay is a read: the key row is as it was, and the PSP and the rail saw nothing.
    assert await key_row(db, acme.id, finished["key"]) == row_before
    assert len(await charges(db, finished["body"]["reference"])) == 1
    assert len(await transfers(db, finished["body"]["reference"])) == 1


async def test_a_retry_with_a_different_body_goes_on_with_the_read_handed_over(shortcut, acme, finished):
    body = json.dumps({**finished["body"], "amount": 999}).encode()
    status, _, _, scope = await _call(shortcut, body, _headers(acme, finished["key"], body))

    assert status == 299
    [call] = shortcut[1].calls
    assert call["body"] == body
    lookup = scope["state"]["caller_lookup"]
    assert (lookup.api_key, lookup.key, lookup.caller.client_id) == (acme.api_key, finished["key"], acme.id)
    assert lookup.caller.row.state == "finished"  # the full path will answer 422 from this very row


async def test_a_new_key_and_an_unknown_api_key_go_on_with_what_was_found(shortcut, acme, finished):
    body = json.dumps(payment_body()).encode()
    await _call(shortcut, body, _headers(acme, str(uuid.uuid4()), body))
    stranger = SimpleNamespace(auth={"Authorization": "Bearer not-a-key-of-anyone"})
    await _call(shortcut, body, _headers(stranger, finished["key"], body))

    new_key, unknown = shortcut[1].calls
    assert new_key["body"] == unknown["body"] == body
    assert new_key["scope"]["state"]["caller_lookup"].caller.client_id == acme.id
    assert new_key["scope"]["state"]["caller_lookup"].caller.row is None
    assert unknown["scope"]["state"]["caller_lookup"].caller is None  # the full path answers 401


PASSED_ON = {
    "another path": dict(path="/v1/payments/x"),
    "another method": dict(method="PUT"),
    "no Idempotency-Key": dict(key=None),
    "an invalid Idempotency-Key": dict(key="white space"),
    "Idempotency-Key sent twice": dict(extra=[("Idempotency-Key", "other")]),
    "no Authorization": dict(auth=False),
    "a Basic Authorization": dict(auth_value="Basic YTpi"),
    "text/plain": dict(content_type="text/plain"),
    "no Content-Length": dict(length=None),
    "a body longer than its Content-Length": dict(length_delta=-1),
    "not JSON": dict(body=b"{not json"),
    "not UTF-8": dict(body=b'{"amount": "\xff"}'),
    "not a payment request": dict(body=b'{"amount": -5}'),
    "nested too deeply for json.loads": dict(body=b"[" * 8_000 + b"]" * 8_000),
}


@pytest.mark.parametrize("case", PASSED_ON.values(), ids=PASSED_ON.keys())
async def test_anything_it_is_not_sure_of_goes_on_untouched(shortcut, acme, finished, case):
    body = case.get("body", json.dumps(finished["body"]).encode())
    header_list = [("Content-Type", case.get("content_type", "application/json"))]
    if case.get("auth", True):
        header_list.append(("Authorization", case.get("auth_value", f"Bearer {acme.api_key}")))
    if (key := case.get("key", finished["key"])) is not None:
        header_list.append(("Idempotency-Key", key))
    if "length" not in case:
        header_list.append(("Content-Length", str(len(body) + case.get("length_delta", 0))))
    header_list += case.get("extra", [])

    status, _, _, _ = await _call(shortcut, body, header_list, method=case.get("method", "POST"),
                                  path=case.get("path", "/v1/payments"), chunk=50_000)

    assert status == 299  # answered by the rest of the application
    [call] = shortcut[1].calls
    assert call["body"] == body  # every byte, as sent


def test_a_lookup_handed_over_is_used_only_for_the_same_api_key_and_key():
    lookup = CallerLookup("api-key", "key-1", None)
    request = Request({"type": "http", "state": {deps.HANDED_OVER: lookup}})

    assert deps.handed_over(request, "api-key", "key-1") is lookup
    assert deps.handed_over(request, "api-key", '"key-1"') is lookup  # the same key, quoted
    assert deps.handed_over(request, "api-key", "key-2") is None
    assert deps.handed_over(request, "api-key", "white space") is None
    assert deps.handed_over(request, "api-key", None) is None
    assert deps.handed_over(request, "other-api-key", "key-1") is None
    assert deps.handed_over(request, None, "key-1") is None
    assert deps.handed_over(Request({"type": "http"}), "api-key", "key-1") is None


async def test_the_full_path_takes_the_handed_over_lookup_instead_of_reading_again():
    """Catches: a hand-over that is made but never used, which would cost every new payment a second read."""
    caller = PaymentCaller(7, "key-1", None)
    request = Request({"type": "http", "state": {deps.HANDED_OVER: CallerLookup("api-key", "key-1", caller)}})
    credentials = HTTPAuthorizationCredentials(scheme="Bearer", credentials="api-key")

    # No services: a read would fail.
    assert await deps.payment_caller(request, None, credentials, "key-1") is caller
    unknown = Request({"type": "http", "state": {deps.HANDED_OVER: CallerLookup("api-key", "key-1", None)}})
    with pytest.raises(ProblemError) as refused:
        await deps.payment_caller(unknown, None, credentials, "key-1")
    assert refused.value.problem.status == 401


@pytest.mark.parametrize(
    "authorization",
    ["Bearer abc", "bearer abc", "BEARER  abc  ", "Bearer a b", "Basic abc", "Bearer", "Bearer ", "", None,
     "Bearer " + "x" * 201],
)
async def test_the_shortcut_reads_the_api_key_exactly_as_the_route_does(authorization):
    raw = [] if authorization is None else [(b"authorization", authorization.encode())]
    credentials = await deps._bearer(Request({"type": "http", "headers": raw}))

    assert bearer_api_key(authorization) == deps.api_key_of(credentials)


def test_replay_shortcut_false_leaves_replays_to_the_route(database_url):
    """The shortcut is an optimisation that can be switched off; the route then answers replays.

    Catches: the middleware installed whatever REPLAY_SHORTCUT says (the idea
    could then not be studied, or measured, without the optimisation).
    """
    from app.main import create_app

    on, off = (create_app(Settings(database_url=database_url, replay_shortcut=s)) for s in (True, False))

    assert ReplayShortcut in [m.cls for m in on.user_middleware]
    assert ReplayShortcut not in [m.cls for m in off.user_middleware]
    # No dependency is overridden either way: an override makes FastAPI build
    # every dependency's description again on every request
    # (docs/reference/performance.md#before-and-after-the-machine-refactor).
    assert on.dependency_overrides == {} and off.dependency_overrides == {}


def test_the_stacks_second_api_answers_replays_through_the_route(stack):
    """The harness really starts apis[1] with REPLAY_SHORTCUT=false, so tests that retry there cross the route.

    Catches: a harness that drops the setting, which would let every "both
    paths" test pass through the shortcut twice.
    """
    def environ(process) -> dict[str, str]:
        raw = open(f"/proc/{process.popen.pid}/environ", "rb").read().split(b"\0")
        return dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    assert environ(stack.apis[0])["REPLAY_SHORTCUT"] == "true"
    assert environ(stack.apis[1])["REPLAY_SHORTCUT"] == "false"
