"""`--log-requests FILE`: one JSON line per request, appended by a writer thread off the request path.

The request path only puts the entry on a bounded queue; if the disk falls that far behind,
lines are dropped and counted (`imp_request_log_dropped_total`) rather than holding requests up.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("imp_jax.server")
MAX_PENDING_LINES = 10_000
_STOP = object()


class RequestLog:
    """Appends JSON lines to `path` (opened now, so a bad path fails at start-up)."""

    def __init__(self, path: str | Path, on_drop: Callable[[], None] = lambda: None):
        self.path = Path(path)
        try:
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--log-requests {path}: {e}") from None
        self._on_drop = on_drop
        self._queue: queue.Queue = queue.Queue(MAX_PENDING_LINES)
        self._thread = threading.Thread(target=self._write, name="imp-request-log", daemon=True)
        self._thread.start()

    def write(self, entry: dict[str, Any]) -> None:
        """Queue one line; never blocks."""
        try:
            self._queue.put_nowait(json.dumps(entry, ensure_ascii=False, separators=(",", ":")))
        except queue.Full:
            self._on_drop()

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued, then stop."""
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _write(self) -> None:
        try:
            while (line := self._queue.get()) is not _STOP:
                self._file.write(line + "\n")
                if self._queue.empty():
                    self._file.flush()
        except OSError:
            log.exception("the request log %s failed; no more lines are written", self.path)
        finally:
            self._file.close()
