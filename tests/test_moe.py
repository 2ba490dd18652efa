"""Mixture-of-experts models (model/architectures/moe.py) on tiny random checkpoints: routing and the expert FFN vs
NumPy, Mixtral / Qwen2-MoE / Qwen3-MoE vs transformers, GGUF vs safetensors, and the engine."""
from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest
import torch

from imp_jax.errors import ModelLoadError
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.loader import SafetensorsDir
from imp_jax.model.architectures.moe import EXPERT_IMPLS, expert_ffn, route
from imp_jax.runtime.execution.batch import SeqChunk
from paged import (PagedRunner, assert_close, check_llm_greedy, check_ragged_steps, hf_logits, random_prompts)
from support.moe_models import FAMILIES, write_moe_gguf, write_tiny_moe
from support.models import build




@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(config, HF tensors, transformers model, PagedRunner, path) for one MoE family."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_moe(request.param, path)
    cfg = ModelConfig.from_file(path / "config.json")
    tensors = SafetensorsDir(path)
    return cfg, tensors, hf_model, PagedRunner(build(cfg, tensors)), path


# ---------------------------------------------------------------------------------------- routing
def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("router,normalize", [("softmax_topk", False), ("softmax_topk", True),
                                              ("topk_softmax", False)])
def test_routing_matches_numpy_with_ties_to_the_lowest_expert(router, normalize):
    rng = np.random.default_rng(0)
    logits = rng.integers(0, 3, (64, 8)).astype(np.float32)   # values 0..2 over 8 experts: ties everywhere
    logits[0] = 1.0                                             # a row of one value: experts 0, 1, 2
    k = 3
    w, idx = route(jnp.asarray(logits), k, router, normalize)
    if router == "softmax_topk":
        p = _softmax(logits.astype(np.float64))
        ref_idx = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        ref_w = np.take_along_axis(p, ref_idx, -1)
        if normalize:
            ref_w = ref_w / ref_w.sum(-1, keepdims=True)
    else:
        ref_idx = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
        ref_w = _softmax(np.take_along_axis(logits, ref_idx, -1).astype(np.float64))
    np.testing.assert_array_equal(np.asarray(idx), ref_idx)
    np.testing.assert_allclose(np.asarray(w), ref_w, rtol=1e-6)
    assert np.asarray(idx)[0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("impl", EXPERT_IMPLS)
@pytest.mark.parametrize("real", [1, 5, 16])
@pytest.mark.parametrize("E", [6, 16])
def test_expert_ffn_matches_numpy_on_the_real_tokens(impl, real, E):
    rng = np.random.default_rng(1)
    T, H, I, k = 16, 32, 24, 2
    h = rng.standard_normal((T, H)).astype(np.float32)
    gate_up = rng.standard_normal((E, 2 * I, H)).astype(np.float32) * 0.2
    down = rng.standard_normal((E, H, I)).astype(np.float32) * 0.2
    w, idx = route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k, "softmax_topk", True)
    w, idx = np.asarray(w, np.float64), np.asarray(idx)
    ref = np.zeros((T, H))
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            gu = gate_up[e].astype(np.float64) @ h[t]
            g, u = gu[:I], gu[I:]
            ref[t] += w[t, j] * (down[e] @ (g / (1 + np.exp(-g)) * u))
    got = np.asarray(expert_ffn(jnp.asarray(h), jnp.asarray(w, jnp.float32), jnp.asarray(idx), jnp.asarray(gate_up),
                                jnp.asarray(down), impl, jnp.asarray(real)))
    np.testing.assert_allclose(got[:real], ref[:real], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ vs transformers
def test_logits_and_greedy_tokens_match_transformers(family):
    cfg, _, hf_model, runner, _ = family
    prompt = random_prompts([12], cfg.vocab_size, seed=2)[0]
    ref = hf_logits(hf_model, prompt)
    with torch.no_grad():
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    logits, tokens = runner.greedy(prompt, 6, [20, 21])
    assert_close(logits, ref, 1e-4)
    assert tokens == hf_tokens


def test_ragged_batch_with_prefill_chunks_and_decodes_matches_transformers(family):
    cfg, _, hf_model, runner, _ = family
    check_ragged_steps(runner, hf_model, cfg.vocab_size)


def test_bfloat16_model_tracks_transformers_float32(family):
    cfg, tensors, hf_model, _, _ = family
    prompt = random_prompts([10], cfg.vocab_size, seed=4)[0]
    got = PagedRunner(build(cfg, tensors, jnp.bfloat16)).run([SeqChunk(prompt, 0, [1])], num_tokens=16, num_seqs=1)[0]
    assert_close(got, hf_logits(hf_model, prompt), tol=5e-2)


def test_config_reads_each_familys_expert_fields(family):
    cfg, _, hf_model, _, _ = family
    hf = hf_model.config
    assert cfg.num_experts == (getattr(hf, "num_local_experts", None) or hf.num_experts) > 0
    assert cfg.num_experts_per_tok == hf.num_experts_per_tok
    if cfg.architecture == "MixtralForCausalLM":
        assert cfg.norm_topk_prob and cfg.moe_intermediate_size == 0 and all(map(cfg.is_sparse_layer, range(2)))
    if cfg.architecture == "Qwen2MoeForCausalLM":
        assert cfg.attention_bias and cfg.shared_expert_intermediate_size == 48
        assert [cfg.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    if cfg.architecture == "Qwen3MoeForCausalLM":
        assert cfg.qk_norm and cfg.norm_topk_prob and cfg.moe_intermediate_size == 32


@pytest.mark.parametrize("k", [None, 0, 9, "two"])
def test_a_bad_top_k_is_a_load_error_naming_the_field(k):
    hf = dict(architectures=["MixtralForCausalLM"], vocab_size=8, hidden_size=8, intermediate_size=8,
              num_hidden_layers=1, num_attention_heads=2, num_local_experts=8, num_experts_per_tok=k)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok|mixture-of-experts"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_loads_to_the_model_of_its_hf_tensors(name, tmp_path):
    """A GGUF written as llama.cpp's converter does (Mixtral as `llama` with expert stacks, Qwen2-MoE
    with its shared expert and a dense layer, Qwen3-MoE with q/k norms; one expert stack Q8_0) gives
    the config of the HF checkpoint and the logits of the tensors it holds (the quantised one
    dequantised)."""
    from imp_jax.model.formats.gguf_loader import load_gguf

    write_tiny_moe(name, tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    held = write_moe_gguf(tmp_path / "m.gguf", cfg, SafetensorsDir(tmp_path), "ffn_up_exps.weight")
    ckpt = load_gguf(tmp_path / "m.gguf")
    gcfg = ModelConfig.from_hf(ckpt.hf_config)
    for field in ("architecture", "num_experts", "num_experts_per_tok", "shared_expert_intermediate_size",
                  "norm_topk_prob", "attention_bias", "qk_norm", "num_layers", "head_dim"):
        assert getattr(gcfg, field) == getattr(cfg, field), field
    assert [gcfg.is_sparse_layer(i) for i in range(cfg.num_layers)] == [cfg.is_sparse_layer(i)
                                                                         for i in range(cfg.num_layers)]
    width = lambda c: c.moe_intermediate_size or c.intermediate_size  # noqa: E731
    assert width(gcfg) == width(cfg)
    prompt = random_prompts([9], cfg.vocab_size, seed=3)[0]
    got = PagedRunner(build(gcfg, ckpt.tensors)).run([SeqChunk(prompt, 0, [1])])[0]
    want = PagedRunner(build(cfg, held)).run([SeqChunk(prompt, 0, [1])])[0]
    assert_close(got, want, 1e-5)


# --------------------------------------------------------------------------------------- engine
@pytest.mark.parametrize("family", ["Qwen2MoeForCausalLM"], indirect=True)   # the shared expert and a dense layer
def test_engine_batches_a_moe_like_alone_and_compiles_nothing_after_warmup(family):
    cfg, _, hf_model, _, path = family
    check_llm_greedy(path, hf_model)


@pytest.mark.parametrize("family", ["MixtralForCausalLM"], indirect=True)   # one family suffices
def test_lora_is_refused_clearly(family):
    cfg, tensors, _, runner, _ = family
    model = build(cfg, tensors)
    with pytest.raises(ModelLoadError, match="LoRA"):
        model.enable_lora(None)
