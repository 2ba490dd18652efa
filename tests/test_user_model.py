"""The model contract (model/base.py), end to end: a user model class loaded by --model-class and
run by the engine generates what the same math in NumPy does."""
from __future__ import annotations

import uuid

import jax.numpy as jnp
import numpy as np

from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.loader import SafetensorsDir, load_model
from imp_jax.model.weights import WeightSource
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.parallel.sharding import default_mesh
from user_model_example import OneLayerLM


def numpy_greedy(cfg: ModelConfig, w: WeightSource, prompt: list[int], steps: int) -> list[int]:
    """OneLayerLM's math, dense and in float64, one whole forward per token."""
    E = w.matrix("model.embed_tokens.weight").astype(np.float64)
    proj = {p: w.matrix(f"model.layers.0.self_attn.{p}_proj.weight").astype(np.float64) for p in "qkvo"}
    norm, D, G = w.tensor("model.norm.weight"), cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    ids = list(prompt)
    for _ in range(steps):
        x = E[ids]
        angles = np.arange(len(ids))[:, None] * cfg.rope_inv_freq()[None, :]
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        rope = lambda t: np.concatenate([t[..., :D // 2] * cos - t[..., D // 2:] * sin,
                                         t[..., D // 2:] * cos + t[..., :D // 2] * sin], -1)
        q = rope((x @ proj["q"].T).reshape(len(ids), -1, D))
        k = np.repeat(rope((x @ proj["k"].T).reshape(len(ids), -1, D)), G, axis=1)
        v = np.repeat((x @ proj["v"].T).reshape(len(ids), -1, D), G, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(D) + np.triu(np.full((len(ids),) * 2, -np.inf), 1)
        p = np.exp(s - s.max(-1, keepdims=True))
        attn = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), v).reshape(len(ids), -1)
        h = (x + attn @ proj["o"].T)[-1]
        h = h / np.sqrt(np.mean(h * h) + cfg.rms_norm_eps) * norm
        ids.append(int(np.argmax(E @ h)))
    return ids[len(prompt):]


def test_a_user_model_class_serves_through_the_engine(tiny_hf_dir):
    loaded = load_model(tiny_hf_dir, dtype="float32", model_class="user_model_example:OneLayerLM")
    assert isinstance(loaded.model, OneLayerLM)
    config = EngineConfig(model=str(tiny_hf_dir), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                          block_size=16, num_kv_blocks=16)
    kv_shape = loaded.model.kv_cache_shape(16, 16)
    core = EngineCore(loaded, config, (jnp.zeros(kv_shape), jnp.zeros(kv_shape)), 16, default_mesh())
    core.step_fn.warm_up()
    prompt = [5, 17, 33, 2, 99, 140, 7, 12, 8, 61, 3, 44, 9, 18, 27, 36, 45, 54, 63]   # > one 16-token block
    events = []
    core.add_request(GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.0)), events.append)
    while core.has_work():
        core.step()
    got = [t for ev in events for t in ev.token_ids]
    want = numpy_greedy(loaded.config, WeightSource(SafetensorsDir(tiny_hf_dir)), prompt, 6)
    assert got == want
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    assert core.step_fn.compilations_after_warmup == 0


def test_a_user_model_class_serves_a_chat_through_the_server(tiny_hf_dir, tmp_path):
    """The researcher's path end to end: `python -m imp_jax.server --model DIR --model-class
    user_model_example:OneLayerLM` on loopback answers a chat request with the greedy tokens of the
    NumPy math over the prompt the chat template renders."""
    import os

    import httpx

    from imp_jax.model.text.tokenizer import Tokenizer
    from support.servers import LiveServer, wait_for

    tests_dir = os.path.dirname(os.path.abspath(__file__))
    live = LiveServer(["--model", str(tiny_hf_dir), "--model-class", "user_model_example:OneLayerLM",
                       "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "16",
                       "--num-kv-blocks", "16"], tmp_path / "server.log",
                      env={"PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])})
    try:
        wait_for(live.url + "/ready", 200, timeout=300, proc=live.proc)
        messages = [{"role": "user", "content": "hello world, the quick brown fox"}]
        r = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
            "model": tiny_hf_dir.name, "messages": messages, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        tok = Tokenizer.from_hf_dir(tiny_hf_dir)
        prompt = tok.encode_chat(tok.render_chat(messages, add_generation_prompt=True))
        assert body["usage"] == {**body["usage"], "prompt_tokens": len(prompt), "completion_tokens": 6}
        cfg = ModelConfig.from_file(tiny_hf_dir / "config.json")
        want = numpy_greedy(cfg, WeightSource(SafetensorsDir(tiny_hf_dir)), prompt, 6)
        # the NumPy math is OneLayerLM's (one layer), not that of the checkpoint's 2-layer Llama
        assert tok.decode(want).strip()   # text, not only special tokens
        assert body["choices"][0]["message"]["content"] == tok.decode(want)
    finally:
        assert live.stop() == 0, live.log_text()[-3000:]
