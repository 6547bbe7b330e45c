"""`make screenshots`: the console's and /docs' pictures in docs/images/, made again from nothing.

Development tooling, not the service. Starts the system the one way
(devtools/system.py) in a database of its own (`payments_screenshots`,
created fresh and dropped at the end) with the fakes and an API whose console
is on, makes a few payments of every kind (paid, declined, refunded after a
rejected payout, parked, and one whose API was killed at after-call-EXT1 and
taken over by a retry), then photographs the pages with the distribution's
headless Chromium (devtools/browser.py):

    docs/images/console-operations.png   the list of recent operations
    docs/images/console-operation.png    the crashed payment: its timeline, ledger, records
    docs/images/console-parked.png       the parked queue
    docs/images/openapi-docs.png         /docs, the OpenAPI UI, served offline
"""

from __future__ import annotations

import secrets
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from devtools import browser
from devtools.bodies import payment_body
from devtools.system import System

OUT = Path(__file__).resolve().parents[1] / "docs" / "images"
DATABASE = "payments_screenshots"


def main() -> None:
    reason = browser.missing()
    if reason:
        sys.exit(f"cannot take screenshots: {reason}")
    token = secrets.token_urlsafe(32)
    with System(Path(tempfile.mkdtemp(prefix="payments-screenshots-"))) as system:
        system.start_postgres()
        system.create_database(DATABASE, drop_at_end=True)
        _, shop = system.create_client("acme-shop")
        _, market = system.create_client("globex-market")
        system.start_fakes()
        api = system.start_api("api", OPERATOR_TOKEN=token)
        one_try = system.start_api("api-one-attempt", OPERATOR_TOKEN=token, MAX_ATTEMPTS="1")
        crashed = _payments(system, api.url, one_try.url, shop, market)
        OUT.mkdir(parents=True, exist_ok=True)
        with browser.chromium(1400, 900) as chrome:
            from selenium.webdriver.common.by import By
            from selenium.webdriver.support.ui import WebDriverWait

            chrome.get(f"{api.url}/console/login?token={token}")  # sets the cookie, lands on /console
            _shoot(chrome, "console-operations.png")
            chrome.get(f"{api.url}/console/payments/{crashed}")
            _shoot(chrome, "console-operation.png", whole=True)
            chrome.get(f"{api.url}/console/parked")
            _shoot(chrome, "console-parked.png")
            chrome.get(f"{api.url}/docs")
            WebDriverWait(chrome, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, ".opblock"))
            _shoot(chrome, "openapi-docs.png", whole=True)
    print(f"screenshots in {OUT}")


def _payments(system: System, api: str, one_try: str, shop: str, market: str) -> str:
    """A few payments of every kind; the id of the one whose API died at after-call-EXT1."""
    def pay(url: str, api_key: str, body: dict, key: str | None = None) -> httpx.Response:
        return httpx.post(f"{url}/v1/payments", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": key or str(uuid.uuid4())})

    for n in range(4):
        pay(api, shop if n % 2 else market, payment_body(f"order-{1001 + n}", amount=1250 + 500 * n))
    pay(api, shop, payment_body("order-1005", card_token="tok_decline"))
    httpx.put(f"{system.rail.url}/_admin/faults", timeout=5, json={"faults": [
        {"action": "reject", "reference": "order-1006", "times": None}]}).raise_for_status()
    pay(api, market, payment_body("order-1006", amount=9900))
    httpx.put(f"{system.psp.url}/_admin/faults", timeout=5, json={"faults": [
        {"action": "error_before", "status": 500, "reference": "order-1007", "times": None}]}).raise_for_status()
    pay(one_try, shop, payment_body("order-1007", amount=4200))

    # The crash: the card is charged, then the API dies before recording it.
    doomed = system.start_api("api-doomed", PAYMENTS_CRASH_AT="after-call-EXT1", LEASE_SECONDS="1")
    key, body = f"checkout-{uuid.uuid4()}", payment_body("order-1008", amount=3150)
    try:
        pay(doomed.url, shop, body, key)
    except httpx.HTTPError:
        pass  # it died mid-request, as it should
    doomed.wait(10)
    # The retry is answered 409 request-in-progress until the dead owner's
    # 1 s lease has run out (by the database's clock); then it takes over.
    deadline = time.monotonic() + 20
    while (retried := pay(api, shop, body, key)).status_code == 409 and time.monotonic() < deadline:
        time.sleep(float(retried.headers.get("Retry-After", "1")))
    retried.raise_for_status()
    return retried.json()["id"]


def _shoot(chrome, name: str, *, whole: bool = False) -> None:
    if whole:
        # Twice: the first resize can change how the page wraps, and so its height.
        for _ in range(2):
            height = chrome.execute_script("return document.documentElement.scrollHeight")
            chrome.set_window_size(1400, min(int(height) + 160, 4000))
    chrome.save_screenshot(str(OUT / name))
    chrome.set_window_size(1400, 900)
    print(f"  {OUT / name}")


if __name__ == "__main__":
    main()
