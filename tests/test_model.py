"""The decoder family on tiny random checkpoints: ragged paged forward vs dense math and vs transformers."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.loader import SafetensorsDir
from imp_jax.model.weights import WeightFormats, narrow_exact_bf16
from imp_jax.runtime.execution.batch import SeqChunk
from paged import PagedRunner, assert_close, host_kernels, random_prompts
from support.models import build
from tiny_models import ARCHS, write_tiny_hf


@pytest.fixture(scope="module", params=sorted(ARCHS))
def tiny(request, tmp_path_factory):
    """(config, HF tensors, transformers model, PagedRunner) for one tiny architecture."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_hf(request.param, path)
    cfg = ModelConfig.from_file(path / "config.json")
    tensors = SafetensorsDir(path)
    return cfg, tensors, hf_model, PagedRunner(build(cfg, tensors))


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _rope(x, pos, inv_freq):
    ang = pos[:, None] * inv_freq[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * c - x[..., h:] * s, x[..., h:] * c + x[..., :h] * s], -1)


def dense_forward(cfg: ModelConfig, t, ids) -> np.ndarray:
    """Logits of a whole sequence with dense causal attention, straight from the HF tensors (float64)."""
    g = lambda name: np.asarray(t[name], np.float64)
    n, D = len(ids), cfg.head_dim
    pos = np.arange(n, dtype=np.float64)
    inv = cfg.rope_inv_freq()
    x = g("model.embed_tokens.weight")[ids]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        h = _rms(x, g(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        proj = {}
        for name in "qkv":
            y = h @ g(p + f"self_attn.{name}_proj.weight").T
            if cfg.attention_bias:
                y = y + g(p + f"self_attn.{name}_proj.bias")
            proj[name] = y.reshape(n, -1, D)
        q, k, v = proj["q"], proj["k"], proj["v"]
        if cfg.qk_norm:
            q = _rms(q, g(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps)
            k = _rms(k, g(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps)
        q, k = _rope(q, pos, inv), _rope(k, pos, inv)
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D)
        qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
        mask = ki <= qi
        if cfg.sliding_window:
            mask &= ki > qi - cfg.sliding_window
        s = np.where(mask[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        o = np.einsum("hqk,khd->qhd", a, v).reshape(n, -1)
        x = x + o @ g(p + "self_attn.o_proj.weight").T
        h = _rms(x, g(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        gate, up = h @ g(p + "mlp.gate_proj.weight").T, h @ g(p + "mlp.up_proj.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ g(p + "mlp.down_proj.weight").T
    x = _rms(x, g("model.norm.weight"), cfg.rms_norm_eps)
    head = g("model.embed_tokens.weight") if cfg.tie_word_embeddings else g("lm_head.weight")
    return x @ head.T


def test_ragged_batch_matches_dense_attention(tiny):
    cfg, tensors, _, runner = tiny
    prompts = random_prompts([5, 17, 33, 1], cfg.vocab_size)
    tables = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]   # non-contiguous pages, not aligned to lengths
    out = runner.run([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    for p, got in zip(prompts, out):
        assert_close(got, dense_forward(cfg, tensors, p))


def test_prefill_then_decode_equals_one_prefill(tiny):
    cfg, tensors, _, runner = tiny
    a, b = random_prompts([30, 21], cfg.vocab_size, seed=1)
    ta, tb = [10, 11], [12, 13]
    # chunked prefill of a (two chunks) mixed with a one-shot prefill of b, then decodes of both
    first = runner.run([SeqChunk(a[:13], 0, ta), SeqChunk(b[:18], 0, tb)])
    second = runner.run([SeqChunk(a[13:27], 13, ta), SeqChunk([b[18]], 18, tb)])
    steps = [runner.run([SeqChunk([a[i]], i, ta), SeqChunk([b[19 + i - 27]], 19 + i - 27, tb)])
             for i in range(27, 29)]
    got_a = np.concatenate([first[0], second[0]] + [s[0] for s in steps])
    got_b = np.concatenate([first[1], second[1]] + [s[1] for s in steps])
    assert_close(got_a, dense_forward(cfg, tensors, a[:29]))
    assert_close(got_b, dense_forward(cfg, tensors, b[:21]))


def test_logits_and_greedy_tokens_match_transformers(tiny):
    cfg, _, hf_model, runner = tiny
    prompt = random_prompts([12], cfg.vocab_size, seed=2)[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([prompt])).logits[0].numpy()
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    logits, tokens = runner.greedy(prompt, 6, [20, 21])
    assert np.max(np.abs(logits - ref)) <= 1e-3 * np.ptp(ref)
    assert tokens == hf_tokens


def test_scan_and_unrolled_layer_loops_agree(tmp_path):
    write_tiny_hf("LlamaForCausalLM", tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    tensors = SafetensorsDir(tmp_path)
    prompt = random_prompts([9], cfg.vocab_size, seed=3)[0]
    outs = []
    for loop in ("scan", "unroll"):
        model = build(cfg, tensors, layer_loop=loop)
        outs.append(PagedRunner(model).run([SeqChunk(prompt, 0, [1])], num_tokens=16, num_seqs=1)[0])
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def test_bfloat16_model_tracks_float32(tiny):
    cfg, tensors, _, _ = tiny
    model = build(cfg, tensors, jnp.bfloat16)
    prompt = random_prompts([10], cfg.vocab_size, seed=4)[0]
    got = PagedRunner(model).run([SeqChunk(prompt, 0, [1])], num_tokens=16, num_seqs=1)[0]
    assert_close(got, dense_forward(cfg, tensors, prompt), tol=5e-2)


def test_a_bf16_checkpoint_keeps_its_matrices_in_bf16_with_the_same_logits(tmp_path):
    """Weights that are all bf16 values are kept as bf16 where the CPU GEMM kernel runs: half the
    bytes, the same products. Values that are not bf16 stay float32."""
    write_tiny_hf("LlamaForCausalLM", tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    tensors = {k: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for k, v in SafetensorsDir(tmp_path).items()}
    formats = WeightFormats.for_model(host_kernels(cfg), jnp.float32)
    plain, kept = build(cfg, tensors), build(cfg, tensors)
    saved = narrow_exact_bf16(kept, formats)
    if not formats.exact_bf16:
        assert saved == 0
        pytest.skip("no CPU GEMM kernel here: matrices stay float32")
    matrices = [w for ws in kept.layers.matrices().values() for w in ws] + [kept.embed[...], kept.lm_head[...]]
    assert {w.dtype for w in matrices} == {jnp.dtype(jnp.bfloat16)}
    assert saved == sum(w.size * 2 for w in matrices)
    prompt = random_prompts([9], cfg.vocab_size, seed=5)[0]
    chunks = [SeqChunk(prompt, 0, [1])]
    # 9 rows: the float32 and the bf16 kernel, the same summation order, so the same bits
    np.testing.assert_array_equal(PagedRunner(kept).run(chunks, 16, 1)[0], PagedRunner(plain).run(chunks, 16, 1)[0])

    noisy = build(cfg, tensors)
    noisy.embed.set_value(noisy.embed[...] + 1e-3)   # no longer bf16 values
    narrow_exact_bf16(noisy, formats)
    assert noisy.embed[...].dtype == jnp.float32 and noisy.lm_head[...].dtype == jnp.bfloat16


def test_rms_norm_gives_a_row_the_same_bits_whatever_its_batch():
    """XLA's own row reductions change their summation order with the array's size (on a CPU, 1-7
    rows of 576 differ from 8+); layers.row_sum fixes the order, so a row's norm is the same at
    every step size."""
    import jax

    from imp_jax.model.layers import rms_norm

    rng = np.random.default_rng(0)
    for d in (64, 100, 576):
        x = rng.standard_normal((256, d)).astype(np.float32) * 3
        w = rng.standard_normal(d).astype(np.float32)
        norm = jax.jit(lambda x: rms_norm(x, w, 1e-5))
        whole = np.asarray(norm(x))
        for t in (1, 2, 5, 8, 9, 16, 64):
            np.testing.assert_array_equal(np.asarray(norm(x[:t])), whole[:t])
        np.testing.assert_allclose(whole, _rms(x.astype(np.float64), w, 1e-5), rtol=1e-5, atol=1e-5)
