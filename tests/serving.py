"""Serve a built site where it was built for: the port and path of its ``site_url``.

Material's instant navigation only takes over links that its sitemap.xml lists, and it
compares them after swapping in the page's protocol and host name but not its port or path;
so the site must be served at the address it was built for. Used by ``tests/site/conftest.py``
(the ``site_url`` fixture) and, under pytest-xdist, by ``tests/conftest.py`` in the controller
process, so that every worker's browser tests share one server on that one port.
"""

from __future__ import annotations

import functools
import http.server
import sys
import threading
import urllib.parse
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

SITEMAP_NS = "{http://www.sitemaps.org/schemas/sitemap/0.9}"
#: Set (by the xdist controller) to the URL a built site is already served at.
SERVED_AT = "ATTENTION_REF_SITE_SERVED_AT"


def built_site_url(site: Path) -> str:
    """The site_url the site was built with: the first <loc> of its sitemap (the home page)."""
    root = ET.parse(site / "sitemap.xml").getroot()
    return root.find(f"{SITEMAP_NS}url/{SITEMAP_NS}loc").text.strip()


class _Handler(http.server.SimpleHTTPRequestHandler):
    prefix = "/"

    def translate_path(self, path: str) -> str:
        if not path.startswith(self.prefix):
            return str(Path(self.directory) / "__outside_the_site__")  # -> 404
        return super().translate_path("/" + path[len(self.prefix):])

    def log_message(self, format, *args):  # keep the test output clean
        pass


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # a browser that closes a connection early (leaving a page mid-load) is no error of the site;
        # in the pytest-xdist controller nothing captures the traceback, which filled the log
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


def serve(site: Path) -> tuple[str, Callable[[], None]]:
    """Serve ``site`` in a thread at the address it was built for: ``(base URL, stop)``.

    Raises:
        OSError: the port is not available, with what to do instead.
    """
    built_for = urllib.parse.urlsplit(built_site_url(site))
    prefix = built_for.path if built_for.path.endswith("/") else built_for.path + "/"
    port = built_for.port or 80  # Material swaps in the page's protocol but keeps the port
    handler = type("Handler", (_Handler,), {"prefix": prefix})
    try:
        server = _Server(
            ("127.0.0.1", port), functools.partial(handler, directory=str(site)))
    except OSError as error:
        raise OSError(
            f"the site was built for {built_for.geturl()} and must be served at 127.0.0.1:{port}"
            f"{prefix} for Material's instant navigation to work, but that port is not "
            f"available ({error}). Build it for a free local port instead: "
            "ATTENTION_REF_SITE_URL=http://127.0.0.1:<port>/ mkdocs build --strict") from error
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        server.server_close()

    return f"http://127.0.0.1:{port}{prefix}", stop
