"""Mixture-of-experts stacks kept as GGML blocks ([E, N, K / W, bytes], model/architectures/moe.py): tiny Mixtral and
Qwen2-MoE GGUFs with quantised expert stacks and a tiny gpt-oss with MXFP4 experts (HF and GGUF) hold
the file's bytes, and compute the dequantised model's logits bit for bit (`--gemm exact`, XLA keep)."""
from __future__ import annotations

from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from imp_jax.kernels_pallas import Kernels
from imp_jax.kernels_pallas import ggml_blocks as quant
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.gguf_loader import load_gguf
from imp_jax.model.formats.loader import load_model
from imp_jax.model.architectures.moe import EXPERT_IMPLS, MoELM, expert_ffn
from imp_jax.model.tensor_parallel import take
from imp_jax.model.weights import WeightFormats, WeightSource, describe
from imp_jax.runtime.execution.batch import SeqChunk
from paged import PagedRunner
from quant_blocks import BLOCK_BYTES, random_blocks
from support.cpu_gemm import needs_kernel
from support.moe_models import EXPERTS, E, H, I, expert_blocks, write_moe_blocks_gguf

KEPT = {"llama": [("Q4_K", "Q6_K"), ("Q8_0", "Q5_K")], "qwen2moe": [("IQ4_NL", "Q2_K"), (None, "MXFP4")]}


@pytest.fixture(scope="module", params=sorted(EXPERTS))
def moe_gguf(request, tmp_path_factory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("moe_blocks") / f"{request.param}.gguf"
    write_moe_blocks_gguf(path, request.param)
    return request.param, path


def file_bytes(path: Path) -> dict[str, tuple[str, int]]:
    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors}


CHUNKS = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5], 0, [1])]


@needs_kernel
def test_expert_stacks_keep_the_files_blocks_and_the_dequantised_logits(moe_gguf):
    """On the CPU GEMM kernel each expert stack stays as the file's blocks (device bytes == file bytes;
    Q4_0 + Q8_0 gate|up as Q8_0; Q4_K + Q5_K gate|up dequantised), the log line counts them, and the
    logits are the dequantised model's bit for bit (same rows per GEMM: the same summation order)."""
    arch, path = moe_gguf
    kept = load_model(path, dtype="float32", gemm="exact").model
    assert kept.options.kernels.gemm == "exact"
    files = file_bytes(path)
    for i, (mlp, (gu_fmt, down_fmt)) in enumerate(zip(kept.layers.mlp, KEPT[arch])):
        gu, down = mlp.gate_up[...], mlp.down[...]
        assert (quant.format_of(gu), quant.format_of(down)) == (gu_fmt, down_fmt), i
        assert down.ndim == 4 and down.nbytes == files[f"blk.{i}.ffn_down_exps.weight"][1]
        parts = [files[f"blk.{i}.ffn_{p}_exps.weight"] for p in ("gate", "up")]
        if gu_fmt == "Q8_0" and {t for t, _ in parts} != {"Q8_0"}:   # widened: 34 bytes per 32 weights
            assert gu.nbytes == sum(n // BLOCK_BYTES[t] * quant.FORMATS["Q8_0"] for t, n in parts)
        elif gu_fmt is not None:
            assert gu.nbytes == sum(n for _, n in parts)
        else:
            assert gu.dtype == jnp.float32 and gu.shape == (E, 2 * I, H)
    line = describe(kept)
    assert "expert stacks kept as blocks:" in line and all(f"1 {f}" in line.split(":")[-1]
                                                          for f in sum(KEPT[arch], ()) if f)

    ckpt = load_gguf(path)
    cfg = ModelConfig.from_hf(ckpt.hf_config, source=str(path))
    plain = MoELM.from_hf_tensors(cfg, WeightSource(ckpt.tensors), kept.options)   # float32 stacks
    assert all(quant.format_of(m.gate_up[...]) is None and quant.format_of(m.down[...]) is None
               for m in plain.layers.mlp)
    want = PagedRunner(plain).run(CHUNKS, 16, 1)[0]
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(PagedRunner(kept).run(CHUNKS, 16, 1)[0], want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_keeps_the_expert_blocks_and_dequantises_them_in_the_program(moe_gguf, dtype):
    """`--quantized-weights keep` under XLA's dot (a GPU's default): the stacks stay blocks and each
    expert's matrix is dequantised as it is multiplied, to the values a load-time dequantisation
    stores for the model's dtype: the dequantised model's logits bit for bit."""
    arch, path = moe_gguf
    keep = load_model(path, dtype=dtype, kernels=Kernels(gemm="xla", quantized="keep")).model
    plain = load_model(path, dtype=dtype, kernels=Kernels(gemm="xla", quantized="dequantize")).model
    assert quant.format_of(keep.layers.mlp[0].down[...]) == KEPT[arch][0][1]
    assert quant.format_of(plain.layers.mlp[0].down[...]) is None
    np.testing.assert_array_equal(PagedRunner(keep).run(CHUNKS, 16, 1)[0], PagedRunner(plain).run(CHUNKS, 16, 1)[0])


def test_every_expert_impl_reads_block_stacks(fmt: str = "Q4_K"):
    """`tiles` and `dense` hand an expert's blocks to the GEMM, `pairs` / `gather` / `ragged`
    dequantise what they index inside the program: each gives its result on the dequantised stacks."""
    rng = np.random.default_rng(2)
    T, k = 6, 2
    gu = np.stack([expert_blocks(Q[fmt], 2 * I, H, seed=e) for e in range(E)]).reshape(E, 2 * I, -1, BLOCK_BYTES[fmt])
    dn = np.stack([expert_blocks(Q[fmt], H, I, seed=9 + e) for e in range(E)]).reshape(E, H, -1, BLOCK_BYTES[fmt])
    h = jnp.asarray(rng.standard_normal((T, H)).astype(np.float32))
    idx = jnp.asarray(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    weights = jnp.asarray(rng.random((T, k)).astype(np.float32))
    gu_f, dn_f = quant.dequantize(jnp.asarray(gu)), quant.dequantize(jnp.asarray(dn))
    for impl in EXPERT_IMPLS:
        got = np.asarray(expert_ffn(h, weights, idx, jnp.asarray(gu), jnp.asarray(dn), impl))
        want = np.asarray(expert_ffn(h, weights, idx, gu_f, dn_f, impl))
        assert np.abs(want).max() > 0
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max(), err_msg=impl)


def test_tensor_parallel_splits_an_expert_stack_by_whole_blocks_or_dequantises():
    """A stack's rows (gate|up) move whole; its columns (down) keep their blocks when the index moves
    whole blocks and every shard's part is whole blocks, else become the dequantised columns."""
    stack = np.stack([random_blocks("Q4_0", 6, 4, seed=e) for e in range(3)])   # [3, 6, 128 / 32, 18]
    dense = np.asarray(quant.dequantize(jnp.asarray(stack)))
    rows = take(stack, np.array([5, 0, -1, 2]), 1)
    assert quant.format_of(rows) == "Q4_0" and rows.shape == (3, 4, 4, 18)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(rows)))[:, [0, 1, 3]], dense[:, [5, 0, 2]])
    assert not np.asarray(quant.dequantize(jnp.asarray(rows)))[:, 2].any()
    cols = take(stack, np.concatenate([np.arange(64, 128), np.full(32, -1)]), 2)
    assert quant.format_of(cols) == "Q4_0" and cols.shape == (3, 6, 3, 18)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(cols)))[..., :64], dense[..., 64:])
    cut = take(stack, np.arange(16, 80), 2)
    assert cut.dtype == np.float32
    np.testing.assert_array_equal(cut, dense[..., 16:80])
    assert quant.format_of(take(stack, np.arange(128), 2, shards=4)) == "Q4_0"   # 32 columns a shard
    halves = take(stack, np.arange(128), 2, shards=8)                            # 16 a shard: no whole blocks
    assert halves.dtype == np.float32
    np.testing.assert_array_equal(halves, dense)


# ------------------------------------------------------------------------------------ gpt-oss MXFP4
@needs_kernel
def test_gpt_oss_hf_mxfp4_experts_stay_mxfp4_with_the_dequantised_logits(tmp_path):
    """gpt-oss's HF MXFP4 experts (`*_blocks` / `*_scales`) are kept as GGML MXFP4 blocks (17 bytes per
    32 weights: the checkpoint's 16 + 1), and the model computes the logits of the same checkpoint
    dequantised at load, bit for bit."""
    import safetensors.numpy

    from imp_jax.model.base import ModelOptions
    from imp_jax.model.architectures.gpt_oss import GptOssLM
    from imp_jax.model.formats.loader import SafetensorsDir, build_from_tensors
    from paged import host_kernels
    from support.gpt_oss_models import random_mxfp4, write_tiny_gpt_oss

    src = tmp_path / "src"
    write_tiny_gpt_oss(src)
    cfg = ModelConfig.from_file(src / "config.json")
    tensors = SafetensorsDir(src)
    out = {n: tensors[n] for n in tensors._where}
    rng = np.random.default_rng(7)
    hf_bytes = 0
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}.mlp.experts."
        for name, shape in (("gate_up_proj", (4, 64, 64)), ("down_proj", (4, 64, 32))):
            blocks, scales, _ = random_mxfp4(rng, shape)
            del out[pre + name]
            out[pre + name + "_blocks"], out[pre + name + "_scales"] = blocks, scales
            hf_bytes += blocks.nbytes + scales.nbytes
    ckpt = tmp_path / "mxfp4"
    ckpt.mkdir()
    safetensors.numpy.save_file({n: np.ascontiguousarray(v) for n, v in out.items()}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text((src / "config.json").read_text())
    opts = ModelOptions(jnp.float32, "scan", host_kernels(cfg))
    kept = build_from_tensors(GptOssLM, cfg, WeightSource(SafetensorsDir(ckpt), WeightFormats(ggml_blocks=True)), opts)
    plain = build_from_tensors(GptOssLM, cfg, WeightSource(SafetensorsDir(ckpt)), opts)
    stacks = [a for m in kept.layers.mlp for a in (m.gate_up[...], m.down[...])]
    assert {quant.format_of(a) for a in stacks} == {"MXFP4"} and sum(a.nbytes for a in stacks) == hf_bytes
    assert quant.format_of(plain.layers.mlp[0].down[...]) is None
    chunks = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 0, [3])]
    want = PagedRunner(plain).run(chunks, 16, 1)[0]
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(PagedRunner(kept).run(chunks, 16, 1)[0], want)


@needs_kernel
def test_gpt_oss_gguf_mxfp4_experts_stay_as_the_files_blocks(tmp_path):
    """A gpt-oss GGUF's MXFP4 expert stacks (gate and up split, as llama.cpp writes them) are kept as
    the file's bytes, gate|up fused, and give the dequantised model's logits bit for bit; under
    `--gemm cpu_q8` the experts take MXFP4's int8 path (its other matrices are float32, kept exact):
    close to those logits, not their bits."""
    from support.gpt_oss_models import write_gpt_oss_gguf, write_tiny_gpt_oss

    hf_model = write_tiny_gpt_oss(tmp_path / "src")
    path = tmp_path / "mxfp4.gguf"
    write_gpt_oss_gguf(path, hf_model, experts="MXFP4")
    kept = load_model(path, dtype="float32", gemm="exact").model
    files = file_bytes(path)
    for i, mlp in enumerate(kept.layers.mlp):
        assert quant.format_of(mlp.gate_up[...]) == quant.format_of(mlp.down[...]) == "MXFP4"
        assert mlp.gate_up[...].nbytes == sum(files[f"blk.{i}.ffn_{p}_exps.weight"][1] for p in ("gate", "up"))
        assert mlp.down[...].nbytes == files[f"blk.{i}.ffn_down_exps.weight"][1]
    ckpt = load_gguf(path)
    cfg = ModelConfig.from_hf(ckpt.hf_config, source=str(path))
    plain = type(kept).from_hf_tensors(cfg, WeightSource(ckpt.tensors), kept.options)
    chunks = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], 0, [3])]
    want = PagedRunner(plain).run(chunks, 16, 1)[0]
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(PagedRunner(kept).run(chunks, 16, 1)[0], want)
    q8 = load_model(path, dtype="float32", gemm="cpu_q8").model
    assert quant.format_of(q8.layers.mlp[0].down[...]) == "MXFP4"
    got = PagedRunner(q8).run(chunks, 16, 1)[0]
    # the int8 rounding moves the logits by ~1% of their range (0.3% on average); a router choosing
    # among near-tied experts can move a row further (here one row of 11 reaches 2.7%)
    assert not np.array_equal(got, want)
    assert np.abs(got - want).mean() < 5e-3 * np.ptp(want) and np.abs(got - want).max() < 5e-2 * np.ptp(want)


@needs_kernel
@pytest.mark.parametrize("moe_gguf", ["qwen2moe"], indirect=True)
def test_the_engine_serves_kept_expert_stacks(moe_gguf):
    """The offline LLM on the GGUF (its stacks kept): two prompts batched give the tokens each gives
    alone, those are the dequantised model's greedy tokens (its argmax at every generated position,
    teacher-forced), nothing compiles after warm-up and every KV block comes back."""
    from imp_jax import LLM, SamplingParams

    _, path = moe_gguf
    llm = LLM(str(path), gemm="exact", max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    stacks = [a for a in jax.tree.leaves(llm.core.step_fn.state) if a.ndim == 4 and quant.format_of(a)]
    assert sorted(quant.format_of(a) for a in stacks) == ["IQ4_NL", "MXFP4", "Q2_K"]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [7, 7, 2, 40, 11]]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=5, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert together == [llm.generate(p, params)[0].outputs[0].token_ids for p in prompts]
    assert llm.core.step_fn.compilations_after_warmup == 0
    assert llm.core.pool.num_free_blocks == llm.core.baseline_free_blocks
    ckpt = load_gguf(path)
    plain = MoELM.from_hf_tensors(ModelConfig.from_hf(ckpt.hf_config, source=str(path)), WeightSource(ckpt.tensors),
                                  load_model(path, dtype="float32", gemm="exact").model.options)
    runner = PagedRunner(plain)
    for prompt, tokens in zip(prompts, together):
        ids = prompt + tokens[:-1]
        logits = runner.run([SeqChunk(ids, 0, [1])], 16, 1)[0]
        assert logits[len(prompt) - 1:].argmax(-1).tolist() == tokens
