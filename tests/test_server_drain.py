"""Graceful shutdown: SIGTERM stops admitting (503 draining), the stream in flight completes, and
the process exits 0 (a server of its own: the session servers end their sessions)."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from support.servers import MODEL, READY_TIMEOUT_S, REAL_ENGINE_ARGS, LiveServer, parse_sse, wait_for


def test_sigterm_finishes_the_stream_in_flight_and_exits_0(smollm2_gguf_path: Path, tmp_path: Path) -> None:
    live = LiveServer([*REAL_ENGINE_ARGS, "--model", MODEL, "--drain-timeout", "120"], tmp_path / "server.log")
    try:
        wait_for(live.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=live.proc)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 160, "temperature": 0,
                "ignore_eos": True, "stream": True}
        first, raw = threading.Event(), []

        def read() -> None:
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=300) as r:
                for chunk in r.iter_text():
                    raw.append(chunk)
                    first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(120), "no first chunk"
        live.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        while (ready := httpx.get(live.url + "/ready")).status_code == 200:
            assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
            time.sleep(0.05)
        assert ready.json()["code"] == "draining"
        refused = httpx.post(live.url + "/v1/completions", json={**body, "stream": False}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert reader.is_alive(), "the stream ended before the drain could be observed"
        reader.join(300)
        frames = parse_sse("".join(raw))
        assert frames[-1] == (None, "[DONE]")
        chunks = [json.loads(d) for _, d in frames[:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) > 100   # the whole answer came
        assert live.proc.wait(60) == 0
        assert "shutting down: finishing 1 in-flight request(s)" in live.log_text()
    finally:
        live.stop()


def test_a_model_that_cannot_load_ends_the_process_with_1(tmp_path: Path) -> None:
    """A bad --model is a start-up failure a restart policy sees (exit 1, one line naming the path),
    not a server that stays up answering 503 engine_faulted."""
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    live = LiveServer(["--model", str(empty)], tmp_path / "server.log")
    try:
        assert live.proc.wait(120) == 1
        log = live.log_text()
        assert f"the model failed to load, exiting: engine failed to start: {empty}: not a model directory" in log
        assert "Traceback" not in log
    finally:
        live.stop()


def test_a_port_in_use_is_refused_before_loading_anything(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "imp_jax.server", "--host", "127.0.0.1", "--port", str(port),
                               "--model", "no-such-model-is-looked-up"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in proc.stderr
    assert "Traceback" not in proc.stderr and "no-such-model" not in proc.stderr
