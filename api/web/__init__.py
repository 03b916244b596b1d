"""The browser pages: a chat page at `/` and a live dashboard at `/dashboard`.

Plain static files (`api/web/static/`: HTML, CSS and our own JavaScript; no third-party
code, no build step), shipped as package data so an installed wheel serves them. The pages
hold no data of their own: the chat page streams through `/v1/chat/completions` and reads
its model picker (the base model, then its LoRA adapters) and the model card from
`/v1/models` and `/health`; the dashboard polls `/admin/stats` (the
engine's counters and gauges) and `/metrics` (the latency histograms) once a second and
draws the last minutes as SVG charts (`charts.js`).

The API key. Every route the pages read from is behind the key as usual; the pages
themselves (`PAGE_PATHS` and the files under `/web/`) are not, as llama.cpp's server does
with its UI, because a browser cannot send a Bearer header when it opens a URL: a page
must load before it can ask for the key. When a read answers 401 the page asks for the
key, keeps it in the browser's localStorage and sends it as `Authorization: Bearer`; the
key controls ("Forget key") show only once a key was asked for or while one is stored.
Page loads are not counted as API requests (`is_page`). `--no-web-ui`
(`FERROX_WEB_UI=0`) removes all of it: `/` and `/dashboard` then answer 404.

Every page response carries a strict Content-Security-Policy (scripts and styles from this
origin only, no inline script, fetches to this origin only) and `nosniff`.
"""

from __future__ import annotations

import functools
from importlib import resources

from quart import Blueprint, Response

from api.errors import APIError

blueprint = Blueprint("web", __name__)

PAGE_PATHS = frozenset({"/", "/dashboard"})
ASSET_PREFIX = "/web/"
CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".css": "text/css; charset=utf-8",
                 ".js": "text/javascript; charset=utf-8", ".svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a new version's files replace the old at once
}


def is_page(path: str) -> bool:
    """A page or one of its files: served without the API key and not counted as a request."""
    return path in PAGE_PATHS or path.startswith(ASSET_PREFIX)


@functools.cache
def asset_names() -> frozenset[str]:
    """The files under static/ (only these names are served: no path ever reaches the disk)."""
    root = resources.files(__package__) / "static"
    return frozenset(entry.name for entry in root.iterdir() if entry.is_file() and _content_type(entry.name))


@functools.cache
def _read(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


def _content_type(name: str) -> str | None:
    dot = name.rfind(".")
    return CONTENT_TYPES.get(name[dot:]) if dot >= 0 else None


def _file(name: str) -> Response:
    if name not in asset_names():
        raise APIError(404, f"unknown route {ASSET_PREFIX}{name}", code="not_found")
    response = Response(_read(name), status=200, content_type=_content_type(name))
    for key, value in SECURITY_HEADERS.items():
        response.headers[key] = value
    return response


@blueprint.get("/")
async def chat_page() -> Response:
    return _file("chat.html")


@blueprint.get("/dashboard")
async def dashboard_page() -> Response:
    return _file("dashboard.html")


@blueprint.get(ASSET_PREFIX + "<name>")
async def asset(name: str) -> Response:
    return _file(name)
