"""The built-in chat page: `GET /` and its static assets under `/ui/`, files shipped in the package.

The page is plain HTML, CSS and JavaScript (no build step, nothing fetched from elsewhere); it calls
the server's own API. Assets are addressed by a hash of their content (`/ui/app.js?v=<hash>`), so a
browser keeps them for a year; the page itself is revalidated on every load with its ETag. The page
and assets carry no secrets, so they need no API key (the page asks for one when the API answers 401).
"""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from quart import Blueprint, Quart, Response, request

from imp_jax.errors import NotFoundError

STATIC_DIR = Path(__file__).parent / "static"
ASSET_PREFIX = "/ui/"
TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".html": "text/html; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
ASSET_MAX_AGE_S = 365 * 24 * 3600
# Same-origin only: scripts, styles, images and fetch() to this server; nothing inline but styles set by script.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def is_ui_path(path: str) -> bool:
    """The page and its assets: open without an API key (they hold nothing but the page's code)."""
    return path == "/" or path.startswith(ASSET_PREFIX)


@dataclasses.dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(directory: Path = STATIC_DIR) -> dict[str, Asset]:
    """Every file of `directory` by name, and `index.html` with each `{{name}}` replaced by its hashed URL."""
    assets: dict[str, Asset] = {}
    for path in sorted(directory.iterdir()):
        if path.is_file() and path.name != "index.html" and path.suffix in TYPES:
            body = path.read_bytes()
            assets[path.name] = Asset(body, TYPES[path.suffix], hashlib.sha256(body).hexdigest()[:16])
    page = (directory / "index.html").read_text()
    for name, asset in assets.items():
        page = page.replace("{{" + name + "}}", f"{ASSET_PREFIX}{name}?v={asset.etag}")
    body = page.encode()
    assets["index.html"] = Asset(body, TYPES[".html"], hashlib.sha256(body).hexdigest()[:16])
    return assets


def _send(asset: Asset, cache_control: str) -> Response:
    headers = {"ETag": f'"{asset.etag}"', "Cache-Control": cache_control, "X-Content-Type-Options": "nosniff"}
    if asset.content_type.startswith("text/html"):
        headers.update({"Content-Security-Policy": CSP, "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer"})
    if f'"{asset.etag}"' in request.headers.get("If-None-Match", ""):
        return Response(b"", status=304, headers=headers)
    return Response(asset.body, status=200, content_type=asset.content_type, headers=headers)


def register(app: Quart, enabled: bool) -> None:
    """Serve the page at `GET /` and its assets at `GET /ui/<name>` (nothing when not `enabled`: --no-ui)."""
    if not enabled:
        return
    assets = load_assets()
    bp = Blueprint("ui", __name__)

    @bp.get("/")
    async def page() -> Any:
        return _send(assets["index.html"], "no-cache")

    @bp.get(ASSET_PREFIX + "<name>")
    async def asset(name: str) -> Any:
        found = assets.get(name)
        if found is None or name == "index.html":
            raise NotFoundError(f"no UI asset named '{name}'", code="not_found")
        immutable = request.args.get("v") == found.etag   # the hashed URL the page links to
        return _send(found, f"public, max-age={ASSET_MAX_AGE_S}, immutable" if immutable else "no-cache")

    app.register_blueprint(bp)
