"""Fixtures for the tests of the built site.

- ``built_site``: the folder of a strictly built site. ``python3 dev.py check`` builds once and
  passes the folder in ``ATTENTION_REF_BUILT_SITE`` (the docs workflow then publishes that same
  folder); otherwise the site is built here, once per test session, into a temporary folder
  (``ATTENTION_REF_MKDOCS_CONFIG`` may name another config, e.g. one that excludes pages).
- ``site_url``: the base URL (trailing slash) of that site served by a local HTTP server, at
  the port and path of the ``site_url`` it was built with. Material's instant navigation only
  takes over links that its sitemap.xml lists, and it compares them after swapping in the
  page's protocol and host name but not its port or path; so the site is served where it was
  built for. A local build is built for a free port on 127.0.0.1; a site built for
  ``https://<user>.github.io/<repo>/`` is served on port 80 under ``/<repo>/`` (needs root, as
  in the CI container).
- ``browser``: Playwright's Chromium from /usr/bin/chromium (Playwright never downloads a
  browser here). Without Chromium the browser tests skip with the install command, or fail
  when ATTENTION_REF_REQUIRE_BROWSER=1.
- ``page``: a fresh browser page recording ``page.console_errors`` (console errors and uncaught
  exceptions), ``page.requests`` (every requested URL) and ``page.failed_responses``
  (``"status URL"`` of each response >= 400). Requests that would leave 127.0.0.1 are recorded
  and aborted.
- ``instant_navigate``: ``instant_navigate(url)`` follows a link to ``url`` the way a reader
  clicks one, and returns whether Material's instant navigation swapped the page in (True)
  rather than reloading it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

import serving  # tests/serving.py: tests/ is on sys.path (pytest's rootdir conftest)

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path(os.environ.get("ATTENTION_REF_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get("ATTENTION_REF_BUILT_SITE")
    if given:
        site = Path(given)
        if not (site / "index.html").is_file():
            pytest.fail(f"ATTENTION_REF_BUILT_SITE={given} has no index.html: not a built site")
        return site
    site = tmp_path_factory.mktemp("site")
    config = os.environ.get("ATTENTION_REF_MKDOCS_CONFIG", str(ROOT / "mkdocs.yml"))
    env = {**os.environ, "ATTENTION_REF_SITE_URL": f"http://127.0.0.1:{free_port()}/",
           "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config, "-d", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True,
    )
    if build.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}", pytrace=False)
    return site


@pytest.fixture(scope="session")
def site_url(built_site: Path):
    served = os.environ.get(serving.SERVED_AT)  # pytest-xdist: the controller serves it for every worker
    if served:
        if served != serving.built_site_url(built_site):
            pytest.fail(f"{serving.SERVED_AT}={served}, but the site was built for "
                        f"{serving.built_site_url(built_site)}", pytrace=False)
        yield served
        return
    try:
        url, stop = serving.serve(built_site)
    except OSError as error:
        pytest.fail(str(error), pytrace=False)
    yield url
    stop()


@pytest.fixture(scope="session")
def browser():
    if not CHROMIUM.exists():
        message = (f"Chromium not found at {CHROMIUM}: install it with "
                   "`sudo apt-get install chromium` to run the browser tests")
        if os.environ.get("ATTENTION_REF_REQUIRE_BROWSER") == "1":
            pytest.fail(message + " (ATTENTION_REF_REQUIRE_BROWSER=1)", pytrace=False)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, site_url: str):
    context = browser.new_context()  # fresh profile state: cookies, storage, cache
    page = context.new_page()
    page.set_default_timeout(15_000)
    page.console_errors = []
    page.requests = []
    page.failed_responses = []
    local = urllib.parse.urlsplit(site_url).netloc

    def on_console(message):
        if message.type == "error":
            page.console_errors.append(f"{page.url}: console error: {message.text}")

    def route(route):
        url = urllib.parse.urlsplit(route.request.url)
        if url.scheme in ("http", "https", "ws", "wss") and url.netloc != local:
            route.abort()  # offline: recorded in page.requests, never sent
        else:
            route.continue_()

    page.on("console", on_console)
    page.on("pageerror", lambda error: page.console_errors.append(f"{page.url}: uncaught: {error}"))
    page.on("request", lambda request: page.requests.append(request.url))
    page.on("response", lambda response: response.status >= 400
            and page.failed_responses.append(f"{response.status} {response.url}"))
    page.route("**/*", route)
    yield page
    context.close()


@pytest.fixture
def instant_navigate(page):
    """Follow a link the way a reader does, so Material's instant navigation handles it;
    returns True when it did (the page was swapped without a reload)."""

    def navigate(url: str) -> bool:
        page.evaluate("window.__before_navigation = true")
        page.evaluate("""url => { const a = document.createElement('a'); a.href = url;
            a.textContent = 'go'; document.body.append(a); a.click(); }""", url)
        page.wait_for_url(url)
        page.wait_for_load_state("networkidle")
        return page.evaluate("window.__before_navigation === true")

    return navigate
