"""A server on loopback, for the scripts and the tests that start one: a free port, and waiting until a URL
answers."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, status: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers `status`; fail early if `proc` died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered {status}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5).status_code == status:
                return
        time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer {status} within {timeout}s")
