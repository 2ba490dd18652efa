"""The bounded in-memory store behind `store: true` and `previous_response_id` on /v1/responses.

Each entry is a finished response object plus the conversation it continues (previous input
items and its own output). Entries expire after a TTL. Entries are kept per owner (API key), each
in its own LRU order; past the entry (or byte) cap the least recently used entry of the owner
holding the most entries (bytes) is evicted, so one key's flood evicts its own responses first and
never those of a key holding fewer: with k keys storing, each keeps at least 1/k of the caps.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

log = logging.getLogger("imp_jax.server")
STORE_KEY = "imp_jax.responses_store"  # app.extensions key of the app's store


@dataclasses.dataclass(frozen=True)
class StoreLimits:
    """How long and how much the store keeps; a value <= 0 keeps nothing."""

    ttl_s: float = 24 * 3600.0
    max_entries: int = 4096
    max_bytes: int = 64 * 1024 * 1024


@dataclasses.dataclass
class StoredResponse:
    """One stored response: the object GET returns and the conversation a continuation starts from."""

    response: dict[str, Any]
    conversation: list[dict[str, str]]
    size: int
    expires_at: float
    owner: str | None = None   # a digest of the API key that created it; None when the server has no keys
    # the conversation's images by digest: (encoded bytes, detail), decoded again for a continuation
    images: dict[str, tuple[bytes, str]] = dataclasses.field(default_factory=dict)


def entry_size(response: dict[str, Any], conversation: list[dict[str, str]], images: dict[str, Any] | None = None) -> int:
    """The bytes an entry is charged: its JSON encoding and its images' encoded bytes (what a chain shares counts
    in each entry)."""
    text = len(json.dumps([response, conversation], ensure_ascii=False, separators=(",", ":")).encode())
    return text + sum(image.encoded_bytes for image in (images or {}).values())


class ResponsesStore:
    """Response id -> StoredResponse, TTL-expired and LRU-evicted under entry and byte caps."""

    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self._clock = clock
        self._entries: dict[str, StoredResponse] = {}
        self._by_owner: dict[str | None, OrderedDict[str, StoredResponse]] = {}   # each in LRU order
        self._owner_bytes: dict[str | None, int] = {}
        self._bytes = 0
        self.evictions = 0
        self.expirations = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, response_id: object) -> bool:
        return self.get(response_id) is not None if isinstance(response_id, str) else False

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, str]],
            owner: str | None = None, images: dict[str, Any] | None = None) -> bool:
        """Store an entry (replacing one of the same id) for `owner`, with the images its conversation's marks
        name (server/image_prompts.py); False when it alone exceeds the limits."""
        size = entry_size(response, conversation, images)
        self._remove(response_id)
        self._expire()
        lim = self.limits
        if lim.ttl_s <= 0 or lim.max_entries <= 0 or size > lim.max_bytes:
            log.warning("response %s (%d bytes) not stored: over the responses store limits %s",
                        response_id, size, lim)
            return False
        while self._entries and (len(self._entries) >= lim.max_entries or self._bytes + size > lim.max_bytes):
            self._remove(next(iter(self._by_owner[self._largest(by_bytes=len(self._entries) < lim.max_entries)])))
            self.evictions += 1
        kept = {digest: (image.encoded, image.detail) for digest, image in (images or {}).items()}   # no pixels held
        entry = StoredResponse(response, conversation, size, self._clock() + lim.ttl_s, owner, kept)
        self._entries[response_id] = entry
        self._by_owner.setdefault(owner, OrderedDict())[response_id] = entry
        self._owner_bytes[owner] = self._owner_bytes.get(owner, 0) + size
        self._bytes += size
        return True

    def get(self, response_id: str, owner: str | None = None) -> StoredResponse | None:
        """The live entry (now the most recently used), or None if unknown, deleted, expired or `owner`'s
        not (another API key's response is as absent as an unknown one)."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        if entry.expires_at <= self._clock():
            self._remove(response_id)
            self.expirations += 1
            return None
        self._by_owner[owner].move_to_end(response_id)
        return entry

    def delete(self, response_id: str, owner: str | None = None) -> bool:
        """Remove `owner`'s entry; False if there was no live one of theirs."""
        if self.get(response_id, owner) is None:
            return False
        self._remove(response_id)
        return True

    def stats(self) -> dict[str, int]:
        self._expire()
        return {"entries": len(self._entries), "bytes": self._bytes, "evictions": self.evictions,
                "expirations": self.expirations}

    def _expire(self) -> None:
        now = self._clock()
        for rid in [rid for rid, e in self._entries.items() if e.expires_at <= now]:
            self._remove(rid)
            self.expirations += 1

    def _largest(self, by_bytes: bool) -> str | None:
        """The owner holding the most entries (or bytes): the one whose least recently used entry goes."""
        if by_bytes:
            return max(self._owner_bytes, key=self._owner_bytes.__getitem__)
        return max(self._by_owner, key=lambda owner: len(self._by_owner[owner]))

    def _remove(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        self._bytes -= entry.size
        partition = self._by_owner[entry.owner]
        del partition[response_id]
        self._owner_bytes[entry.owner] -= entry.size
        if not partition:
            del self._by_owner[entry.owner], self._owner_bytes[entry.owner]
