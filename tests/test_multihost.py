"""Tensor parallelism across processes (--coordinator, jax.distributed): two server processes on loopback,
one CPU device each (gloo collectives), process 0 serving HTTP, against the one-process server (both
`--gemm exact`: under int8 activations a sum split over processes rounds differently)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tiny_models import write_tiny_tokenizer
from support.servers import LiveServer, free_port, wait_for

TP_ARGS = ["--max-num-seqs", "1", "--max-num-batched-tokens", "32", "--max-model-len", "256", "--num-kv-blocks", "32"]
ONE_DEVICE = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}   # each process: one CPU device


class Pair:
    """Process 0 (a LiveServer) and process 1 (no HTTP) of one model over 2 processes."""

    def __init__(self, model: str, tmp: Path, name: str, sizes: list[str] = TP_ARGS):
        common = ["--model", model, "--gemm", "exact", *sizes, "--tensor-parallel-size", "2",
                  "--coordinator", f"127.0.0.1:{free_port()}", "--num-processes", "2"]
        self.follower_log = tmp / f"{name}-1.log"
        with open(self.follower_log, "w") as log:
            self.follower = subprocess.Popen([sys.executable, "-m", "imp_jax.server", *common, "--process-id", "1"],
                                             stdout=log, stderr=subprocess.STDOUT, env=ONE_DEVICE)
        self.leader = LiveServer([*common, "--process-id", "0"], tmp / f"{name}-0.log")

    def logs(self) -> str:
        return self.leader.log_text()[-3000:] + "\n--- process 1:\n" + self.follower_log.read_text()[-3000:]

    def close(self) -> None:
        self.leader.stop(timeout=20)
        if self.follower.poll() is None:
            self.follower.kill()
        self.follower.wait()


def _chat(url: str, **extra) -> httpx.Response:
    body = {"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_two_processes_answer_as_one_and_a_lost_process_faults_the_engine(tmp_path, exact_server):
    """SmolLM2 over 2 processes: greedy chat and prompt logprobs as the one-process server; then process 1
    is killed mid-stream: the stream ends with engine_faulted naming it, the next request too, /ready says
    so, /health still answers."""
    ref_url = exact_server.url
    completion = {"model": "smollm2-135m-instruct", "prompt": "The capital of France is", "max_tokens": 4,
                  "temperature": 0, "prompt_logprobs": 1}
    reference = _chat(ref_url)
    ref_scored = httpx.post(ref_url + "/v1/completions", json=completion, timeout=120)
    assert reference.status_code == 200 and ref_scored.status_code == 200
    pair = Pair("smollm2-135m-instruct", tmp_path, "smol")
    try:
        wait_for(pair.leader.url + "/ready", 200, timeout=900, proc=pair.leader.proc)
        reply = _chat(pair.leader.url)
        assert reply.status_code == 200, pair.logs()
        assert reply.json()["choices"][0]["message"] == reference.json()["choices"][0]["message"]
        scored = httpx.post(pair.leader.url + "/v1/completions", json=completion, timeout=120).json()["choices"][0]
        expect = ref_scored.json()["choices"][0]
        assert scored["text"] == expect["text"]
        for got, want in zip(scored["prompt_logprobs"][1:], expect["prompt_logprobs"][1:], strict=True):
            assert got.keys() == want.keys()
            for tok in got:
                assert abs(got[tok]["logprob"] - want[tok]["logprob"]) < 1e-3
        assert "process 1 of 2 joined" in pair.follower_log.read_text()

        body = {"model": "smollm2-135m-instruct", "max_tokens": 200, "temperature": 0, "stream": True,
                "ignore_eos": True, "messages": [{"role": "user", "content": "Count to one hundred."}]}
        events, t0 = [], time.monotonic()
        with httpx.stream("POST", pair.leader.url + "/v1/chat/completions", json=body, timeout=60) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 3:
                        pair.follower.send_signal(signal.SIGKILL)
        assert time.monotonic() - t0 < 45
        assert "error" in events[-1] and events[-1]["error"]["code"] == "engine_faulted", events[-1]
        assert "process 1 of 2 lost" in events[-1]["error"]["message"]
        assert len(events) < 150   # it ended early, not after its 200 tokens

        after = _chat(pair.leader.url)
        assert after.status_code == 500 and after.json()["error"]["code"] == "engine_faulted"
        ready = httpx.get(pair.leader.url + "/ready")
        assert ready.status_code == 503 and ready.json()["code"] == "engine_faulted"
        assert "process 1 of 2 lost" in ready.json()["message"]
        health = httpx.get(pair.leader.url + "/health")
        assert health.status_code == 503 and health.json()["code"] == "engine_faulted"
    finally:
        pair.close()


def test_process_1_exits_when_process_0_dies(tmp_path):
    """A follower never hangs on a dead leader: killed process 0, process 1 exits (a failed collective or
    the coordinator's heartbeat)."""
    from tiny_models import write_tiny_hf

    write_tiny_hf("LlamaForCausalLM", tmp_path / "tiny", num_attention_heads=8, num_key_value_heads=4)
    write_tiny_tokenizer(tmp_path / "tiny")
    pair = Pair(str(tmp_path / "tiny"), tmp_path, "tiny", ["--max-num-seqs", "1", "--max-num-batched-tokens", "16",
                                                           "--max-model-len", "64", "--num-kv-blocks", "8"])
    try:
        wait_for(pair.leader.url + "/ready", 200, timeout=300, proc=pair.leader.proc)
        assert httpx.post(pair.leader.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}).status_code == 200
        pair.leader.proc.send_signal(signal.SIGKILL)
        assert pair.follower.wait(timeout=30) != 0, pair.logs()
        assert "multi-host:" in pair.follower_log.read_text()
    finally:
        pair.close()


@pytest.mark.parametrize("flags, message", [
    (["--data-parallel-size", "2"], "--data-parallel-size cannot be combined with --num-processes 2"),
    (["--max-loras", "2"], "LoRA adapters"),
    (["--coordinator", "8.8.8.8:7777"], "pass --coordinator-insecure-ok"),
])
def test_what_multi_host_cannot_do_is_refused_at_start_up(flags, message):
    proc = subprocess.run([sys.executable, "-m", "imp_jax.server", "--coordinator", "127.0.0.1:1", "--num-processes",
                           "2", "--tensor-parallel-size", "2", *flags], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_multi_host_flags_go_together():
    from imp_jax.runtime.config import EngineConfig

    with pytest.raises(ValueError, match="--process-id 2 must be in"):
        EngineConfig(coordinator="h:1", num_processes=2, process_id=2)
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(num_processes=2)
    with pytest.raises(ValueError, match="go together"):
        EngineConfig(coordinator="h:1")


@pytest.mark.parametrize("host, public", [
    ("10.0.0.1", []), ("192.168.1.2", []), ("127.0.0.1", []), ("::1", []), ("fd00::1", []), ("fe80::1%lo", []),
    ("localhost", []), ("8.8.8.8", ["8.8.8.8"]), ("2001:4860::8888", ["2001:4860::8888"]),
    ("0.0.0.0", ["0.0.0.0"]), ("::", ["::"]), ("::ffff:8.8.8.8", ["::ffff:8.8.8.8"]),
])
def test_coordinator_addresses_are_classified(host, public):
    """Private (RFC 1918, fc00::/7, link-local) and loopback pass; global and every-interface ones do not."""
    from imp_jax.runtime.parallel.multihost import public_addresses

    assert public_addresses(host) == public


def test_a_coordinator_hostname_is_classified_by_what_it_resolves_to(monkeypatch):
    import socket

    from imp_jax.runtime.parallel.multihost import coordinator_host, public_addresses

    resolved = {"lan.example": ["10.1.2.3"], "mixed.example": ["10.1.2.3", "8.8.4.4"]}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, **kw: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, 0)) for a in resolved[host]])
    assert public_addresses("lan.example") == [] and public_addresses("mixed.example") == ["8.8.4.4"]
    assert coordinator_host("[fd00::1]:7777") == "fd00::1" and coordinator_host("lan.example:7777") == "lan.example"


def test_a_public_coordinator_is_refused_without_insecure_ok():
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.parallel.multihost import check_config

    config = EngineConfig(coordinator="8.8.8.8:7777", num_processes=2, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="unauthenticated and carry every prompt's token ids in the clear"):
        check_config(config)
    with pytest.raises(ValueError, match="does not resolve"):
        check_config(EngineConfig(coordinator="no-such-host.invalid:7777", num_processes=2))
    check_config(EngineConfig(coordinator="8.8.8.8:7777", num_processes=2, coordinator_insecure_ok=True))
    check_config(EngineConfig(coordinator="10.0.0.1:7777", num_processes=2))


def test_the_coordinator_binds_only_the_address_it_names(monkeypatch):
    """JAX's default binds every interface ([::]:PORT); process 0 binds --coordinator's address."""
    import jax

    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.parallel.multihost import initialize

    calls = []

    def joined(**kwargs):
        calls.append(kwargs)
        raise RuntimeError("not joining in a test")
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    monkeypatch.setattr(jax.distributed, "initialize", joined)
    with pytest.raises(RuntimeError, match="not joining"):
        initialize(EngineConfig(coordinator="10.0.0.1:7777", num_processes=2))
    assert calls[0]["coordinator_bind_address"] == "10.0.0.1:7777"
