"""Who may call, how often, and how much they may send: API keys, a per-caller rate limit, a body size limit.

Probes (`/health`, `/ready`) are always open; `/metrics` is open only with `--metrics-public`; the
chat page (`/` and `/ui/...`, ui.py) is open unless `--no-ui`.
Everything else, unmatched routes included, needs a key once any key is configured. Probes and
`/metrics` are not rate limited (a scrape is not work). `/admin/*` needs the `admin` grant (config.SCOPES):
a key granted it, or, on a server without keys, a loopback client (any client with `--admin-open`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import time
from collections.abc import Callable, Mapping

from imp_jax.server.auth_throttle import AuthThrottle
from imp_jax.server.browsers import is_loopback, loggable
from imp_jax.server.errors import Refusal
from imp_jax.server.ui import is_ui_path

PROBES = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"
ADMIN_PREFIX = "/admin/"
NO_PEER = "<local>"   # Quart's remote_addr when the ASGI scope has no client: a unix socket, an in-process client
MAX_TRACKED_CALLERS = 10_000  # rate-limit buckets kept before full (idle) ones are dropped


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a request carries: `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    auth = headers.get("Authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key", "").strip() or None


def key_digest(key: str) -> str:
    """A key's SHA-256 hex digest: how a caller is named where the key itself must not be kept."""
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The accepted keys, kept as SHA-256 digests and compared in constant time against every one,
    each with its grants (config.GRANTS)."""

    def __init__(self, keys: Mapping[str, frozenset[str]] | list[str]):
        grants = keys if isinstance(keys, Mapping) else dict.fromkeys(keys, frozenset({"inference"}))
        self._grants = {hashlib.sha256(k.encode()).digest(): g for k, g in grants.items()}

    def __bool__(self) -> bool:
        return bool(self._grants)

    def accepts(self, key: str) -> bool:
        probe = hashlib.sha256(key.encode()).digest()
        ok = False
        for digest in self._grants:  # no early exit: the time does not say which key came close
            ok |= hmac.compare_digest(probe, digest)
        return ok

    def grants(self, key: str | None) -> frozenset[str]:
        """What an accepted `key` was granted (none for an unknown key or None)."""
        if key is None or not self.accepts(key):
            return frozenset()
        return self._grants[hashlib.sha256(key.encode()).digest()]


@dataclasses.dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    """A token bucket per caller: `per_minute` requests in a burst, refilled at `per_minute` a minute."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, caller: str) -> float:
        """0 if the caller may go now (one request counted), else the seconds until it may."""
        now = self._clock()
        rate = self.per_minute / 60.0
        bucket = self._buckets.get(caller)
        if bucket is None:
            if len(self._buckets) >= MAX_TRACKED_CALLERS:
                self._forget_idle(now)
            bucket = self._buckets[caller] = _Bucket(float(self.per_minute), now)
        bucket.tokens = min(float(self.per_minute), bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return 0.0
        return (1.0 - bucket.tokens) / rate

    def _forget_idle(self, now: float) -> None:
        """Drop callers whose bucket has refilled: forgetting them changes nothing."""
        rate = self.per_minute / 60.0
        full = [c for c, b in self._buckets.items() if b.tokens + (now - b.updated) * rate >= self.per_minute]
        for caller in full:
            del self._buckets[caller]


def tenant_of(headers: Mapping[str, str], client_addr: str | None, keyed: bool) -> str:
    """Who a request counts against (the rate limit, tenants.py's limits, the fair scheduler): its key on a
    server with keys, else its client address."""
    key = presented_key(headers)
    return f"key:{key_digest(key)}" if keyed and key else f"addr:{client_addr}"


def is_local_client(client_addr: str | None) -> bool:
    """A client on this machine: a loopback address, or no network peer at all (NO_PEER)."""
    return client_addr in (None, NO_PEER) or is_loopback(client_addr)


class Access:
    """The checks every request passes before its handler runs; each failure is a Refusal."""

    def __init__(self, keys: Mapping[str, frozenset[str]] | list[str], rate_limit: int,
                 max_request_bytes: int | None, metrics_public: bool, ui_public: bool = False,
                 admin_open: bool = False, auth_failures_per_minute: int = 0):
        self.keys = ApiKeys(keys)
        self.admin_open = admin_open
        self.limiter = RateLimiter(rate_limit) if rate_limit > 0 else None
        self.max_request_bytes = max_request_bytes
        self.metrics_public = metrics_public
        self.ui_public = ui_public
        self.auth_throttle = AuthThrottle(auth_failures_per_minute)   # --auth-failures-per-minute

    def is_open(self, path: str) -> bool:
        return (path in PROBES or (path == METRICS_PATH and self.metrics_public)
                or (self.ui_public and is_ui_path(path)))

    def is_admin(self, headers: Mapping[str, str], client_addr: str | None) -> bool:
        """Whether the caller holds `admin`: its key was granted it; without keys, it is a loopback client
        (the operator's own machine) or the operator opened admin to all (--admin-open)."""
        if self.keys:
            return "admin" in self.keys.grants(presented_key(headers))
        return self.admin_open or is_local_client(client_addr)

    def admin_refusal(self, what: str) -> Refusal:
        """The 403 for a caller without `admin`: says which grant is missing and how an operator gives it."""
        how = ("a key granted 'admin' (--admin-key, or 'admin' after the key in --api-key-file)" if self.keys
               else "a loopback client on a server without API keys (or --admin-open, or --admin-key)")
        return Refusal(f"{what} needs the 'admin' grant: {how}", status=403, code="not_granted")

    def check(self, path: str, headers: Mapping[str, str], client_addr: str | None,
              content_length: int | None, max_request_bytes: int | None = None) -> None:
        """Refuse with 429 (too many wrong keys from this address: auth_throttle.py), 401 (key), 429 (rate), 403
        (an /admin route without `admin`) or 413 (body size, against `max_request_bytes` when given), in that order."""
        if self.is_open(path):
            return
        key = presented_key(headers)
        if self.keys:
            accepted = key is not None and self.keys.accepts(key)
            self.auth_throttle.check(client_addr, failed=key is not None and not accepted)
            if key is None:
                raise Refusal("this server needs an API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                              status=401, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
            if not accepted:
                raise Refusal("the API key is not valid", status=401, code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"})
        if self.limiter is not None and path not in PROBES and path != METRICS_PATH:
            wait = self.limiter.take(tenant_of(headers, client_addr, bool(self.keys)))
            if wait > 0:
                retry = max(1, math.ceil(wait))
                raise Refusal(f"rate limit of {self.limiter.per_minute} requests per minute exceeded; "
                              f"retry after {retry} s", status=429, code="rate_limit_exceeded",
                              headers={"Retry-After": str(retry)})
        if path.startswith(ADMIN_PREFIX) and not self.is_admin(headers, client_addr):
            raise self.admin_refusal(f"the route {loggable(path, 64)}")
        limit = max_request_bytes or self.max_request_bytes
        if content_length is not None and limit is not None and content_length > limit:
            raise Refusal(f"the request body has {content_length} bytes; this server takes at most "
                          f"{limit}", status=413, code="request_too_large")
