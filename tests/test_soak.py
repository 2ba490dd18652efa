"""A half-minute soak (scripts/soak.py) against the real engine: mixed, hostile traffic breaks nothing.

The long run is documented in docs/PERF.md; this one is 8 s of warm-up and 22 s of load, with
generous drain and hang limits so a loaded 2-core machine passes it when nothing is wrong.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.servers import LiveServer

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parent.parent


def test_half_minute_soak_breaks_nothing(reliability_server: LiveServer, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "soak.py"), "--url", reliability_server.url,
           "--pid", str(reliability_server.proc.pid), "--warmup", "8", "--duration", "22", "--concurrency", "6",
           "--idle-timeout", "120", "--seed", "1", "--out", str(out),
           "--server-log", str(reliability_server.log_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.exists(), proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert proc.returncode == 0 and summary["ok"], json.dumps(summary["problems"], indent=1)
    counts = summary["counts"]
    # the mix really was mixed: every kind of traffic happened, and valid requests finished
    for kind in ("normal:chat:stream", "normal:messages", "normal:responses:stream", "invalid", "probe",
                 "disconnect:chat:stream", "slow:messages:stream"):
        assert any(k.startswith(kind) for k in counts), (kind, counts)
    assert sum(n for k, n in counts.items() if k.startswith("finish:")) >= 20, counts
    assert summary["requests_after_warmup"] >= 40 and summary["rss_growth"] is not None
    assert reliability_server.proc.poll() is None


def test_the_server_caps_malloc_arenas_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the cap glibc's per-thread arenas read as ~5% RSS growth in the soak (docs/PERF.md)."""
    from imp_jax.server.__main__ import limit_malloc_arenas

    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False  # the operator's setting wins
    monkeypatch.delenv("MALLOC_ARENA_MAX")
    assert limit_malloc_arenas() is True  # glibc took M_ARENA_MAX
