"""Console sessions that end, and console forms that only the console can post.

Each test drives a running API (and, for the proxy, a running nginx) over
HTTP, as a browser would: a login opens a server-side session
(app/console/sessions.py) whose cookie holds a fresh random id; logging out,
its expiry and a new OPERATOR_TOKEN each end it at once; the cookie is
Secure only when a trusted proxy says the client came over TLS; a POST from
another site or origin is refused (app/console/auth.py::same_origin).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import tempfile
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import pytest

from devtools import nginx
from devtools.processes import Process
from devtools.system import System
from tests.console.conftest import OPERATOR_TOKEN

LOGIN = {"token": OPERATOR_TOKEN, "next": "/console/parked"}


def cookie_of(response: httpx.Response) -> SimpleCookie:
    assert response.status_code == 303, response.text
    jar = SimpleCookie()
    jar.load(response.headers["set-cookie"])
    return jar


async def log_in(url: str, token: str = OPERATOR_TOKEN, **client: object) -> str:
    """The session cookie's value of a fresh login at `url`."""
    async with httpx.AsyncClient(base_url=url, **client) as browser:
        response = await browser.post("/console/login", data={"token": token, "next": "/console/parked"})
    return cookie_of(response)["console_session"].value


async def opens(url: str, session: str) -> bool:
    """The cookie opens the console (else the login form is shown, 401)."""
    async with httpx.AsyncClient(base_url=url, cookies={"console_session": session}) as browser:
        response = await browser.get("/console/parked")
    assert response.status_code in (200, 401), response.status_code
    if response.status_code == 401:
        assert 'name="token"' in response.text, "a person is shown the login form"
    return response.status_code == 200


async def test_each_login_is_a_fresh_random_session_of_which_the_server_keeps_only_a_hash(console_api, db):
    first, second = await log_in(console_api.url), await log_in(console_api.url)
    assert first != second, "a new id for every login"
    assert len(first) >= 43, "256 random bits"
    assert await opens(console_api.url, first) and await opens(console_api.url, second)
    rows = await db.fetch("SELECT * FROM console_session")
    assert {bytes(r["id_hash"]) for r in rows} == {hashlib.sha256(s.encode()).digest() for s in (first, second)}
    assert all(r["revoked_at"] is None for r in rows)
    # An old-style cookie (the token's HMAC, the same on every login) opens nothing.
    old_style = hmac.new(OPERATOR_TOKEN.encode(), b"exactly-once-payments operator console session v1",
                         hashlib.sha256).hexdigest()
    assert not await opens(console_api.url, old_style)


async def test_after_logout_the_old_cookie_opens_nothing(console_api, db):
    session = await log_in(console_api.url)
    other = await log_in(console_api.url)
    async with httpx.AsyncClient(base_url=console_api.url, cookies={"console_session": session}) as browser:
        out = await browser.post("/console/logout")
    assert out.status_code == 303 and out.headers["location"] == "/console/login"
    assert 'console_session=""' in out.headers["set-cookie"], "the browser is told to drop it"
    # A copy of the cookie kept anywhere (another tab, a stolen copy) is dead too.
    assert not await opens(console_api.url, session)
    async with httpx.AsyncClient(base_url=console_api.url, cookies={"console_session": session}) as browser:
        page = await browser.get("/console", follow_redirects=False)
    assert page.status_code == 401 and 'name="token"' in page.text
    assert await db.fetchval("SELECT revoked_at IS NOT NULL FROM console_session WHERE id_hash = $1",
                             hashlib.sha256(session.encode()).digest())
    assert await opens(console_api.url, other), "only that session ended"


async def test_a_session_lasts_console_session_seconds_and_an_expired_one_is_refused(console_api, db):
    session = await log_in(console_api.url)
    async with httpx.AsyncClient(base_url=console_api.url) as browser:
        response = await browser.post("/console/login", data=LOGIN)
    assert cookie_of(response)["console_session"]["max-age"] == str(12 * 3600), "the documented default"
    lasts = await db.fetchval("SELECT expires_at - created_at FROM console_session WHERE id_hash = $1",
                              hashlib.sha256(session.encode()).digest())
    assert lasts.total_seconds() == 12 * 3600
    assert await opens(console_api.url, session)
    # Its time is up (moved back rather than waited for).
    await db.execute(
        "UPDATE console_session SET created_at = now() - interval '13 hours', expires_at = now() - interval '1 hour' "
        "WHERE id_hash = $1", hashlib.sha256(session.encode()).digest(),
    )
    assert not await opens(console_api.url, session)


async def test_console_session_seconds_sets_how_long_a_session_lasts(
    system: System, stack, db, tmp_path_factory: pytest.TempPathFactory
):
    scoped = system.scope(tmp_path_factory.mktemp("short-sessions"))
    try:
        api = scoped.start_api("api-short-sessions", OPERATOR_TOKEN=OPERATOR_TOKEN, CONSOLE_SESSION_SECONDS="600")
        async with httpx.AsyncClient(base_url=api.url) as browser:
            response = await browser.post("/console/login", data=LOGIN)
        session = cookie_of(response)["console_session"]
        assert session["max-age"] == "600"
        lasts = await db.fetchval("SELECT expires_at - created_at FROM console_session WHERE id_hash = $1",
                                  hashlib.sha256(session.value.encode()).digest())
        assert lasts.total_seconds() == 600
    finally:
        scoped.stop()


async def test_a_new_operator_token_ends_every_session_made_under_the_old_one(
    system: System, stack, console_api: Process, tmp_path_factory: pytest.TempPathFactory
):
    session = await log_in(console_api.url)
    assert await opens(console_api.url, session)
    # The API restarted with another token, against the same database.
    new_token = secrets.token_urlsafe(32)
    scoped = system.scope(tmp_path_factory.mktemp("new-token"))
    try:
        restarted = scoped.start_api("api-new-token", OPERATOR_TOKEN=new_token)
        assert not await opens(restarted.url, session), "a session of the old token is dead under the new one"
        assert await opens(console_api.url, session), "refused for its token, not for anything else"
        fresh = await log_in(restarted.url, new_token)
        assert await opens(restarted.url, fresh)
        assert not await opens(console_api.url, fresh), "and the other way round"
        # The new token's first login purged the old token's sessions: they could never open anything again.
        assert not await opens(console_api.url, session)
    finally:
        scoped.stop()


async def test_the_cookie_is_secure_when_a_trusted_proxy_says_https_and_only_then(console_api):
    async def cookie(headers: dict[str, str], local_address: str = "127.0.0.1") -> SimpleCookie:
        transport = httpx.AsyncHTTPTransport(local_address=local_address)
        async with httpx.AsyncClient(base_url=console_api.url, transport=transport) as browser:
            return cookie_of(await browser.post("/console/login", data=LOGIN, headers=headers))

    # 127.0.0.1 is in FORWARDED_ALLOW_IPS by default: a proxy there is believed.
    assert (await cookie({"X-Forwarded-Proto": "https"}))["console_session"]["secure"] is True
    assert not (await cookie({}))["console_session"]["secure"], "plain http: a Secure cookie would never come back"
    # 127.0.0.2 is not trusted: what it says about TLS is not believed.
    assert not (await cookie({"X-Forwarded-Proto": "https"}, "127.0.0.2"))["console_session"]["secure"]


# nginx is the distribution's package, which `make test` must not need: without
# it this test is skipped with its reason in the summary (.ci/run installs it).
@pytest.mark.skipif(nginx.missing(), reason=nginx.INSTALL_HINT)
async def test_behind_nginx_the_scheme_is_nginx_s_and_a_client_cannot_claim_https(
    system: System, console_api: Process, tmp_path_factory: pytest.TempPathFactory
):
    scoped = system.scope(tmp_path_factory.mktemp("nginx-console"))
    # Not under pytest's own temporary root: every pytest run on the machine
    # makes that private again, and nginx runs as nobody when we are root.
    directory = tempfile.TemporaryDirectory(prefix="console-nginx-")
    try:
        balancer = scoped.start_nginx([console_api], Path(directory.name))
        async with httpx.AsyncClient(base_url=balancer.url) as browser:
            response = await browser.post("/console/login", data=LOGIN, headers={"X-Forwarded-Proto": "https"})
            session = cookie_of(response)["console_session"]
            assert not session["secure"], "nginx listens on plain http and says so: a client's claim is replaced"
            # A browser posting from the page it was served through nginx (its Origin names nginx's port).
            same = await browser.post("/console/logout", headers={"Origin": balancer.url})
            assert same.status_code == 303
        assert not await opens(console_api.url, session.value), "that logout ended the session"
    finally:
        scoped.stop()
        directory.cleanup()


@pytest.mark.parametrize("headers", [
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
    {"Origin": "https://evil.example"},
    {"Origin": "null"},
    {"Origin": "http://127.0.0.1:1"},  # the same host on another port is another origin
], ids=["cross-site", "same-site", "other-origin", "null-origin", "other-port"])
async def test_a_console_post_from_another_site_is_refused_and_changes_nothing(console_api, db, headers):
    session = await log_in(console_api.url)
    before = await db.fetch("SELECT * FROM console_session ORDER BY id_hash")
    async with httpx.AsyncClient(base_url=console_api.url, cookies={"console_session": session}) as browser:
        for path, data in (("/console/logout", None), ("/console/login", LOGIN)):
            response = await browser.post(path, data=data, headers=headers)
            assert response.status_code == 403, (path, response.text)
            assert response.headers["content-type"] == "application/problem+json"
            assert response.json()["type"] == "/problems/cross-origin-request"
            assert "set-cookie" not in response.headers
    assert [dict(r) for r in await db.fetch("SELECT * FROM console_session ORDER BY id_hash")] == [
        dict(r) for r in before
    ], "no session ended, none opened"
    assert await opens(console_api.url, session)


@pytest.mark.parametrize("headers", [
    {"Sec-Fetch-Site": "same-origin"},
    {"Sec-Fetch-Site": "none"},
    "own-origin",
    {},  # curl, a script: no browser, so no other site behind it
], ids=["same-origin", "user-typed", "own-origin", "no-browser"])
async def test_a_console_post_from_the_console_itself_is_accepted(console_api, headers):
    if headers == "own-origin":
        headers = {"Origin": console_api.url}
    async with httpx.AsyncClient(base_url=console_api.url) as browser:
        response = await browser.post("/console/login", data=LOGIN, headers=headers)
        session = cookie_of(response)["console_session"].value
        assert await opens(console_api.url, session)
        out = await browser.post("/console/logout", headers=headers)
        assert out.status_code == 303
    assert not await opens(console_api.url, session)
