"""Development tooling, not the service: the distribution's headless Chromium, driven by selenium.

For the console's browser test (tests/console/test_console_in_a_browser.py)
and `make screenshots` (devtools/screenshots.py). It uses the Debian packages
`chromium` and `chromium-driver` (`apt-get install chromium chromium-driver`),
never a browser or a driver downloaded by selenium: both paths are given, so
selenium has nothing to look up. Each browser gets a fresh profile directory,
removed when it closes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")
# Flags that work in a container as root with no display and no network
# (--no-sandbox: Chromium's sandbox refuses to start as root).
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars")


def _first(paths: tuple[str, ...]) -> str | None:
    return next((p for p in paths if Path(p).is_file()), None)


def missing() -> str | None:
    """Why no browser can be driven here (None: one can): a sentence for a skipped test."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (make install)"
    if _first(CHROMIUM) is None:
        return "no Chromium here: apt-get install chromium chromium-driver"
    if _first(CHROMEDRIVER) is None:
        return "no chromedriver here: apt-get install chromium-driver"
    return None


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator["WebDriver"]:  # noqa: F821
    """A headless Chromium at `width` x `height`, closed (and its profile removed) at the end."""
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    reason = missing()
    if reason:
        raise RuntimeError(reason)
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    options = Options()
    options.binary_location = _first(CHROMIUM)
    for flag in (*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=_first(CHROMEDRIVER)), options=options)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
