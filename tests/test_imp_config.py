"""imp's operator surface: its sectioned TOML config, OTLP/JSON, service.name, /health's pool fields."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import httpx
import pytest
from support.otlp_receiver import parse_json_request
from support.servers import FakeEngine, app_in_thread, fake_tokenizer, wait_for

from imp_jax.server.cli import parse_config
from imp_jax.server.config import ServerConfig


@dataclasses.dataclass
class _EngineConfig:
    model: str = "default-model"
    dtype: str = "auto"
    max_num_seqs: int = 32
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    session_ttl_s: float = 600.0
    speculative: str = "on"
    speculative_max_draft: int = 7


IMP_TOML = """
max_num_batched_tokens = 64     # our flat keys still work beside imp's sections

[server]
host = "0.0.0.0"
port = 9100
otlp_endpoint = "http://collector:4318/v1/traces"
session_ttl_s = 30
model_swap_drain_ms = 2500
rate_limit = 60

[model]
path = "smollm2-135m-instruct"

[runtime]
max_batch_size = 4
max_seq_len = 1024

[kv_cache]
block_size = 32
dtype = "bfloat16"
growable = false

[speculative]
enabled = false
max_draft = 3
mtp_k = 0
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "imp.toml"
    path.write_text(text)
    return path


def _refused(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(["--config", str(_write(tmp_path, text)), *argv], EngineConfigWithBatch)
    assert e.value.code == 2
    return capsys.readouterr().err


@dataclasses.dataclass
class EngineConfigWithBatch(_EngineConfig):
    max_num_batched_tokens: int = 512


def test_imp_sections_map_onto_our_settings(tmp_path: Path) -> None:
    config = parse_config(["--config", str(_write(tmp_path, IMP_TOML)), "--port", "9200"], EngineConfigWithBatch)
    assert (config.host, config.port, config.rate_limit) == ("0.0.0.0", 9200, 60)   # flags still win
    assert config.otlp_endpoint == "http://collector:4318/v1/traces" and config.swap_timeout == 2.5
    assert config.engine == EngineConfigWithBatch(
        model="smollm2-135m-instruct", max_num_seqs=4, max_model_len=1024, block_size=32, kv_cache_dtype="bfloat16",
        session_ttl_s=30, speculative="off", speculative_max_draft=3, max_num_batched_tokens=64)


def test_our_own_names_are_accepted_in_their_section(tmp_path: Path) -> None:
    text = "[server]\nmax-queued-requests = 7\n[runtime]\nmax_num_seqs = 2\n"
    config = parse_config(["--config", str(_write(tmp_path, text))], EngineConfigWithBatch)
    assert config.max_queued_requests == 7 and config.engine.max_num_seqs == 2


def test_every_unknown_key_and_section_is_named_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(tmp_path, "bogus = 1\n[server]\nportt = 1\n[runtime]\nhost = 'x'\n[gpu]\nid = 0\n", capsys)
    for name in ("'bogus'", "'server.portt'", "'runtime.host'", "[gpu]"):
        assert name in err, err
    assert "Configuration file" in err and len(err.strip().splitlines()[-1]) > 0


@pytest.mark.parametrize("text, why", [
    ("[server]\nmodel_swap = true\n", "server.model_swap is not supported: swapping is on whenever --models-dir"),
    ("[runtime]\nadmission_decode_tokens = 64\n", "runtime.admission_decode_tokens is not supported"),
    ("[kv_cache]\ngrowable = true\n", "kv_cache.growable = True is not supported: the KV pool is fixed-size"),
    ("[speculative]\nmtp_k = 2\n", "speculative.mtp_k = 2 is not supported: there is no MTP head"),
])
def test_imp_keys_we_cannot_honour_are_a_startup_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       text: str, why: str) -> None:
    assert why in _refused(tmp_path, text, capsys)


def test_a_bad_value_in_a_section_is_refused_naming_the_setting(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert "otlp_protocol" in _refused(tmp_path, "[server]\notlp_protocol = 'grpc'\n", capsys)


def test_service_name_defaults_to_imps_and_follows_otel_service_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    assert ServerConfig().otlp_service_name == "imp-server" and ServerConfig().otlp_protocol == "http/json"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "from-env")
    assert ServerConfig().otlp_service_name == "from-env"
    assert ServerConfig(otlp_service_name="flag").otlp_service_name == "flag"   # the flag wins over the env


def test_otlp_json_follows_the_spec_encoding() -> None:
    """lowerCamelCase, hex ids, integer enums, 64-bit integers as strings; a strict receiver decodes it."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from opentelemetry.trace import SpanKind

    from imp_jax.server.otlp_json import to_otlp_json

    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "s"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracer = provider.get_tracer("t")
    with tracer.start_as_current_span("root", kind=SpanKind.SERVER) as root:
        root.set_attributes({"n": 7, "xs": ["a"], "ok": True})
        with tracer.start_as_current_span("child"):
            pass
    body = to_otlp_json(memory.get_finished_spans())
    spans = {s["name"]: s for s in body["resourceSpans"][0]["scopeSpans"][0]["spans"]}
    ctx = root.get_span_context()
    assert spans["root"]["traceId"] == format(ctx.trace_id, "032x") and spans["root"]["spanId"] == format(ctx.span_id, "016x")
    assert spans["child"]["parentSpanId"] == spans["root"]["spanId"]
    assert spans["root"]["kind"] == 2 and spans["child"]["kind"] == 1
    assert isinstance(spans["root"]["startTimeUnixNano"], str) and int(spans["root"]["startTimeUnixNano"]) > 0
    assert {"key": "n", "value": {"intValue": "7"}} in spans["root"]["attributes"]
    decoded = parse_json_request(json.dumps(body).encode())
    assert decoded.resource_spans[0].scope_spans[0].spans[0].trace_id.hex() == format(ctx.trace_id, "032x")


def test_kv_pool_floored_when_the_budget_is_below_the_floor() -> None:
    from imp_jax.model.config import ModelConfig
    from imp_jax.runtime.config import KV_FLOOR_BLOCKS, EngineConfig, kv_pool_floored, num_kv_blocks

    model = ModelConfig(architecture="LlamaForCausalLM", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                        num_kv_heads=2, head_dim=8, max_position_embeddings=64)
    tiny = EngineConfig(kv_cache_memory=100)   # 100 bytes on CPU: not one block
    assert num_kv_blocks(tiny, model, 4, "cpu", None) == KV_FLOOR_BLOCKS and kv_pool_floored(tiny, model, 4, "cpu", None)
    assert not kv_pool_floored(EngineConfig(), model, 4, "cpu", None)
    assert not kv_pool_floored(EngineConfig(num_kv_blocks=2), model, 4, "cpu", None)   # asked for: not a rescue


class _FlooredEngine(FakeEngine):
    floored = 0

    def stats(self) -> dict:
        return {**super().stats(), "kv_blocks_total": 2, "kv_block_size": 16, "kv_pool_floored": self.floored}


def test_health_is_503_kv_pool_floored_with_the_pool_fields() -> None:
    from imp_jax.server.app import create_app

    engine = _FlooredEngine(fake_tokenizer())
    engine.start()
    with app_in_thread(create_app(engine, ServerConfig())) as url:
        wait_for(url + "/ready", 200, timeout=30)
        assert httpx.get(url + "/health").json()["kv_pool_floored"] is False
        engine.floored = 1
        r = httpx.get(url + "/health")
    body = r.json()
    assert r.status_code == 503 and body["status"] == "unhealthy" and body["code"] == "kv_pool_floored"
    assert body["kv_pool_floored"] is True and body["kv_pool_growable"] is False
    assert body["kv_ceiling_blocks"] == body["kv_blocks_total"] == 2 and body["kv_capacity_tokens"] == 32
    assert body["kv_pool_bandwidth_gbps"] == 0.0


# --------------------------------------------------------------------------- a real server, imp's config file
@pytest.mark.real_model
def test_a_real_server_started_from_imps_config_exports_protobuf(tmp_path: Path) -> None:
    """SmolLM2 from a sectioned TOML: the mapped settings hold, /health and /metrics carry the pool fields,
    and a request's span reaches the collector as OTLP protobuf under imp's service.name."""
    from support.otlp_receiver import OTLPReceiver
    from support.metrics_text import parse, value
    from support.servers import MODEL, READY_TIMEOUT_S, LiveServer

    receiver = OTLPReceiver()
    config = _write(tmp_path, f"""
[server]
otlp_endpoint = "{receiver.url}"
otlp_protocol = "http/protobuf"
max_queued_requests = 3

[model]
path = "{MODEL}"

[runtime]
max_batch_size = 8
max_seq_len = 1024
max_num_batched_tokens = 64

[kv_cache]
num_blocks = 256
growable = false
""")
    live = LiveServer(["--config", str(config)], tmp_path / "server.log", env={"OTEL_SERVICE_NAME": ""})
    try:
        wait_for(live.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=live.proc)
        health = httpx.get(live.url + "/health").json()
        assert health["kv_blocks_total"] == health["kv_ceiling_blocks"] == 255   # block 0 is the null block
        assert health["kv_pool_growable"] is False and health["kv_pool_floored"] is False
        r = httpx.post(live.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "temperature": 0, "repetition_penalty": 1.0}, headers={"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-01"})
        assert r.status_code == 200, r.text
        root = [s for s in receiver.wait_for("ab" * 16, 4) if s.name == "/v1/chat/completions"][0]
        assert root.encoding == "protobuf" and root.service == "imp-server"
        assert receiver.content_types[-1] == "application/x-protobuf"
        metrics = parse(httpx.get(live.url + "/metrics").text)
        assert value(metrics, "imp_kv_pool_growths_total") == 0
        assert value(metrics, "imp_otlp_spans_exported_total") >= 4
        log = live.log_text()
        assert "OTLP: exporting spans to" in log and "http/protobuf" in log
        assert live.stop() == 0
    finally:
        live.stop()
        receiver.stop()
