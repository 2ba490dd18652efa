"""Probes and descriptions (/health, /ready, /v1/models, /props, /info) and /tokenize, /detokenize, live."""
from __future__ import annotations

import httpx
import pytest
from support.servers import MODEL, LiveServer, live_server  # noqa: F401

pytestmark = pytest.mark.real_model


def test_it_listened_while_loading(live_server: LiveServer) -> None:
    """The fixture asked before the model was ready: /health was 200, /ready 503 loading."""
    assert live_server.early_health["status"] == "ok"
    status, body = live_server.early_ready  # asked as soon as /health answered: loading takes many seconds
    assert status == 503 and body["code"] == "loading" and body["state"] in ("loading", "warming_up")
    assert live_server.early_health["state"] in ("loading", "warming_up")


def test_health_and_ready(live_server: LiveServer) -> None:
    health = httpx.get(live_server.url + "/health")
    assert health.status_code == 200
    body = health.json()
    assert body["status"] == "ok" and body["state"] == "ready" and body["model_loaded"] is True
    assert body["baseline_free_blocks"] > 0 and body["compilations_after_warmup"] == 0
    assert body["kv_capacity_tokens"] == body["kv_blocks_total"] * body["kv_block_size"] > 0
    assert body["kv_ceiling_blocks"] == body["kv_blocks_total"] and body["kv_pool_growable"] is False
    assert body["kv_pool_floored"] is False and body["kv_pool_bandwidth_gbps"] == 0.0   # fixed pool, never probed
    assert body["suspended"] is False
    ready = httpx.get(live_server.url + "/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["model"] == MODEL


def test_models(live_server: LiveServer) -> None:
    body = httpx.get(live_server.url + "/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["loaded"] is True and card["max_model_len"] == 1024
    assert card["object"] == "model" and isinstance(card["created"], int)


def test_props_is_the_llama_cpp_shape(live_server: LiveServer) -> None:
    body = httpx.get(live_server.url + "/props").json()
    settings = body["default_generation_settings"]
    assert settings["n_ctx"] == 1024 and settings["model"] == MODEL
    assert {"temperature", "top_k", "top_p", "min_p", "repeat_penalty"} <= set(settings["params"])
    assert body["total_slots"] == 8 and "<|im_start|>" in body["chat_template"]
    assert body["eos_token"] == "<|im_end|>" and body["bos_token"] == "<|im_start|>"
    assert body["modalities"] == {"vision": False, "audio": False}   # SmolLM2: text only
    assert body["image_limits"] == {"max_image_bytes": 20 << 20, "max_images_per_request": 16,
                                    "max_image_pixels": 33_177_600, "max_video_frames": 32,
                                    "max_request_bytes": 4 << 20}   # derived from the 1024 context's prompt limit


def test_info_is_the_tgi_shape(live_server: LiveServer) -> None:
    body = httpx.get(live_server.url + "/info").json()
    assert body["model_id"] == MODEL and body["max_total_tokens"] == 1024 and body["max_input_tokens"] == 1023
    assert body["max_best_of"] == 1 and body["max_concurrent_requests"] == 8
    assert {"model_dtype", "model_device_type", "version", "router", "max_stop_sequences"} <= set(body)
    assert body["model_dtype"] == "float32" and body["model_device_type"] == "cpu"


def test_tokenize_and_detokenize_round_trip(live_server: LiveServer) -> None:
    url = live_server.url
    text = "Hello, world! héllo 🙂"
    llama = httpx.post(url + "/tokenize", json={"content": text}).json()
    vllm = httpx.post(url + "/tokenize", json={"prompt": text, "model": MODEL}).json()
    assert llama["tokens"] == vllm["tokens"] and llama["count"] == len(llama["tokens"])  # SmolLM2 adds no BOS
    assert vllm["max_model_len"] == 1024
    back = httpx.post(url + "/detokenize", json={"tokens": llama["tokens"]}).json()
    assert back["content"] == back["prompt"] == text
    pieces = httpx.post(url + "/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == llama["tokens"] and "".join(p["piece"] for p in pieces) == text


def test_tokenize_messages_renders_the_chat_template(live_server: LiveServer) -> None:
    url = live_server.url
    messages = [{"role": "user", "content": "hi"}]
    ids = httpx.post(url + "/tokenize", json={"messages": messages}).json()["tokens"]
    text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["content"]
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenize_wrong_model_is_a_404(live_server: LiveServer) -> None:
    r = httpx.post(live_server.url + "/tokenize", json={"content": "x", "model": "other"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
