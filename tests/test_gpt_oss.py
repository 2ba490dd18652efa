"""gpt-oss (model/architectures/gpt_oss.py) on a tiny random checkpoint: attention sinks in the XLA, CPU and Pallas
(interpreted) kernels vs the oracle, YaRN vs transformers, MXFP4 dequantisation, and the model vs
transformers' GptOssForCausalLM (logits, greedy tokens, a ragged batch of prefill chunks and decodes on
every attention backend, an MXFP4 checkpoint, the engine), and the same checkpoint written as a
llama.cpp `gpt-oss` GGUF (float and MXFP4 experts, fused q|k|v), and a GGUF made by llama.cpp's own
converter (tests/data/gpt_oss) against transformers and llama.cpp's greedy tokens."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from imp_jax.errors import ModelLoadError
from imp_jax.model.formats.gguf_loader import load_gguf
from imp_jax.kernels_pallas import Kernels
from imp_jax.kernels_pallas.attention import paged_attention
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle
from imp_jax.model.config import ModelConfig
from imp_jax.model.architectures.gpt_oss import FP4_VALUES, GptOssLM, dequantize_mxfp4
from imp_jax.model.formats.loader import SafetensorsDir
from imp_jax.model.architectures.moe import EXPERT_IMPLS, ExpertAct, expert_ffn, route
from imp_jax.model.registry import get_model_class
from imp_jax.runtime.execution.batch import SeqChunk
from paged import (PagedRunner, assert_close, check_llm_greedy, check_ragged_steps, hf_logits, host_kernels,
                   random_prompts)
from attention_cases import Case, make_batch
from support.gpt_oss_models import GPT_OSS, YARN, random_mxfp4, write_gpt_oss_gguf, write_tiny_gpt_oss
from support.models import build




@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss")
    hf_model = write_tiny_gpt_oss(path)
    cfg = ModelConfig.from_file(path / "config.json")
    return cfg, SafetensorsDir(path), hf_model, path


@pytest.fixture(scope="module")
def runner(tiny):
    cfg, tensors, _, _ = tiny
    return PagedRunner(build(cfg, tensors))


# ------------------------------------------------------------------------------------ attention sinks
SINK_CASES = {
    "prefill_and_decodes": Case(((0, 19), (30, 1), (9, 4)), group=2, head_dim=16, block_size=8, dtype=jnp.float32,
                                num_tokens=32, num_slots=4, kv_heads=2),
    "window": Case(((0, 40), (70, 1)), group=4, head_dim=32, block_size=16, dtype=jnp.float32, num_tokens=48,
                   num_slots=2, kv_heads=1, sliding_window=7),
}


def _numpy_sink_attention(case, q, k_cache, v_cache, meta, layer, sinks):
    """Float64 attention with a sink column per head, one token at a time (the definition)."""
    q, kc, vc = (np.asarray(x, np.float64) for x in (q, k_cache[layer], v_cache[layer]))
    qsl, lens, tables = (np.asarray(x) for x in (meta.query_start_loc, meta.seq_lens, meta.block_tables))
    out = np.zeros_like(q)
    H, G = q.shape[1], case.group
    for s in range(int(meta.num_seqs)):
        for t in range(qsl[s], qsl[s + 1]):
            pos = lens[s] - (qsl[s + 1] - t)
            keys = np.arange(pos + 1)
            if case.sliding_window:
                keys = keys[keys > pos - case.sliding_window]
            blocks = tables[s, keys // case.block_size]
            for h in range(H):
                k = kc[blocks, keys % case.block_size, h // G]
                v = vc[blocks, keys % case.block_size, h // G]
                logits = np.append(k @ q[t, h] * case.head_dim ** -0.5, float(sinks[h]))
                p = np.exp(logits - logits.max())
                out[t, h] = (p[:-1] / p.sum()) @ v
    return out


@pytest.mark.parametrize("backend", ["xla", "cpu", "pallas"])   # pallas: the Mosaic GPU interpreter
@pytest.mark.parametrize("name", list(SINK_CASES))
def test_attention_sinks_match_numpy_and_the_oracle(name, backend):
    if backend == "cpu" and not cpu_attention.available():
        pytest.skip("CPU attention kernel not built")
    case = SINK_CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, 1)
    H = q.shape[1]
    sinks = jnp.asarray(np.linspace(-3, 6, H), jnp.float32)   # one sink that dominates the scores
    kw = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window)
    kernels = Kernels(attention=backend, pallas_interpret=backend == "pallas")
    got = jax.jit(lambda *a: paged_attention(*a, **kw, kernels=kernels, sinks=sinks))(
        q, k_cache, v_cache, meta, jnp.int32(1))
    want = _numpy_sink_attention(case, q, k_cache, v_cache, meta, 1, np.asarray(sinks))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=2e-5, rtol=2e-5)
    ref = ragged_paged_attention_oracle(q, k_cache, v_cache, meta, 1, **kw, sinks=sinks)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-5, rtol=2e-5)
    plain = ragged_paged_attention_oracle(q, k_cache, v_cache, meta, 1, **kw)
    assert not np.allclose(np.asarray(ref), np.asarray(plain), atol=1e-3), "sinks must change the output"
    real = int(meta.query_start_loc[meta.num_seqs])
    assert not np.asarray(got[real:]).any(), "padding rows must be zero"


def test_kernel_choice_takes_sinks_everywhere(tiny):
    from imp_jax.kernels_pallas.pallas import shapes as pallas_shapes
    from imp_jax.model.formats.loader import attention_shape

    cfg, _, _, _ = tiny
    shape = dataclasses.replace(attention_shape(cfg, jnp.bfloat16, jnp.bfloat16, 16, "gpu"), head_dim=64)
    assert shape.sinks and pallas_shapes.supports(shape)   # the Pallas GPU kernel has them
    if cpu_attention.available():   # the C++ CPU kernel has them
        assert host_kernels(cfg).attention == "cpu"


# ------------------------------------------------------------------------------ experts, router
def _np_swiglu(g, u, alpha=1.702, limit=7.0):
    g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
    return g / (1 + np.exp(-alpha * g)) * (u + 1)


@pytest.mark.parametrize("impl", EXPERT_IMPLS)
def test_biased_experts_with_the_clamped_swiglu_match_numpy(impl):
    """Every expert implementation with gpt-oss's biases and activation, on activations well past
    the clamp (|gate|, |up| up to ~20), against float64 NumPy on the real tokens."""
    rng = np.random.default_rng(3)
    T, H, I, E, k, real = 16, 32, 24, 6, 2, 11
    h = rng.standard_normal((T, H)).astype(np.float32)
    gate_up = rng.standard_normal((E, 2 * I, H)).astype(np.float32)
    down = rng.standard_normal((E, H, I)).astype(np.float32) * 0.2
    b_gu = rng.standard_normal((E, 2 * I)).astype(np.float32)
    b_d = rng.standard_normal((E, H)).astype(np.float32)
    w, idx = route(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), k, "topk_softmax")
    w, idx = np.asarray(w, np.float64), np.asarray(idx)
    ref = np.zeros((T, H))
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            gu = gate_up[e].astype(np.float64) @ h[t] + b_gu[e]
            assert np.abs(gu).max() > 7 or t
            ref[t] += w[t, j] * (down[e] @ _np_swiglu(gu[:I], gu[I:]) + b_d[e])
    got = np.asarray(expert_ffn(jnp.asarray(h), jnp.asarray(w, jnp.float32), jnp.asarray(idx), jnp.asarray(gate_up),
                                jnp.asarray(down), impl, jnp.asarray(real), act=ExpertAct("swiglu_clamped"),
                                gate_up_bias=jnp.asarray(b_gu), down_bias=jnp.asarray(b_d)))
    np.testing.assert_allclose(got[:real], ref[:real], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------- config, YaRN
def test_config_reads_gpt_oss_fields_and_yarn_matches_transformers(tiny):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg, _, hf_model, _ = tiny
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [cfg.layer_window(i) for i in range(3)] == [5, None, 5]
    assert cfg.attention_sinks and cfg.expert_bias and cfg.attention_bias
    assert (cfg.router, cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit) == ("topk_softmax", "swiglu_clamped",
                                                                                1.702, 7.0)
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_model.config)
    np.testing.assert_allclose(cfg.rope_inv_freq(), inv.double().numpy(), rtol=1e-6)
    assert cfg.rope_attention_scale == pytest.approx(scale) and scale > 1
    assert get_model_class(cfg.architecture) is GptOssLM


def test_yarn_truncation_and_a_missing_original_length():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    import transformers

    rope = dict(YARN, truncate=True, factor=4.0, beta_fast=16.0, mscale=1.0, mscale_all_dim=0.5)
    hf_cfg = transformers.GptOssConfig(**{**GPT_OSS, "rope_parameters": rope})
    cfg = ModelConfig.from_hf({**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"]})
    inv, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    np.testing.assert_allclose(cfg.rope_inv_freq(), inv.double().numpy(), rtol=1e-6)
    assert cfg.rope_attention_scale == pytest.approx(scale)
    bad = {**hf_cfg.to_dict(), "architectures": ["GptOssForCausalLM"],
           "rope_parameters": {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}}
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        ModelConfig.from_hf(bad)


# ------------------------------------------------------------------------------------------ MXFP4
def test_mxfp4_dequantises_known_values():
    # one row of 64 values: two groups of 32, scales 2^0 and 2^-3
    codes = np.arange(64) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8).reshape(1, 2, 16)
    scales = np.array([[127, 124]], np.uint8)
    got = dequantize_mxfp4(blocks, scales)
    want = np.concatenate([FP4_VALUES[codes[:32]], FP4_VALUES[codes[32:]] / 8]).reshape(1, 64)
    np.testing.assert_array_equal(got, want)
    assert got[0, :16].tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, -1.5, -2, -3, -4, -6]
    with pytest.raises(ValueError, match="MXFP4"):
        dequantize_mxfp4(blocks, scales[:, :1])


def test_an_mxfp4_checkpoint_loads_dequantised_and_matches_transformers(tiny, tmp_path):
    """A checkpoint whose experts are stored as MXFP4 `_blocks` / `_scales` (as gpt-oss ships) gives
    the logits of transformers' model holding the dequantised values."""
    import safetensors.numpy

    cfg, tensors, hf_model, path = tiny
    rng = np.random.default_rng(7)
    hf = type(hf_model)(hf_model.config).float().eval()
    hf.load_state_dict(hf_model.state_dict())
    out = {n: tensors[n] for n in tensors._where}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp.experts."
        for name, shape in (("gate_up_proj", (4, 64, 64)), ("down_proj", (4, 64, 32))):   # [E, out, in]
            blocks, scales, value = random_mxfp4(rng, shape)
            del out[pre + name]
            out[pre + name + "_blocks"], out[pre + name + "_scales"] = blocks, scales
            with torch.no_grad():   # transformers holds [E, in, out]
                getattr(hf.model.layers[i].mlp.experts, name).copy_(torch.from_numpy(value).transpose(1, 2))
    ckpt = tmp_path / "mxfp4"
    ckpt.mkdir()
    safetensors.numpy.save_file({n: np.ascontiguousarray(v) for n, v in out.items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text((path / "config.json").read_text())
    got_cfg = ModelConfig.from_file(ckpt / "config.json")
    prompt = random_prompts([11], cfg.vocab_size, seed=5)[0]
    got = PagedRunner(build(got_cfg, SafetensorsDir(ckpt))).run([SeqChunk(prompt, 0, [3])])[0]
    assert_close(got, hf_logits(hf, prompt), 1e-4)


# ------------------------------------------------------------------------------- vs transformers
@pytest.mark.parametrize("loop", ["scan", "unroll"])
def test_logits_and_greedy_tokens_match_transformers(tiny, runner, loop):
    cfg, tensors, hf_model, _ = tiny
    if loop == "unroll":
        runner = PagedRunner(build(cfg, tensors, layer_loop="unroll"))
    prompt = random_prompts([12], cfg.vocab_size, seed=2)[0]
    with torch.no_grad():
        hf_tokens = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                      pad_token_id=0)[0, len(prompt):].tolist()
    logits, tokens = runner.greedy(prompt, 8, [20, 21])   # 12 + 8 tokens: past the sliding window of 5
    assert_close(logits, hf_logits(hf_model, prompt))
    assert tokens == hf_tokens


@pytest.mark.parametrize("attention", ["xla", "cpu", "pallas"])   # pallas: the Mosaic GPU interpreter
def test_ragged_batch_with_prefill_chunks_and_decodes_matches_transformers(tiny, runner, attention):
    cfg, tensors, hf_model, _ = tiny
    kernels = host_kernels(cfg)
    if attention != kernels.attention:
        if attention == "cpu":
            pytest.skip("CPU attention kernel not built")
        kernels = dataclasses.replace(kernels, attention=attention, pallas_interpret=attention == "pallas")
        runner = PagedRunner(build(cfg, tensors, kernels=kernels))
    check_ragged_steps(runner, hf_model, cfg.vocab_size)


def test_bfloat16_model_tracks_transformers_float32(tiny):
    cfg, tensors, hf_model, _ = tiny
    prompt = random_prompts([10], cfg.vocab_size, seed=4)[0]
    model = build(cfg, tensors, dtype=jnp.bfloat16)
    assert model.layers.sinks[...].dtype == jnp.float32   # the sinks stay float32 in a bf16 model
    got = PagedRunner(model).run([SeqChunk(prompt, 0, [1])], num_tokens=16, num_seqs=1)[0]
    assert_close(got, hf_logits(hf_model, prompt), tol=5e-2)


def test_a_converted_checkpoint_round_trips(tiny, tmp_path):
    """`python -m imp_jax.convert` of the gpt-oss dir: the same config (YaRN, sinks, SwiGLU fields)
    and the same parameters, sinks and expert biases included."""
    from tiny_models import write_tiny_tokenizer
    from imp_jax.convert import main
    from imp_jax.model.formats.loader import load_model
    from support.models import same_params

    _, _, _, path = tiny
    write_tiny_tokenizer(path)
    assert main([str(path), str(tmp_path / "dst")]) == 0
    ours, theirs = load_model(tmp_path / "dst", dtype="float32"), load_model(path, dtype="float32")
    assert ours.config == theirs.config and isinstance(ours.model, GptOssLM)
    same_params(ours.model, theirs.model)


# --------------------------------------------------------------------------------------- engine
def test_engine_loads_the_directory_and_compiles_nothing_after_warmup(tiny):
    cfg, _, hf_model, path = tiny
    llm = check_llm_greedy(path, hf_model)
    assert llm.core.pool.num_free_blocks == llm.core.baseline_free_blocks


@pytest.fixture(scope="module")
def tiny_gguf(tiny, tmp_path_factory):
    _, _, hf_model, _ = tiny
    path = tmp_path_factory.mktemp("gpt_oss_gguf") / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(path, hf_model)
    return path


def test_a_gguf_config_is_the_hf_directory_config(tiny, tiny_gguf):
    """llama.cpp's gpt-oss metadata gives the config of the checkpoint it was converted from: expert
    counts and width, alternating sliding window, YaRN (un-truncated, as HF's), sinks, biases."""
    cfg, _, _, _ = tiny
    ckpt = load_gguf(tiny_gguf)
    assert ckpt.hf_config["architectures"] == ["GptOssForCausalLM"]
    got = ModelConfig.from_hf(ckpt.hf_config, source=str(tiny_gguf))
    assert dataclasses.replace(got, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id) == cfg
    np.testing.assert_allclose(got.rope_inv_freq(), cfg.rope_inv_freq(), rtol=1e-6)
    assert ckpt.tensors.shape("model.layers.0.mlp.experts.gate_proj.weight") == (4, 32, 64)
    assert ckpt.tensors.shape("model.layers.2.self_attn.sinks") == (4,)


def test_a_gguf_loads_to_the_hf_directory_model_and_transformers_logits(tiny, tiny_gguf, runner):
    from imp_jax.model.formats.loader import load_model

    cfg, _, hf_model, _ = tiny
    loaded = load_model(tiny_gguf, dtype="float32")
    assert isinstance(loaded.model, GptOssLM)
    prompt = random_prompts([14], cfg.vocab_size, seed=8)[0]   # past the window of 5
    got = PagedRunner(build(loaded.config, load_gguf(tiny_gguf).tensors)).run([SeqChunk(prompt, 0, [2, 3])])[0]
    want = runner.run([SeqChunk(prompt, 0, [2, 3])])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert_close(got, hf_logits(hf_model, prompt))


def test_a_gguf_with_mxfp4_experts_matches_transformers_holding_their_values(tiny, tmp_path):
    """Experts as GGML MXFP4 blocks (the type llama.cpp stores gpt-oss's experts in), dequantised
    at load: the logits of transformers' model holding the dequantised values."""
    cfg, _, hf_model, _ = tiny
    path = tmp_path / "mxfp4.gguf"
    stored = write_gpt_oss_gguf(path, hf_model, experts="MXFP4")
    ckpt = load_gguf(path)
    assert ckpt.tensors.qtype("model.layers.1.mlp.experts.down_proj.weight") == "MXFP4"
    hf = type(hf_model)(hf_model.config).float().eval()
    hf.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for name, value in stored.items():
            hf.get_parameter(name).copy_(torch.from_numpy(value))
    assert not np.allclose(stored["model.layers.0.mlp.experts.down_proj"],
                           hf_model.get_parameter("model.layers.0.mlp.experts.down_proj").detach().numpy())
    prompt = random_prompts([11], cfg.vocab_size, seed=6)[0]
    got_cfg = ModelConfig.from_hf(ckpt.hf_config, source=str(path))
    got = PagedRunner(build(got_cfg, ckpt.tensors)).run([SeqChunk(prompt, 0, [4])])[0]
    assert_close(got, hf_logits(hf, prompt), 1e-4)


def test_a_gguf_without_its_sliding_window_is_refused_by_name(tiny, tmp_path):
    _, _, hf_model, _ = tiny
    write_gpt_oss_gguf(tmp_path / "nowindow.gguf", hf_model, sliding_window=None)
    with pytest.raises(ModelLoadError, match="gpt-oss.attention.sliding_window"):
        load_gguf(tmp_path / "nowindow.gguf")


def test_ggml_mxfp4_blocks_hold_the_values_of_the_hf_blocks():
    """The same FP4 codes and E8M0 scales laid out as GGML's MXFP4 block (scale byte, then 16 bytes
    whose low nibbles are values 0..15 and high nibbles 16..31, as llama.cpp repacks HF's pairs) are
    dequantised by gguf-py to exactly `dequantize_mxfp4`'s values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rng = np.random.default_rng(11)
    blocks, scales, want = random_mxfp4(rng, (2, 3, 64))
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = (codes[..., :16] | (codes[..., 16:] << 4)).astype(np.uint8)
    ggml = np.concatenate([scales[..., None], qs], axis=-1).reshape(2, 3, -1)
    got = dequantize(ggml, GGMLQuantizationType.MXFP4).reshape(want.shape)
    np.testing.assert_array_equal(got, want)


def test_a_gguf_with_fused_qkv_loads_as_the_split_one(tiny, tiny_gguf, tmp_path):
    """convert_hf_to_gguf.py --fuse-qkv writes q|k|v as one `attn_qkv` weight and bias; read as HF's
    q, k and v, it gives the split file's model."""
    cfg, _, hf_model, _ = tiny
    path = tmp_path / "qkv.gguf"
    write_gpt_oss_gguf(path, hf_model, fuse_qkv=True)
    fused, split = load_gguf(path), load_gguf(tiny_gguf)
    assert ModelConfig.from_hf(fused.hf_config) == ModelConfig.from_hf(split.hf_config)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.2.self_attn.v_proj.bias"):
        assert fused.tensors.shape(name) == split.tensors.shape(name)
        np.testing.assert_array_equal(fused.tensors[name], split.tensors[name])
    prompt = random_prompts([9], cfg.vocab_size, seed=9)[0]
    got = PagedRunner(build(ModelConfig.from_hf(fused.hf_config), fused.tensors)).run([SeqChunk(prompt, 0, [5])])[0]
    assert_close(got, hf_logits(hf_model, prompt))


@pytest.mark.parametrize("pattern, want", [
    (None, ["sliding_attention", "full_attention", "sliding_attention"]),   # llama.cpp's default period 2
    (3, ["sliding_attention", "sliding_attention", "full_attention"]),
    (0, ["sliding_attention"] * 3),
    ([False, True, True], ["full_attention", "sliding_attention", "sliding_attention"]),
])
def test_a_gguf_sliding_window_pattern_picks_the_sliding_layers_as_llama_cpp_does(tiny, tmp_path, pattern, want):
    """llama.cpp's `load_swa_pattern`: a per-layer bool array, or a period n where layer i slides unless
    i % n == n - 1 (0: all slide); the converter writes none for gpt-oss (period 2)."""
    import gguf

    _, _, hf_model, _ = tiny
    T = gguf.GGUFValueType
    extra = {} if pattern is None else {"gpt-oss.attention.sliding_window_pattern":
                                        (pattern, T.ARRAY, T.BOOL) if isinstance(pattern, list) else (pattern, T.UINT32)}
    write_gpt_oss_gguf(tmp_path / "p.gguf", hf_model, extra=extra)
    assert load_gguf(tmp_path / "p.gguf").hf_config["layer_types"] == want


def test_a_gguf_with_another_rope_base_for_sliding_layers_is_refused(tiny, tmp_path):
    import gguf

    _, _, hf_model, _ = tiny
    key = "gpt-oss.rope.freq_base_swa"
    write_gpt_oss_gguf(tmp_path / "same.gguf", hf_model, extra={key: (YARN["rope_theta"], gguf.GGUFValueType.FLOAT32)})
    assert load_gguf(tmp_path / "same.gguf").hf_config["rope_theta"] == YARN["rope_theta"]
    write_gpt_oss_gguf(tmp_path / "other.gguf", hf_model, extra={key: (10000.0, gguf.GGUFValueType.FLOAT32)})
    with pytest.raises(ModelLoadError, match="freq_base_swa"):
        load_gguf(tmp_path / "other.gguf")


# ------------------------------------------------------- a GGUF from llama.cpp's own converter
FIXTURE = Path(__file__).parent / "data" / "gpt_oss"   # scripts/make_gpt_oss_fixture.py made it


def test_llama_cpps_converter_output_gives_transformers_logits_and_llama_cpps_greedy_tokens():
    """tests/data/gpt_oss: a tiny MXFP4 gpt-oss converted by llama.cpp's convert_hf_to_gguf.py (its
    MXFP4 repacking, names, shapes and metadata) loads to the config of the HF checkpoint holding the
    same weights, transformers' logits, and the greedy tokens transformers and llama-server produce."""
    import json

    import transformers

    from imp_jax.model.formats.loader import load_model

    gguf_path = FIXTURE / "tiny-gpt-oss-mxfp4.gguf"
    hf = transformers.GptOssForCausalLM.from_pretrained(FIXTURE / "hf", dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    want_cfg = ModelConfig.from_file(FIXTURE / "hf" / "config.json")
    ckpt = load_gguf(gguf_path)
    got_cfg = ModelConfig.from_hf(ckpt.hf_config, source=str(gguf_path))
    assert dataclasses.replace(got_cfg, bos_token_id=None, eos_token_id=()) == want_cfg
    assert ckpt.tensors.qtype("model.layers.1.mlp.experts.up_proj.weight") == "MXFP4"
    assert ckpt.tensors.qtype("model.layers.1.self_attn.q_proj.weight") == "F32"
    runner = PagedRunner(load_model(gguf_path, dtype="float32", gemm="exact").model)   # transformers' products
    record = json.loads((FIXTURE / "llama_cpp_greedy.json").read_text())
    for j, (prompt, llama_tokens) in enumerate(zip(record["prompts"], record["greedy_tokens"])):
        logits, tokens = runner.greedy(prompt, len(llama_tokens), [3 * j + 1, 3 * j + 2])
        assert_close(logits, hf_logits(hf, prompt))
        with torch.no_grad():
            hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens == hf_tokens == llama_tokens
