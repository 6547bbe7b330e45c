"""The console as a person sees it, in a real browser, after a crash.

A payment's API process dies at after-call-EXT1 (the card is charged, our
database does not know it); after its lease runs out a retry on another API
takes it over, probes the PSP by K1, finds that very charge and finishes the
payment. Then headless Chromium (the distribution's package, through its
chromedriver) logs into the console with the operator token, finds the
operation in the list, opens it, and reads what a person would read: the
takeover on the timeline, the balanced ledger, and the PSP's and the rail's
records, which are the ones our payment row names.

Skipped, with the reason in the run's summary, where no browser is installed.
"""

from __future__ import annotations

import uuid

import httpx
import pytest

from devtools import browser
from tests.console.conftest import OPERATOR_TOKEN
from tests.support import headers, key_row, payment_body, until

pytestmark = pytest.mark.skipif(browser.missing() is not None, reason=f"no browser to drive: {browser.missing()}")


async def test_a_person_sees_the_takeover_the_balanced_ledger_and_the_rails_records_after_a_crash(
    http, db, acme, processes, console_api
):
    from selenium.webdriver.common.by import By

    key, body = str(uuid.uuid4()), payment_body()
    doomed = processes.api("doomed", PAYMENTS_CRASH_AT="after-call-EXT1", LEASE_SECONDS="1")
    with pytest.raises(httpx.HTTPError):
        await http.post(f"{doomed.url}/v1/payments", json=body, headers=headers(acme, key))
    assert doomed.popen.wait(10) == 137

    async def lease_expired() -> bool:
        return await db.fetchval(
            "SELECT lease_expires_at < now() FROM idempotency_key WHERE client_id = $1 AND key = $2", acme.id, key)

    await until(lease_expired, "the dead owner's lease to run out")
    retry = await http.post(f"{console_api.url}/v1/payments", json=body, headers=headers(acme, key))
    assert retry.status_code == 201, retry.text
    row = await key_row(db, acme.id, key)
    payment = await db.fetchrow("SELECT * FROM payment WHERE id = $1", row["payment_id"])

    with browser.chromium() as chrome:
        chrome.get(f"{console_api.url}/console")
        assert chrome.find_element(By.NAME, "token").is_displayed(), "a person is asked for the token first"
        chrome.find_element(By.NAME, "token").send_keys(OPERATOR_TOKEN)
        chrome.find_element(By.ID, "login").click()

        # A click that submits a form or follows a link returns before the
        # next page is there: wait for that page, as a person waits for it
        # to load.
        page_shows(chrome, "h1", "Recent operations")
        chrome.find_element(By.LINK_TEXT, key).click()

        page_shows(chrome, "#key", key)
        assert chrome.find_element(By.ID, "attempts").text == "2"
        drawn = [t.text for t in chrome.find_elements(By.CSS_SELECTOR, "svg#timeline text")]
        assert "taken over" in drawn
        assert "attempt 2 takes over from attempt 1 (its lease had run out)" in drawn
        assert "no outcome recorded: this attempt died or stalled past its lease" in drawn
        assert f"succeeded · {payment['psp_charge_id']}" in drawn, "the resumer recorded the charge it found"
        assert chrome.find_element(By.ID, "ledger-check").text == "balanced"
        charge = chrome.find_element(By.CSS_SELECTOR, "#records tr.charge").text
        transfer = chrome.find_element(By.CSS_SELECTOR, "#records tr.transfer").text
        assert payment["psp_charge_id"] in charge and "the same record" in charge
        assert payment["rail_transfer_id"] in transfer and "accepted" in transfer and "the same record" in transfer


def page_shows(chrome, selector: str, text: str, timeout: float = 15.0) -> None:
    """Wait until the element at CSS `selector` of the page being loaded says `text`.

    The page reads its own text in one script, so no element handle is kept
    from one call to the next: a handle found on the old page and read after
    the new one replaced it is stale, and Chromium's driver does not always
    say so as a stale element (sometimes it answers "Node with given id does
    not belong to the document", an unknown error).
    """
    from selenium.common.exceptions import JavascriptException
    from selenium.webdriver.support.ui import WebDriverWait

    read = "const e = document.querySelector(arguments[0]); return e === null ? null : e.innerText.trim();"
    WebDriverWait(chrome, timeout, ignored_exceptions=(JavascriptException,)).until(
        lambda driver: driver.execute_script(read, selector) == text,
        f"the page to show {text!r} in {selector}",
    )
