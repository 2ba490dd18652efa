"""What a web page may make a browser send to this server, and what client text may do to the log.

A page on any site can make a visitor's browser POST to http://localhost:8080 without asking the
server first, as long as the request is CORS-"simple": a form or `fetch(..., {mode: "no-cors"})`
with Content-Type text/plain, application/x-www-form-urlencoded or multipart/form-data. Such a
body can still be JSON, so it would reach the model (and /admin). And a page on a domain whose DNS
name is re-pointed at 127.0.0.1 (DNS rebinding) talks to the server as a same-origin page.

- Content type: a POST from a browser (it carries `Origin` or `Sec-Fetch-*` headers; curl and the
  SDKs send neither) must be `application/json` (or `+json`), else 415 `unsupported_media_type`.
  A browser can only send that type after a CORS preflight, which `--cors-origins` decides.
  Requests without browser headers are not checked, so `curl -d '{...}'` (which sends
  x-www-form-urlencoded) keeps working, as on llama.cpp.
- Host: `--allowed-hosts` lists the Host header names accepted (any port); by default, when the
  server listens on a loopback address, only loopback names (localhost, 127.0.0.1, ::1), which
  defeats DNS rebinding; on any other address, any Host. Otherwise 400 `invalid_host`.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from imp_jax.server.errors import Refusal

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
MAX_LOGGED_CHARS = 200
_BROWSER_HEADERS = ("Origin", "Sec-Fetch-Mode", "Sec-Fetch-Site")


def loggable(text: object, limit: int = MAX_LOGGED_CHARS) -> str:
    """A client string for a log line, cut to `limit` characters: as it is when every character is
    printable, else its repr() (a newline stays `\\n`, so one line stays one line)."""
    s = str(text)
    cut = s[:limit]
    shown = cut if cut.isprintable() else repr(cut)
    return shown + (f"...(+{len(s) - limit} chars)" if len(s) > limit else "")


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)   # ::ffff:127.0.0.1, as a dual-stack socket names a v4 peer
    return (mapped or addr).is_loopback


def default_allowed_hosts(bind_host: str) -> list[str]:
    """Loopback names when the server listens on a loopback address; else '*' (any)."""
    return list(LOOPBACK_NAMES) if is_loopback(bind_host) else ["*"]


def host_name(header: str) -> str:
    """The name in a Host header, without the port: 'localhost:8080' -> 'localhost', '[::1]:80' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].split("]", 1)[0]
    name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.rstrip(".")


class HostCheck:
    def __init__(self, allowed: list[str]):
        self.any = "*" in allowed
        self.allowed = frozenset(host_name(h) if not h.startswith("[") else h.strip("[]").lower() for h in allowed)

    def check(self, host: str | None) -> None:
        if self.any:
            return
        if host is None or host_name(host) not in self.allowed:
            raise Refusal(f"the Host header {loggable(host or '', 64)} is not one this server answers to "
                          "(--allowed-hosts)", status=400, code="invalid_host")


def check_json_content_type(method: str, headers: Mapping[str, str]) -> None:
    """415 for a browser's POST whose Content-Type is not JSON (see the module docstring)."""
    if method != "POST" or not any(headers.get(h) for h in _BROWSER_HEADERS):
        return
    ctype = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
    if ctype == "application/json" or (ctype.startswith("application/") and ctype.endswith("+json")):
        return
    raise Refusal(f"a request from a browser must send Content-Type: application/json, not {loggable(ctype, 64)}",
                  status=415, code="unsupported_media_type")
