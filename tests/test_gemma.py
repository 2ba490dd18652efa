"""Gemma 2 and Gemma 3 (model/architectures/gemma.py) on tiny random checkpoints vs transformers: ragged batches,
chunked prefill then decode, greedy tokens, windows and soft-caps exercised beyond their lengths;
config parsing; a GGUF written from the HF checkpoint; the engine with no compilation after warm-up."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import XLA
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.gguf_loader import load_gguf
from imp_jax.model.formats.loader import SafetensorsDir, load_model
from imp_jax.runtime.execution.batch import SeqChunk
from imp_jax.runtime.defaults import arch_preset
from paged import PagedRunner, host_kernels
from support.gemma_models import CONFIGS, TINY, WINDOW, write_gemma_gguf, write_tiny_gemma
from support.models import build


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory):
    """(config, HF tensors, transformers model, path) for one tiny Gemma."""
    path = tmp_path_factory.mktemp(request.param)
    hf_model = write_tiny_gemma(request.param, path)
    return ModelConfig.from_file(path / "config.json"), SafetensorsDir(path), hf_model, path



def prompts(lengths, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def hf_logits(hf_model, prompt) -> np.ndarray:
    with torch.no_grad():
        return hf_model(torch.tensor([prompt])).logits[0].numpy()


def close(got, ref, tol=1e-4):
    assert np.max(np.abs(got - ref)) <= tol * np.ptp(ref), np.max(np.abs(got - ref)) / np.ptp(ref)


def test_config_is_parsed_from_transformers_output(tiny):
    cfg, _, hf_model, _ = tiny
    hf = hf_model.config
    assert cfg.layer_types == tuple(hf.layer_types) and len(set(cfg.layer_types)) == 2
    assert cfg.sliding_window == WINDOW and cfg.query_pre_attn_scalar == 24.0
    assert cfg.attn_logit_softcapping == hf.attn_logit_softcapping
    assert cfg.final_logit_softcapping == hf.final_logit_softcapping
    preset = arch_preset(cfg.architecture)   # the spec's Gemma sampling preset
    assert (preset["top_p"], preset["top_k"]) == (0.9, 20)
    if cfg.architecture == "Gemma3ForCausalLM":
        assert cfg.qk_norm and cfg.rope_local_theta == 500.0 and cfg.rope_theta == 1e5
        assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 2.0
        assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention", "sliding_attention")
    else:
        assert not cfg.qk_norm and cfg.rope_local_theta is None and cfg.tie_word_embeddings


@pytest.mark.parametrize("kernels", ["host", "xla"])
def test_ragged_batch_chunked_prefill_and_decode_match_transformers(tiny, kernels):
    """One model per kernel set, one compiled shape: a ragged batch on scattered pages, then a
    chunked prefill mixed with decodes, each sequence's logits vs transformers on the whole prefix
    (every prompt outruns the window, so sliding layers mask what global ones see)."""
    cfg, tensors, hf_model, _ = tiny
    runner = PagedRunner(build(cfg, tensors, kernels=host_kernels(cfg) if kernels == "host" else XLA))
    ps = prompts([5, 20, 33, 1], cfg.vocab_size)
    tables = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    for p, got in zip(ps, runner.run([SeqChunk(p, 0, t) for p, t in zip(ps, tables)])):
        close(got, hf_logits(hf_model, p))

    a, b = prompts([30, 21], cfg.vocab_size, seed=1)
    ta, tb = [10, 11], [12, 13]
    first = runner.run([SeqChunk(a[:13], 0, ta), SeqChunk(b[:18], 0, tb)])
    second = runner.run([SeqChunk(a[13:27], 13, ta), SeqChunk([b[18]], 18, tb)])
    steps = [runner.run([SeqChunk([a[i]], i, ta), SeqChunk([b[i - 8]], i - 8, tb)]) for i in (27, 28)]
    close(np.concatenate([first[0], second[0]] + [s[0] for s in steps]), hf_logits(hf_model, a[:29]))
    close(np.concatenate([first[1], second[1]] + [s[1] for s in steps]), hf_logits(hf_model, b[:21]))


def test_greedy_tokens_match_transformers_under_both_layer_loops(tiny):
    """Prefill then 12 decode steps, past the window, under `scan` (a lax.cond per layer picks
    sliding or global attention) and `unroll` (static windows): transformers' greedy tokens."""
    cfg, tensors, hf_model, _ = tiny
    prompt = prompts([10], cfg.vocab_size, seed=2)[0]
    with torch.no_grad():
        want = hf_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist()
    for loop in ("scan", "unroll"):
        runner = PagedRunner(build(cfg, tensors, layer_loop=loop, kernels=host_kernels(cfg)))
        _, tokens = runner.greedy(prompt, 12, [3, 4], num_tokens=16, num_seqs=1)
        assert tokens == want, loop


# ------------------------------------------------------------------------------------- config
def hf_dict(arch: str, **extra) -> dict:
    return {"architectures": [arch], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 7, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16, **extra}


def test_released_gemma_configs_get_their_defaults():
    """Configs as Google released them (no layer_types; Gemma 3 with rope_local_base_freq and
    sliding_window_pattern), as older transformers wrote them."""
    g2 = ModelConfig.from_hf(hf_dict("Gemma2ForCausalLM", sliding_window=4096, query_pre_attn_scalar=256,
                                     final_logit_softcapping=30.0, attn_logit_softcapping=50.0))
    assert g2.layer_types == ("sliding_attention", "full_attention") * 3 + ("sliding_attention",)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.tie_word_embeddings) == (50.0, 30.0, True)
    assert g2.layer_window(0) == 4096 and g2.layer_window(1) is None
    g3 = ModelConfig.from_hf(hf_dict("Gemma3ForCausalLM", sliding_window=512, sliding_window_pattern=6,
                                     rope_theta=1e6, rope_local_base_freq=1e4, query_pre_attn_scalar=256,
                                     rope_scaling={"rope_type": "linear", "factor": 8.0},
                                     final_logit_softcapping=None, attn_logit_softcapping=None))
    assert g3.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert (g3.rope_theta, g3.rope_local_theta, g3.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert g3.qk_norm and g3.attn_logit_softcapping is None and g3.final_logit_softcapping is None
    llama = ModelConfig.from_hf(hf_dict("LlamaForCausalLM"))
    assert llama.layer_types == () and type(llama) is ModelConfig   # Gemma's own fields are GemmaConfig's only


@pytest.mark.parametrize("arch, extra, match", [
    ("Gemma3ForConditionalGeneration", {}, "without a .text_config."),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma2ForCausalLM", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ("Gemma2ForCausalLM", {"layer_types": ["sliding_attention"] * 6 + ["chunked"]}, "'chunked'"),
    ("Gemma2ForCausalLM", {"layer_types": ["full_attention"] * 3}, "3 entries for 7 layers"),
])
def test_unservable_gemma_configs_are_model_load_errors_naming_why(arch, extra, match):
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf(hf_dict(arch, **extra))


# --------------------------------------------------------------------------------------- GGUF
def test_gguf_written_from_the_checkpoint_loads_to_the_same_model(tiny, tmp_path):
    """Config, tensors (norms less llama.cpp's 1) and logits of the GGUF equal the HF checkpoint's."""
    cfg, tensors, hf_model, _ = tiny
    g3 = cfg.architecture == "Gemma3ForCausalLM"
    write_gemma_gguf(cfg, tensors, tmp_path / "m.gguf", scale_key=g3)
    ckpt = load_gguf(tmp_path / "m.gguf")
    got = ModelConfig.from_hf(ckpt.hf_config)
    if not g3:   # no attention.scale: llama.cpp's 1/sqrt(head_dim) (this config's scalar is not head_dim)
        assert got.query_pre_attn_scalar == cfg.head_dim
        got = dataclasses.replace(got, query_pre_attn_scalar=cfg.query_pre_attn_scalar)
    assert dataclasses.replace(got, max_position_embeddings=cfg.max_position_embeddings) == cfg
    assert sorted(ckpt.tensors) == sorted(tensors)
    for name in tensors:
        np.testing.assert_allclose(ckpt.tensors[name], tensors[name], rtol=0, atol=2e-7 if "norm" in name else 0)
    model = build(cfg, ckpt.tensors, kernels=XLA)
    hf_ref = build(cfg, tensors, kernels=XLA)
    runner = PagedRunner(hf_ref)
    p = prompts([25], cfg.vocab_size, seed=3)[0]
    from_hf = runner.run([SeqChunk(p, 0, [1, 2])], num_tokens=32, num_seqs=1)[0]
    runner.use_weights(model)   # the same program, the GGUF's weights
    from_gguf = runner.run([SeqChunk(p, 0, [3, 4])], num_tokens=32, num_seqs=1)[0]
    close(from_gguf, hf_logits(hf_model, p))
    close(from_gguf, from_hf, tol=1e-5)


# ------------------------------------------------------------------------------------- engine
def test_engine_serves_gemma_greedy_like_transformers_without_compiling_after_warm_up(tmp_path):
    """Through EngineCore (chunked prefill on a budget of 16 tokens, then batched decode): two
    greedy requests together give transformers' tokens, the pool comes back whole, and no step
    compiles after warm-up."""
    from tiny_models import write_tiny_tokenizer
    from support.engine import make_engine, req, run

    from imp_jax.runtime.config import EngineConfig

    hf_model = write_tiny_gemma("Gemma3ForCausalLM", tmp_path)
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1]}))
    loaded = load_model(tmp_path)
    config = EngineConfig(model=str(tmp_path), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=16,
                          num_kv_blocks=24)
    engine = make_engine(loaded, config, 24)
    ps = prompts([23, 37], 160, seed=4)
    results = run(engine, *(req(p, max_tokens=8, ignore_eos=True, repetition_penalty=1.0) for p in ps))
    for p, r in zip(ps, results):
        with torch.no_grad():
            want = hf_model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, pad_token_id=0,
                                     eos_token_id=None)[0, len(p):].tolist()
        assert r.ids == want
    assert engine.step_fn.compilations_after_warmup == 0


def test_multimodal_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration checkpoint (text_config, `language_model.model.*` names, a
    vision tower) loads its language model; text logits match transformers' multimodal model."""
    import transformers

    text = transformers.Gemma3TextConfig(**TINY, sliding_window_pattern=3)
    vision = transformers.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    torch.manual_seed(1)
    hf_model = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=300,
        boi_token_index=298, eoi_token_index=299)).float().eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if p.ndim == 1 and "language_model" in name:
                p.add_(torch.randn_like(p) * 0.3)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    assert cfg.architecture == "Gemma3ForConditionalGeneration" and cfg.qk_norm and cfg.num_layers == 4
    assert cfg.layer_types[2] == "full_attention" and cfg.rope_local_theta == 1e4
    p = prompts([20], 298, seed=5)[0]
    got = PagedRunner(build(cfg, SafetensorsDir(tmp_path), kernels=XLA)).run([SeqChunk(p, 0, [1, 2])], 32, 1)[0]
    close(got, hf_logits(hf_model, p))
