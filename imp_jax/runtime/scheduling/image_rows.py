"""The image row pool's bookkeeping: which frame slots of the device pool hold which image's encoder rows.

The device pool (CompiledStep.image_pool) is [num_slots * rows_per_frame, hidden]; an image of F frames
owns F slots (any, not contiguous), frame f's rows at slot f. Host bookkeeping only, on the engine thread.
An entry, keyed by the image's digest, is in one of three states:
- in use: requests hold it (`refs` > 0); its frames wait in `pixels` until the encoder is launched on them
  (`encoded` from then on: the rows are valid for every program launched after);
- cached: no request holds it and it was encoded: kept for the next request with the same picture, evicted
  least recently used when a request needs its slots;
- gone: its slots are free (released unencoded, evicted, or forgotten after its encode failed).
Taking is all or nothing: a request gets every image's slots, or nothing changes.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any


@dataclasses.dataclass(eq=False)
class ImageEntry:
    """One image's slots in the pool, frame by frame."""

    digest: bytes
    slots: list[int]
    refs: int = 0
    encoded: bool = False
    num_rows: int = 0    # the image's rows: the first of its slots' rows (a Qwen2.5-VL image's last slot is partial)
    pixels: Any = None   # (pixels [F, 3, tile, tile], patch mask [F, n, n]) until the encoder is launched on them


class ImageRows:
    """Frame slots by image digest, refcounted while requests use them, LRU-cached after (module docstring)."""

    def __init__(self, num_slots: int, rows_per_frame: int):
        self.num_slots, self.rows_per_frame = num_slots, rows_per_frame
        self._free = list(range(num_slots - 1, -1, -1))
        self._entries: dict[bytes, ImageEntry] = {}
        self._idle: OrderedDict[bytes, ImageEntry] = OrderedDict()   # cached entries, least recently used first
        self.hits = 0   # images a request found in the pool (encoded or on their way)

    @property
    def num_free_slots(self) -> int:
        """Slots a request could take now: free, or held by cached entries it may evict."""
        return len(self._free) + sum(len(e.slots) for e in self._idle.values())

    @property
    def slots_in_use(self) -> int:
        """Slots held by entries some request uses."""
        return self.num_slots - self.num_free_slots

    def acquire(self, images: list[tuple[bytes, int]]) -> list[ImageEntry] | None:
        """An entry per (digest, frames), in order, each referenced once more; None (and nothing taken) when
        the slots free or cached now cannot hold the images the pool lacks."""
        wanted = {d for d, _ in images}
        need: dict[bytes, int] = {d: f for d, f in images if d not in self._entries}
        evictable = sum(len(e.slots) for d, e in self._idle.items() if d not in wanted)
        if sum(need.values()) > len(self._free) + evictable:
            return None
        out = []
        for digest, frames in images:
            entry = self._entries.get(digest)
            if entry is None:
                while len(self._free) < frames:
                    self._evict(next(d for d in self._idle if d not in wanted))
                entry = ImageEntry(digest, [self._free.pop() for _ in range(frames)])
                self._entries[digest] = entry
            elif digest not in need:
                self.hits += 1
            self._idle.pop(digest, None)
            entry.refs += 1
            out.append(entry)
        return out

    def release(self, entries: list[ImageEntry]) -> None:
        """Drop one reference from each entry; an unused encoded entry is cached, an unencoded one freed."""
        for entry in entries:
            entry.refs -= 1
            if entry.refs:
                continue
            if entry.encoded and self._entries.get(entry.digest) is entry:
                self._idle[entry.digest] = entry
            else:
                self._drop(entry)

    def forget(self, entry: ImageEntry) -> None:
        """Its encode failed: no request finds it again; its slots free once its holders release it."""
        if self._entries.get(entry.digest) is entry:
            del self._entries[entry.digest]
        if not entry.refs:
            self._drop(entry)

    def rows(self, entry: ImageEntry) -> list[int]:
        """The pool rows of the entry's frames, in order: rows_per_frame per frame."""
        n = self.rows_per_frame
        return [s * n + r for s in entry.slots for r in range(n)]

    def _evict(self, digest: bytes) -> None:
        self._drop(self._idle.pop(digest))

    def _drop(self, entry: ImageEntry) -> None:
        if self._entries.get(entry.digest) is entry:
            del self._entries[entry.digest]
        self._idle.pop(entry.digest, None)
        self._free.extend(entry.slots)
        entry.slots = []
