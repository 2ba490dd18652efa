"""Disk tier of the prefix cache: KV blocks kept as files named by their chain hash, bounded, LRU.

A block lives at `<root>/<fingerprint>/<hex[:2]>/<hex>.kvb`. The engine thread calls `put` (never
blocks: the write is queued for one writer thread, or dropped and counted when the queue is full),
`contains` and `get`; `get` may run on any thread. A file is trusted only after its header names this
store's fingerprint and the hash its name says, and a digest over header and payload matches: a torn,
corrupt, planted or foreign file is counted, removed, and read as a miss. Files appear under their
final name only by an atomic rename, so a reader never sees one half written.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import re
import struct
import threading
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import Callable

import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy, so np.dtype("bfloat16") resolves)
import numpy as np
import xxhash

from imp_jax.paths import check_safe, private_dir
from imp_jax.runtime.kv.kv_fingerprint import model_fingerprint, weights_digest

__all__ = ["DiskKVStore", "Rejected", "decode_block", "model_fingerprint", "weights_digest"]

log = logging.getLogger("imp_jax.kv_disk")

MAGIC = b"IMPKVB\r\n"                   # \r\n: a file mangled by a text-mode copy fails the magic
VERSION = 1
PREFIX = struct.Struct("<8sHI")         # magic, version, meta length; then meta JSON, payload, digest
DIGEST_SIZE = 16                        # xxh3-128 of everything before it: integrity, not authentication
MAX_META = 4096
STALE_TMP_S = 60.0                      # a temp file older than this at start-up is a crashed write
REASONS = ("torn", "corrupt", "header", "foreign", "misnamed", "link", "unreadable")
_NAME = re.compile(r"[0-9a-f]{2,128}\.kvb")


class Rejected(ValueError):
    """A block file that must not be served; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def encode_header(fingerprint: str, block_hash: bytes, payload: np.ndarray) -> bytes:
    """The bytes before the payload: fixed prefix, then a JSON meta naming model, block, dtype and shape."""
    meta = json.dumps({"fingerprint": fingerprint, "hash": block_hash.hex(), "dtype": payload.dtype.name,
                       "shape": list(payload.shape), "nbytes": payload.nbytes}, separators=(",", ":")).encode()
    return PREFIX.pack(MAGIC, VERSION, len(meta)) + meta


def payload_bytes(payload: np.ndarray) -> np.ndarray:
    """A C-contiguous array's bytes as a flat uint8 view (no copy; works for ml_dtypes too)."""
    return payload.reshape(-1).view(np.uint8)


def block_digest(header: bytes, payload: np.ndarray) -> bytes:
    h = xxhash.xxh3_128(header)
    h.update(payload_bytes(payload))
    return h.digest()


def decode_block(data: bytearray, fingerprint: str, block_hash: bytes) -> np.ndarray:
    """The payload of a whole block file, as a writable array over `data`; Rejected when it must not be served."""
    if len(data) < PREFIX.size:
        raise Rejected("torn", f"{len(data)} bytes")
    magic, version, meta_len = PREFIX.unpack_from(data)
    if magic != MAGIC or version != VERSION or meta_len > MAX_META:
        raise Rejected("header", f"magic {magic!r}, version {version}, meta {meta_len} bytes")
    start = PREFIX.size + meta_len
    if len(data) < start:
        raise Rejected("torn", "meta cut short")
    try:
        meta = json.loads(bytes(data[PREFIX.size:start]))
        name, shape, nbytes = meta["dtype"], tuple(meta["shape"]), meta["nbytes"]
        if not (isinstance(name, str) and isinstance(meta["shape"], list)
                and all(type(d) is int for d in (*shape, nbytes))):
            raise TypeError(f"meta of the wrong types: {str(meta)[:200]}")
        dtype = np.dtype(name)
    except (ValueError, TypeError, KeyError) as e:
        raise Rejected("header", str(e)) from None
    if len(data) < start + nbytes + DIGEST_SIZE:
        raise Rejected("torn", f"{len(data)} bytes, header says {start + nbytes + DIGEST_SIZE}")
    if len(data) > start + nbytes + DIGEST_SIZE:
        raise Rejected("corrupt", "trailing bytes")
    if xxhash.xxh3_128_digest(memoryview(data)[:start + nbytes]) != data[start + nbytes:]:
        raise Rejected("corrupt", "digest mismatch")
    # the digest holds: what follows is what some writer meant (ours, or one who planted a valid file)
    if meta.get("fingerprint") != fingerprint:
        raise Rejected("foreign", f"fingerprint {str(meta.get('fingerprint'))[:80]!r}")
    if meta.get("hash") != block_hash.hex():
        raise Rejected("misnamed", f"header names {str(meta.get('hash'))[:80]!r}")
    if (dtype.hasobject or not dtype.itemsize or any(d < 0 for d in shape)
            or math.prod(shape) * dtype.itemsize != nbytes):
        raise Rejected("header", f"{dtype.name} {shape} is not {nbytes} bytes")
    return np.frombuffer(data, dtype, count=nbytes // dtype.itemsize, offset=start).reshape(shape)


@dataclasses.dataclass(eq=False)
class _Entry:
    """One indexed file; compared by identity, so a remover can tell its entry was not replaced."""

    size: int


class DiskKVStore:
    """Block files under `root/fingerprint`, at most `max_bytes` in all, least recently used evicted first.

    `_index` (hash -> file entry, least recently used first) and `_pending` (hash -> payload queued for the
    writer, in `_queue` order) are guarded by `_cv`'s lock. A hash enters the index when its file is renamed
    in place and leaves the queue once that write's evictions are done. Only the writer thread creates,
    renames and evicts files; `get` removes a rejected file, and only while the index holds the entry it read.
    Host memory: queued payloads plus the spare buffers put refills stay under `max_pending_bytes`.
    """

    def __init__(self, root: Path, fingerprint: str, max_bytes: int, *, max_pending_bytes: int = 256 << 20,
                 writer_hook: Callable[[bytes], None] | None = None) -> None:
        if not re.fullmatch(r"[0-9A-Za-z_.-]{1,128}", fingerprint) or fingerprint in (".", ".."):
            raise ValueError(f"fingerprint {fingerprint!r}: expected 1-128 of [0-9A-Za-z_.-]")
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.max_pending_bytes = max_pending_bytes
        self._hook = writer_hook          # tests: called on the writer thread before each write
        check_safe(private_dir(self.root))   # the root first: nothing is created inside a directory others may write
        self._dir = private_dir(self.root / fingerprint)
        self._cv = threading.Condition()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()
        self._total = 0
        self._pending: dict[bytes, tuple[bytes, np.ndarray, np.ndarray]] = {}   # hash -> header, payload, buffer
        self._spare: dict[int, list[np.ndarray]] = {}    # written blocks' buffers by size, for put to refill
        self._spare_bytes = 0                            # pending + spare never exceed max_pending_bytes
        self._queue: deque[bytes] = deque()
        self._pending_bytes = 0
        self._closing = self._abandon = False
        self._counts = dict.fromkeys(("hits", "misses", "writes", "bytes_written", "bytes_read", "evictions",
                                      "dropped_writes", "write_errors", "rejected",
                                      *(f"rejected_{r}" for r in REASONS)), 0)
        self._scan()
        self._unlink(self._over_budget())
        self._writer = threading.Thread(target=self._run, name=f"kv-disk-{fingerprint[:8]}", daemon=True)
        self._writer.start()

    # -- the interface -------------------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        """Whether a block of that hash is on disk or queued for it (unverified: `get` may still miss)."""
        with self._cv:
            return block_hash in self._index or block_hash in self._pending

    def put(self, block_hash: bytes, payload: np.ndarray) -> None:
        """Queue a copy of `payload` for the writer and return at once; dropped (and counted) when the queue
        is full or the store closed. A block already stored or queued is not written again."""
        if payload.dtype.hasobject:
            raise TypeError("a KV block payload cannot hold Python objects")
        dtype = payload.dtype if payload.dtype.isnative else payload.dtype.newbyteorder("=")
        header = encode_header(self.fingerprint, block_hash, payload)
        n = payload.nbytes
        with self._cv:
            if block_hash in self._index or block_hash in self._pending:
                return
            if (self._closing or len(header) + n + DIGEST_SIZE > self.max_bytes
                    or self._pending_bytes + n > self.max_pending_bytes):
                self._counts["dropped_writes"] += 1
                return
            spares = self._spare.get(n)
            if spares:                                    # a written block's buffer: no page faults to fill it
                buf = spares.pop()
                self._spare_bytes -= n
            else:
                buf = np.empty(n, np.uint8)
            arr = buf.view(dtype).reshape(payload.shape)
            np.copyto(arr, payload)                       # the caller may reuse its buffer once we return
            self._pending[block_hash] = header, arr, buf
            self._queue.append(block_hash)
            self._pending_bytes += n
            self._cv.notify_all()

    def get(self, block_hash: bytes) -> np.ndarray | None:
        """The block's payload, verified; None when missing or rejected (counted by reason). Never raises for a
        bad file. Any thread."""
        with self._cv:
            queued = self._pending.get(block_hash)
            entry = self._index.get(block_hash)
            if queued is None and entry is None:
                self._counts["misses"] += 1
                return None
            if queued is not None:
                self._counts["hits"] += 1
                return queued[1].copy()
            self._index.move_to_end(block_hash)
        path = self._path(block_hash)
        try:
            with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size != entry.size:                  # changed since indexed: never read an unbounded file
                    raise Rejected("torn", f"{size} bytes, indexed as {entry.size}")
                data = bytearray(size)
                f.readinto(data)
            arr = decode_block(data, self.fingerprint, block_hash)
        except FileNotFoundError:                       # evicted meanwhile, or removed by another process
            self._forget(block_hash, entry, reason=None)
            return None
        except Rejected as e:
            log.warning("kv disk: rejected %s: %s", path, e)
            self._forget(block_hash, entry, reason=e.reason)
            return None
        except OSError as e:
            log.warning("kv disk: cannot read %s: %s", path, e)
            self._forget(block_hash, entry, reason="link" if e.errno == errno.ELOOP else "unreadable")
            return None
        with self._cv:
            self._counts["hits"] += 1
            self._counts["bytes_read"] += size
        try:
            os.utime(path)          # the LRU order a restart's scan will see
        except OSError:
            pass
        return arr

    def stats(self) -> dict[str, int]:
        """Counters, plus the files and bytes on disk and the writes queued now."""
        with self._cv:
            return {**self._counts, "files": len(self._index), "bytes": self._total,
                    "pending_writes": len(self._queue), "pending_bytes": self._pending_bytes}

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (or dropped); False when `timeout_s` ran out first."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue or self._abandon, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued (waiting at most `timeout_s`; the rest is dropped and counted), stop the writer."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._writer.join(timeout_s)
        with self._cv:
            if self._writer.is_alive():                 # stalled: give up what it has not started
                self._abandon = True            # (the write in progress, if it ends, is counted twice)
                self._counts["dropped_writes"] += len(self._queue)
                self._cv.notify_all()
            c = self._counts
            log.info("KV disk tier closed: %d blocks (%.0f MiB) written this run, %d dropped; %d files (%.0f MiB) "
                     "kept for the next start", c["writes"], c["bytes_written"] / 2**20, c["dropped_writes"],
                     len(self._index), self._total / 2**20)

    # -- the writer ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue or self._abandon:
                    return
                block_hash = self._queue[0]
                header, arr, buf = self._pending[block_hash]
            self._unlink(self._write(block_hash, header, arr))
            with self._cv:                                # done with the head only now: flush() implies evicted
                self._queue.popleft()
                del self._pending[block_hash]
                self._pending_bytes -= buf.nbytes
                if self._pending_bytes + self._spare_bytes + buf.nbytes <= self.max_pending_bytes:
                    self._spare.setdefault(buf.nbytes, []).append(buf)
                    self._spare_bytes += buf.nbytes
                self._cv.notify_all()

    def _write(self, block_hash: bytes, header: bytes, arr: np.ndarray) -> list[bytes]:
        """Write one block to a temp file and rename it in place; the victims its size pushes out."""
        final = self._path(block_hash)
        tmp = final.parent / f".{final.stem}.{os.getpid()}.{threading.get_ident()}.tmp"
        size = len(header) + arr.nbytes + DIGEST_SIZE
        try:
            if self._hook is not None:
                self._hook(block_hash)
            final.parent.mkdir(mode=0o700, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload_bytes(arr))
                f.write(block_digest(header, arr))
            with self._cv:
                os.replace(tmp, final)
                old = self._index.pop(block_hash, None)   # another process's file of the same hash, same bytes
                self._total += size - (old.size if old else 0)
                self._index[block_hash] = _Entry(size)
                self._counts["writes"] += 1
                self._counts["bytes_written"] += size
                return self._over_budget()
        except Exception as e:  # disk full, permissions, a hook's failure: the block is simply not stored
            with self._cv:
                self._counts["write_errors"] += 1
                n = self._counts["write_errors"]
            if n & (n - 1) == 0:                          # the 1st, 2nd, 4th, 8th...: a full disk cannot flood the log
                log.warning("kv disk: cannot write %s (%d write errors so far): %s", final, n, e)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return []

    # -- index upkeep --------------------------------------------------------------------------

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self._dir / name[:2] / f"{name}.kvb"

    def _over_budget(self) -> list[bytes]:
        """Pop least recently used entries until the total fits; their files are for the caller to unlink."""
        victims = []
        with self._cv:
            while self._total > self.max_bytes and self._index:
                block_hash, entry = self._index.popitem(last=False)
                self._total -= entry.size
                self._counts["evictions"] += 1
                victims.append(block_hash)
        return victims

    def _unlink(self, victims: list[bytes]) -> None:
        for block_hash in victims:
            try:
                self._path(block_hash).unlink(missing_ok=True)
            except OSError as e:
                log.warning("kv disk: cannot evict %s: %s", self._path(block_hash), e)

    def _forget(self, block_hash: bytes, entry: _Entry, reason: str | None) -> None:
        """Drop a file that could not be served: a miss, and for a rejected one its count and its removal."""
        with self._cv:
            self._counts["misses"] += 1
            if reason is not None:
                self._counts["rejected"] += 1
                self._counts[f"rejected_{reason}"] += 1
            if self._index.get(block_hash) is not entry:   # already gone, or replaced by a fresh write
                return
            del self._index[block_hash]
            self._total -= entry.size
            if reason is not None and reason != "unreadable":
                try:
                    self._path(block_hash).unlink(missing_ok=True)
                except OSError:
                    pass

    def _scan(self) -> None:
        """Index the files a previous process left, oldest modification first; remove stale temp files."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in os.scandir(self._dir):
            if not (sub.is_dir(follow_symlinks=False) and re.fullmatch(r"[0-9a-f]{2}", sub.name)):
                continue
            check_safe(Path(sub.path))
            for f in os.scandir(sub.path):
                try:
                    st = f.stat(follow_symlinks=False)
                    if f.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                        os.unlink(f.path)
                    elif _NAME.fullmatch(f.name) and f.name.startswith(sub.name) and f.is_file(follow_symlinks=False):
                        found.append((st.st_mtime, bytes.fromhex(f.name[:-4]), st.st_size))
                except (OSError, ValueError):
                    continue
        for _, block_hash, size in sorted(found):
            self._index[block_hash] = _Entry(size)
            self._total += size
