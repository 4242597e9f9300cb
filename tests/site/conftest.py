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
- ``open_page``: ``with open_page(viewport) as page:`` a page in a fresh browser context (its
  own cookies, storage and cache), recording ``page.console_errors`` (console errors and uncaught
  exceptions), ``page.requests`` (every requested URL) and ``page.failed_responses``
  (``"status URL"`` of each response >= 400). Requests that would leave the local server are
  recorded and aborted: only they are routed (a URL pattern that the browser side matches), so
  the site's own requests never wait for a round trip through Python. ``page.settle()`` waits
  until the page has loaded what it loads by itself (see ``settle``), in place of Playwright's
  ``networkidle`` (which always waits 500 ms more).
  ``page.visit(url)`` empties storage, cookies and the records, then loads ``url``.
  The search index is the site's own only in ``open_page(search=True)``: elsewhere its request
  is answered with an index of no documents (the built index's own config), because Material's
  search worker builds its index from the whole file on every page load, 0.5 s of Chromium's CPU
  each time (measured here, 1.5 MB of index), and these tests read the page, not the search. The
  search test (test_browser.py) loads the real index and searches it.
- ``tabs``: ``tabs(viewport)`` is one such page per viewport for the whole session, to load many
  pages one after another with ``visit`` (a new context per load costs a new renderer process).
- ``page``: ``open_page()`` at Playwright's default viewport, for one test.
- ``instant_navigate``: ``instant_navigate(url)`` follows a link to ``url`` the way a reader
  clicks one, and returns whether Material's instant navigation swapped the page in (True)
  rather than reloading it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
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


def outside(site_url: str) -> re.Pattern:
    """URLs (http, https, ws, wss) of any host and port but the local server's. A plain regex:
    Playwright hands it to the browser side, which matches each request without asking Python."""
    parts = urllib.parse.urlsplit(site_url)
    port = parts.port or 80
    # the browser writes http://127.0.0.1:80/ as http://127.0.0.1/
    local = re.escape(parts.hostname) + (f"(?::{port})?" if port == 80 else f":{port}")
    return re.compile(r"^(?:https?|wss?)://(?!" + local + r"(?:[/?#]|$))", re.IGNORECASE)


#: Seconds with no request starting or ending before the page counts as done loading: what
#: Material, the search worker and the widgets fetch after the load event (sitemap.xml, the search
#: index, a model's weights after its manifest) follows within milliseconds of what came before.
QUIET_S = 0.25
#: The fonts (KaTeX's) have loaded, and two frames have been drawn since, so that what reacts to
#: them (layout, ResizeObserver callbacks such as docs/javascripts/wide.js) has run.
FONTS_AND_FRAMES = """() => document.fonts.ready.then(() => new Promise(
  done => requestAnimationFrame(() => requestAnimationFrame(done))))"""


def settle(page, timeout_s: float = 15.0) -> None:
    """Wait until ``page`` has loaded what it loads by itself after its load event: its fonts
    are in and laid out, no request of its is in flight, and none started or ended in the last
    ``QUIET_S`` seconds. Raises TimeoutError naming the requests still in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        page.evaluate(FONTS_AND_FRAMES)
        quiet = time.monotonic() - page.last_network_event
        if not page.in_flight and quiet >= QUIET_S:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{page.url}: still loading after {timeout_s:.0f} s: "
                               f"{sorted(page.in_flight)[:5]}")
        page.wait_for_timeout(1000 * max(0.02, QUIET_S - quiet))


@pytest.fixture(scope="session")
def open_page(browser, site_url: str, built_site: Path):
    """``with open_page(viewport) as page:`` a recorded page in a fresh context (module docstring)."""
    blocked = outside(site_url)
    index = built_site / "search" / "search_index.json"
    no_documents = json.dumps({"config": json.loads(index.read_text(encoding="utf-8"))["config"], "docs": []})

    @contextlib.contextmanager
    def opened(viewport: dict | None = None, *, search: bool = False):
        context = browser.new_context(**({"viewport": viewport} if viewport else {}))
        try:
            page = context.new_page()
            page.set_default_timeout(15_000)
            page.console_errors, page.requests, page.failed_responses = [], [], []
            page.in_flight = collections.Counter()  # URL -> requests of it not yet finished or failed
            page.last_network_event = time.monotonic()

            def started(request):
                page.requests.append(request.url)
                page.in_flight[request.url] += 1
                page.last_network_event = time.monotonic()

            def ended(request):
                page.in_flight[request.url] -= 1
                page.in_flight = +page.in_flight  # keeps the URLs above zero
                page.last_network_event = time.monotonic()

            def on_console(message):
                if message.type == "error":
                    page.console_errors.append(f"{page.url}: console error: {message.text}")

            def visit(url: str) -> None:
                """Load ``url`` as a fresh context would: storage, cookies and records emptied first
                (routing keeps the HTTP cache off)."""
                if page.url.startswith(site_url):
                    page.evaluate("localStorage.clear(); sessionStorage.clear()")
                context.clear_cookies()
                for record in (page.console_errors, page.requests, page.failed_responses, page.in_flight):
                    record.clear()
                page.goto(url)

            page.on("console", on_console)
            page.on("pageerror", lambda error: page.console_errors.append(f"{page.url}: uncaught: {error}"))
            page.on("request", started)
            page.on("requestfinished", ended)
            page.on("requestfailed", ended)
            page.on("response", lambda response: response.status >= 400
                    and page.failed_responses.append(f"{response.status} {response.url}"))
            page.route(blocked, lambda route: route.abort())  # offline: recorded in page.requests, never sent
            if not search:  # requested and answered as before, with no documents to index (module docstring)
                page.route(f"{site_url}search/search_index.json", lambda route: route.fulfill(
                    status=200, content_type="application/json", body=no_documents))
            page.settle = lambda: settle(page)
            page.visit = visit
            yield page
        finally:
            context.close()

    return opened


class Tabs:
    """One recorded page per viewport, kept for the whole session to load page after page with
    ``tab.visit(url)``: a fresh context per load would cost a new renderer process each time."""

    def __init__(self, open_page) -> None:
        self.open_page, self.opened = open_page, {}

    def __call__(self, viewport: dict):
        key = (viewport["width"], viewport["height"])
        if key not in self.opened:
            stack = contextlib.ExitStack()
            self.opened[key] = (stack, stack.enter_context(self.open_page(viewport)))
        return self.opened[key][1]

    def drop(self, viewport: dict) -> None:
        """Close the page of ``viewport`` (after a load failed): the next call opens a new one."""
        stack, _ = self.opened.pop((viewport["width"], viewport["height"]), (None, None))
        if stack:
            stack.close()

    def close(self) -> None:
        for stack, _ in self.opened.values():
            stack.close()
        self.opened.clear()


@pytest.fixture(scope="session")
def tabs(open_page):
    tabs = Tabs(open_page)
    yield tabs
    tabs.close()


@pytest.fixture
def page(open_page):
    with open_page() as page:
        yield page


@pytest.fixture
def instant_navigate(page):
    """Follow a link the way a reader does, so Material's instant navigation handles it;
    returns True when it did (the page was swapped without a reload)."""

    def navigate(url: str) -> bool:
        page.evaluate("window.__before_navigation = true")
        page.evaluate("""url => { const a = document.createElement('a'); a.href = url;
            a.textContent = 'go'; document.body.append(a); a.click(); }""", url)
        page.wait_for_url(url)
        page.settle()
        return page.evaluate("window.__before_navigation === true")

    return navigate
