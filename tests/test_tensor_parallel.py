"""Tensor parallelism (--tensor-parallel-size) against one device.

The comparisons run on 4 fake CPU devices in a child process (tests/tp_check.py: the device count is
fixed when jax starts; this process has one device): SmolLM2 (3 KV heads: replicated on 2 and 4
shards; a tied, vocab-parallel LM head), a tiny Llama whose 4 KV heads split over 2 and 4, and a
tiny Qwen2 (q/k/v biases) whose 3 KV heads and 45-row MLP split over neither 2 nor 4 without
padding, and whose 250-token vocabulary splits over 2 but is replicated on 4. Mixtures of experts
(model/architectures/moe.py) in the same child run: a tiny Mixtral, a Qwen2-MoE (shared expert, a dense layer; expert,
shared and dense widths 33, 45 and 50, which 2 or 4 does not divide) from its HF directory and from a
GGUF with a Q8_0 expert stack, a gpt-oss (biases, sinks, sliding and full layers; width 30), and a
Qwen2-MoE GGUF whose expert stacks stay GGML blocks (IQ4_NL, Q2_K, MXFP4; 1 and 2 shards); the
Mixtral on 2 shards only (SIZES).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from tiny_models import write_tiny_tokenizer
from support.servers import LiveServer, wait_for

ROOT = Path(__file__).resolve().parents[1]
FAKE_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "PYTHONPATH": str(ROOT)}
TINY_LLAMA = dict(num_attention_heads=8, num_key_value_heads=4)                      # head_dim 8
TINY_QWEN2 = dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3,      # head_dim 16
                  intermediate_size=45, vocab_size=250, tie_word_embeddings=False)   # tied, it echoes its input
TINY_QWEN2_MOE = {"moe_intermediate_size": 33, "shared_expert_intermediate_size": 45, "intermediate_size": 50}
TINY_GPT_OSS = {"intermediate_size": 30}
# the TP sizes each model runs at: MoE programs compile slowly (~8 s a size without the compilation
# cache), so the plain Mixtral runs at 2 only; the GGUF shares the HF Qwen2-MoE's programs
SIZES = {"smollm2": (1, 2, 4), "llama": (1, 2, 4), "qwen2": (1, 2, 4), "mixtral": (1, 2), "qwen2moe": (1, 2, 4),
         "qwen2moe_gguf": (1, 2, 4), "gpt_oss": (1, 2, 4), "qwen2moe_blocks": (1, 2)}


@pytest.fixture(scope="module")
def tp_runs(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from tiny_models import write_tiny_hf

    tmp = tmp_path_factory.mktemp("tp")
    models = {}
    for name, arch, overrides in (("llama", "LlamaForCausalLM", TINY_LLAMA), ("qwen2", "Qwen2ForCausalLM", TINY_QWEN2)):
        write_tiny_hf(arch, tmp / name, **overrides)
        write_tiny_tokenizer(tmp / name)
        models[name] = str(tmp / name)
    models["smollm2"] = str(smollm2_gguf_path)
    models.update(_write_moe_models(tmp))
    out = tmp / "runs.json"
    args = [f"{path}@{','.join(map(str, SIZES[name]))}" for name, path in models.items()]
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tp_check.py"), str(out), *args],
                          env={**os.environ, **FAKE_DEVICES}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = json.loads(out.read_text())
    return {f"{name}|{n}": runs[f"{path}|{n}"] for name, path in models.items() for n in SIZES[name]}


def _write_moe_models(tmp: Path) -> dict[str, str]:
    """The mixtures of experts tp_runs compares: HF directories (a tokenizer beside each) and a GGUF."""
    from imp_jax.model.config import ModelConfig
    from imp_jax.model.formats.loader import SafetensorsDir
    from support.gpt_oss_models import write_tiny_gpt_oss
    from support.moe_models import write_moe_blocks_gguf, write_moe_gguf, write_tiny_moe

    write_tiny_moe("MixtralForCausalLM", tmp / "mixtral")
    write_tiny_moe("Qwen2MoeForCausalLM", tmp / "qwen2moe", **TINY_QWEN2_MOE)
    write_tiny_gpt_oss(tmp / "gpt_oss", **TINY_GPT_OSS)
    for name in ("mixtral", "qwen2moe", "gpt_oss"):
        write_tiny_tokenizer(tmp / name)
    gguf = tmp / "qwen2moe.gguf"
    write_moe_gguf(gguf, ModelConfig.from_file(tmp / "qwen2moe" / "config.json"), SafetensorsDir(tmp / "qwen2moe"),
                   "ffn_up_exps.weight")
    # expert stacks kept as blocks (tests/test_moe_blocks.py): at 2 shards MXFP4 down columns split in whole
    # blocks, IQ4_NL gate|up rows move whole, Q2_K down (256-weight blocks, 128 columns a shard) is dequantised
    blocks = tmp / "qwen2moe_blocks.gguf"
    write_moe_blocks_gguf(blocks, "qwen2moe")
    return {"mixtral": str(tmp / "mixtral"), "qwen2moe": str(tmp / "qwen2moe"), "qwen2moe_gguf": str(gguf),
            "gpt_oss": str(tmp / "gpt_oss"), "qwen2moe_blocks": str(blocks)}


@pytest.mark.parametrize(("model", "n"), [(m, n) for m, sizes in SIZES.items() for n in sizes if n > 1])
def test_tensor_parallel_matches_one_device(tp_runs, model, n):
    """Same greedy tokens, and the prompt's raw logprobs (the chosen token's and the top 20 of
    every row) within 1e-4 of one device's; nothing compiled after warm-up; every block freed."""
    one, tp = tp_runs[f"{model}|1"], tp_runs[f"{model}|{n}"]
    assert len(one["tokens"]) == 8 and tp["tokens"] == one["tokens"]
    assert tp["kv_devices"] == n
    np.testing.assert_allclose(tp["target_logprobs"], one["target_logprobs"], atol=1e-4)
    np.testing.assert_allclose(tp["top_logprobs"], one["top_logprobs"], atol=1e-4)
    assert tp["compilations_after_warmup"] == 0 and tp["free_blocks_back"]


@pytest.mark.parametrize("n", [2, 4])
def test_kv_cache_per_device_is_one_nth_when_kv_heads_divide(tp_runs, n):
    """4 KV heads over n devices: each device holds 1/n of the cache; 3 KV heads (SmolLM2, the tiny
    Qwen2) do not divide, so each device holds them all (the pool is the same size per device)."""
    assert tp_runs[f"llama|{n}"]["kv_bytes_per_device"] * n == tp_runs["llama|1"]["kv_bytes_per_device"]
    for model in ("smollm2", "qwen2"):
        assert tp_runs[f"{model}|{n}"]["kv_bytes_per_device"] == tp_runs[f"{model}|1"]["kv_bytes_per_device"]


def test_layout_pads_query_groups_when_kv_heads_are_replicated(smollm2_loaded):
    """SmolLM2's 9 query heads in 3 groups of 3 on 2 shards: each shard holds every KV head and a run
    of 2 heads of each group, shard 1's second one a zero pad; its MLP splits evenly."""
    from imp_jax.model.tensor_parallel import TensorParallel

    cfg = smollm2_loaded.config
    tp = TensorParallel.of(cfg, 2)
    assert not tp.kv_sharded and (tp.local_heads, tp.local_kv_heads) == (6, 3)
    assert tp.q_heads(cfg, 0) == [0, 1, 3, 4, 6, 7] and tp.q_heads(cfg, 1) == [2, -1, 5, -1, 8, -1]
    assert tp.vocab_parallel and tp.local_mlp * 2 == cfg.intermediate_size
    assert TensorParallel.of(cfg, 1).q_heads(cfg, 0) == list(range(9))   # one device: the checkpoint's order


def test_quantised_columns_move_in_whole_blocks_and_pads_are_zero():
    """A row-parallel GGML-block matrix keeps its blocks when the columns move 32 at a time (a padded
    run is all-zero blocks: zero weights); an unaligned move dequantises, with the same values."""
    from imp_jax.kernels_pallas import ggml_blocks
    from imp_jax.model.tensor_parallel import take_columns

    rng = np.random.default_rng(0)
    w = rng.integers(0, 256, (3, 4, 20), dtype=np.uint8)    # Q4_1 [3, 128]
    w[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)    # d
    w[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)   # m
    dense = np.asarray(ggml_blocks.dequantize(w))
    index = np.concatenate([np.arange(64, 96), np.arange(0, 32), -np.ones(32, int)])
    moved = take_columns(w, index)
    assert ggml_blocks.format_of(moved) == "Q4_1" and moved.shape == (3, 3, 20)
    expect = np.concatenate([dense[:, 64:96], dense[:, :32], np.zeros((3, 32))], axis=1)
    np.testing.assert_array_equal(np.asarray(ggml_blocks.dequantize(moved)), expect)
    odd = take_columns(w, np.array([5, -1, 100]))
    np.testing.assert_array_equal(odd, np.stack([dense[:, 5], np.zeros(3), dense[:, 100]], axis=1))


def test_more_devices_than_the_host_has_is_a_start_up_error():
    from imp_jax.errors import ModelLoadError
    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    with pytest.raises(ModelLoadError, match="--tensor-parallel-size 2 needs 2 devices; this host has 1 cpu device"):
        build_engine(EngineConfig(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="--tensor-parallel-size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_server_with_tensor_parallel_2_answers_as_one_device(tmp_path, exact_server):
    """The real server on 2 fake devices answers a greedy chat completion as the one-device server does
    (both `--gemm exact`: under int8 activations a sum split over devices rounds differently)."""
    body = {"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three colours."}]}
    reference = httpx.post(exact_server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reference.status_code == 200, reference.text
    live = LiveServer(["--model", "smollm2-135m-instruct", "--gemm", "exact", "--tensor-parallel-size", "2", "--max-num-seqs", "1",
                       "--max-num-batched-tokens", "32", "--max-model-len", "256", "--num-kv-blocks", "32"],
                      tmp_path / "tp2.log", env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"})
    try:
        wait_for(live.url + "/ready", 200, timeout=900, proc=live.proc)
        reply = httpx.post(live.url + "/v1/chat/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"] == reference.json()["choices"][0]["message"]
        assert "tensor parallel over 2" in live.log_text()
    finally:
        assert live.stop() == 0, live.log_text()[-3000:]


def test_one_device_program_has_no_shard_map_and_no_collectives(smollm2_loaded):
    """--tensor-parallel-size 1 is the one-device program: no manual (shard_map) region, no all-reduce
    (on 2 devices the same step has one shard_map and an all-reduce for the embedding, o_proj and
    down_proj)."""

    from imp_jax.runtime.parallel.sharding import default_mesh
    from imp_jax.runtime.execution.step import CompiledStep, StepShapes

    kv = tuple(np.zeros(smollm2_loaded.model.kv_cache_shape(4, 16), np.float32) for _ in range(2))
    step = CompiledStep(smollm2_loaded.model, kv, StepShapes(max_blocks=2, vocab_size=49152), [(1, 1)],
                        default_mesh())
    text = step.lowered("step", 1, 1).as_text()
    assert "stablehlo.sine" in text or "stablehlo.cosine" in text   # the text is the model's program
    assert "manual_computation" not in text and "all_reduce" not in text and "all_gather" not in text


def test_expert_stacks_are_stored_shard_major_with_zero_pads(tmp_path):
    """gpt-oss's experts (width 30) on 4 shards, as the loader hands them to the mesh: shard d's slice
    of gate|up (and its bias) is its 8 gate rows then its 8 up rows, of down its 8 columns, the last
    shard's last 2 of each zero; the down bias stays whole (shard 0 adds it); the sinks follow the
    shard-major query heads (2 KV heads of 2 query heads each, replicated on 4 shards: shard 0 holds
    query heads 0 and 2, shard 1 heads 1 and 3, shards 2 and 3 only zero pads)."""
    from imp_jax.model.base import ModelOptions
    from imp_jax.model.config import ModelConfig
    from imp_jax.model.architectures.gpt_oss import GptOssLM
    from imp_jax.model.formats.loader import SafetensorsDir, build_from_tensors
    from imp_jax.model.weights import WeightSource
    from paged import host_kernels
    from support.gpt_oss_models import write_tiny_gpt_oss

    hf = write_tiny_gpt_oss(tmp_path, **TINY_GPT_OSS)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    opts = ModelOptions(np.float32, "scan", host_kernels(cfg, np.float32), tensor_parallel=4)
    model = build_from_tensors(GptOssLM, cfg, WeightSource(SafetensorsDir(tmp_path)), opts)
    sd = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
    I, local = 30, 8
    gate_up = sd["model.layers.0.mlp.experts.gate_up_proj"]                  # [E, H, 2I], gate and up interleaved
    gate, up = np.swapaxes(gate_up[..., 0::2], 1, 2), np.swapaxes(gate_up[..., 1::2], 1, 2)   # [E, I, H]
    bias = sd["model.layers.0.mlp.experts.gate_up_proj_bias"]
    down = np.swapaxes(sd["model.layers.0.mlp.experts.down_proj"], 1, 2)    # [E, H, I]

    def pad(x: np.ndarray, axis: int) -> np.ndarray:   # I rows -> 4 x 8, zeros after
        return np.concatenate([x, np.zeros(x.shape[:axis] + (local * 4 - I,) + x.shape[axis + 1:], x.dtype)], axis=axis)

    gate, up, down = pad(gate, 1), pad(up, 1), pad(down, 2)
    g_bias, u_bias = pad(bias[:, 0::2], 1), pad(bias[:, 1::2], 1)
    mlp = model.layers.mlp[0]
    got_gu, got_bias, got_down = (np.asarray(p[...]) for p in (mlp.gate_up, mlp.gate_up_bias, mlp.down))
    assert got_gu.shape == (4, 2 * 4 * local, 64) and got_down.shape == (4, 64, 4 * local)
    for d in range(4):
        rows, mine = slice(d * local, (d + 1) * local), slice(2 * d * local, 2 * (d + 1) * local)
        np.testing.assert_array_equal(got_gu[:, mine], np.concatenate([gate[:, rows], up[:, rows]], axis=1))
        np.testing.assert_array_equal(got_bias[:, mine], np.concatenate([g_bias[:, rows], u_bias[:, rows]], axis=1))
        np.testing.assert_array_equal(got_down[:, :, rows], down[:, :, rows])
    assert not got_gu[:, -2:].any() and not got_down[..., -2:].any()
    np.testing.assert_array_equal(np.asarray(mlp.down_bias[...]), sd["model.layers.0.mlp.experts.down_proj_bias"])
    assert "8 rows of each of 4 experts per shard" in model.tp.describe(cfg)   # the start-up log line
    sinks = sd["model.layers.0.self_attn.sinks"]
    np.testing.assert_array_equal(np.asarray(model.layers.sinks[...])[0],
                                  [sinks[0], sinks[2], sinks[1], sinks[3], 0, 0, 0, 0])
