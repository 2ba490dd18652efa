"""CORS, off unless `--cors-origins` names the origins a browser may call from ('*' = any).

A preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin is answered
204 before any key check (browsers send no credentials on it); every answer to an allowed
origin carries Access-Control-Allow-Origin and exposes the request-id headers.
"""
from __future__ import annotations

from collections.abc import Mapping

ALLOWED_METHODS = "GET, POST, DELETE, OPTIONS"
EXPOSED_HEADERS = "X-Request-Id, request-id, Retry-After"
PREFLIGHT_MAX_AGE_S = 600


class Cors:
    def __init__(self, origins: list[str]):
        self.any = "*" in origins
        self.origins = frozenset(origins)

    def allowed(self, origin: str | None) -> bool:
        return bool(origin) and (self.any or origin in self.origins)

    @staticmethod
    def is_preflight(method: str, headers: Mapping[str, str]) -> bool:
        return method == "OPTIONS" and "Access-Control-Request-Method" in headers

    def preflight_headers(self, headers: Mapping[str, str]) -> dict[str, str]:
        out = self.response_headers(headers.get("Origin"))
        out.update({"Access-Control-Allow-Methods": ALLOWED_METHODS, "Access-Control-Max-Age": str(PREFLIGHT_MAX_AGE_S),
                    "Access-Control-Allow-Headers": headers.get("Access-Control-Request-Headers", "")})
        return out

    def response_headers(self, origin: str | None) -> dict[str, str]:
        """The headers an answer to `origin` carries (none for an origin not allowed)."""
        if not self.allowed(origin):
            return {}
        return {"Access-Control-Allow-Origin": "*" if self.any else origin, "Vary": "Origin",  # type: ignore[dict-item]
                "Access-Control-Expose-Headers": EXPOSED_HEADERS}
