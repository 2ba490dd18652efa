"""Q5_0 / Q5_1, the K-quants (Q2_K..Q6_K), IQ4_XS and MXFP4 kept as GGML blocks: dequantised bit for bit as
gguf-py does, widened by the CPU GEMM kernel to those same values, loaded from a GGUF as blocks."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize
from quant_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, gguf_py, random_blocks
from support.cpu_gemm import needs_kernel

from imp_jax.kernels_pallas import Kernels, matmul_wt
from imp_jax.kernels_pallas import ggml_blocks as quant
from imp_jax.kernels_pallas import ggml_x16
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.model.formats.gguf_loader import unpermute_rotary

NEW_FORMATS = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "MXFP4"]
CPU, CPU_Q8 = Kernels(gemm="exact"), Kernels(gemm="cpu_q8")


def quantize_k(w: np.ndarray, fmt: str) -> np.ndarray:
    """A float32 matrix [n, k] as Q4_K or Q6_K super-blocks [n, k / 256, bytes] (gguf-py has no K-quant
    quantiser): plain min-max rounding, not llama.cpp's search, so a converted model's kind of blocks
    (centred weights; random bytes give Q4_K mins far from the weights' range)."""
    n, k = w.shape
    f16 = lambda v: np.asarray(v, np.float16)
    if fmt == "Q6_K":
        g = w.reshape(n, k // 256, 16, 16).astype(np.float32)
        amax = np.abs(g).max(-1)
        d = f16(np.abs(amax).max(-1) / 32 / 127)                                   # [n, s]
        df = np.where(d == 0, 1, d).astype(np.float32)
        sc = np.clip(np.rint(amax / 32 / df[..., None]), 1, 127).astype(np.int8)     # [n, s, 16]
        q = np.clip(np.rint(g / (df[..., None, None] * sc[..., None])) + 32, 0, 63).astype(np.uint8).reshape(n, k // 256, 256)
        ql, qh = np.zeros((n, k // 256, 128), np.uint8), np.zeros((n, k // 256, 64), np.uint8)
        for h in range(2):
            part = q[..., 128 * h:128 * h + 128].reshape(n, k // 256, 4, 32)
            ql[..., 64 * h:64 * h + 32] = (part[:, :, 0] & 15) | ((part[:, :, 2] & 15) << 4)
            ql[..., 64 * h + 32:64 * h + 64] = (part[:, :, 1] & 15) | ((part[:, :, 3] & 15) << 4)
            qh[..., 32 * h:32 * h + 32] = sum((part[:, :, i] >> 4) << (2 * i) for i in range(4)).astype(np.uint8)
        return np.concatenate([ql, qh, sc.view(np.uint8), d[..., None].view(np.uint8)], -1)
    assert fmt == "Q4_K"
    g = w.reshape(n, k // 256, 8, 32).astype(np.float32)
    lo, hi = np.minimum(g.min(-1), 0), np.maximum(g.max(-1), 0)
    scale, low = (hi - lo) / 15, -lo
    d, dmin = f16(scale.max(-1) / 63), f16(low.max(-1) / 63)
    df, dminf = np.where(d == 0, 1, d).astype(np.float32), np.where(dmin == 0, 1, dmin).astype(np.float32)
    sc = np.clip(np.rint(scale / df[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(low / dminf[..., None]), 0, 63).astype(np.uint8)
    step = np.where(sc == 0, 1, df[..., None] * sc)[..., None]
    q = np.clip(np.rint((g + (dminf[..., None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    s = np.zeros((n, k // 256, 12), np.uint8)
    s[..., 0:4] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    s[..., 4:8] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    qs = (q[:, :, 0::2] | (q[:, :, 1::2] << 4)).reshape(n, k // 256, 128)   # sub-blocks 2i (low), 2i + 1 (high)
    return np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), s, qs], -1)


@pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K"])
def test_the_k_quantiser_makes_blocks_close_to_the_matrix(fmt):
    w = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    err = np.abs(gguf_py(quantize_k(w, fmt), fmt) - w)
    # about a quarter of a step on average (4 bits over a sub-block's ~4-sigma range; 6 bits over twice its amax)
    assert err.mean() < (0.08 if fmt == "Q4_K" else 0.02) and err.max() < 0.25


@pytest.mark.parametrize("fmt", ["Q4_0", "Q5_0", "Q8_0"])
def test_q4_0_and_q5_0_blocks_widen_to_q8_0_exactly(fmt):
    """A fused matrix whose parts mix Q4_0 / Q5_0 / Q8_0 is held as Q8_0: the same f16 scale and the
    same integers, so gguf-py's dequantised values bit for bit."""
    blocks = random_blocks(fmt, 7, 4, seed=3)
    widened = quant.to_q8_0(blocks)
    assert quant.format_of(widened) == "Q8_0" and widened.shape[:2] == blocks.shape[:2]
    np.testing.assert_array_equal(gguf_py(widened, "Q8_0").view(np.uint32), gguf_py(blocks, fmt).view(np.uint32))


def test_iq4_nl_blocks_are_held_as_q8_0_exactly():
    """IQ4_NL (18-byte blocks, Q4_0's size: the block size cannot name it) loads as Q8_0 blocks of the
    same f16 scale and the table's int8 values, so gguf-py's dequantised values bit for bit."""
    blocks = random_blocks("IQ4_NL", 6, 5, seed=4)
    blocks[0, 0, 2:] = np.arange(16, dtype=np.uint8) * 17   # both nibbles of every byte: each table entry
    widened = quant.iq4_nl_to_q8_0(blocks)
    assert quant.format_of(widened) == "Q8_0" and widened.shape[:2] == blocks.shape[:2]
    np.testing.assert_array_equal(gguf_py(widened, "Q8_0").view(np.uint32), gguf_py(blocks, "IQ4_NL").view(np.uint32))
    with pytest.raises(ValueError, match="not IQ4_NL"):
        quant.iq4_nl_to_q8_0(widened)


def kept_iq4_nl(n: int, blocks: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random IQ4_NL file blocks [n, 2 * blocks, 18] as kept (pairs, [n, blocks, 36]), and gguf-py's floats."""
    file_blocks = random_blocks("IQ4_NL", n, 2 * blocks, seed=seed)
    file_blocks[0, 0, 2:] = np.arange(16, dtype=np.uint8) * 17   # every table entry, in both nibbles
    return quant.iq4_nl_pairs(file_blocks), gguf_py(file_blocks, "IQ4_NL")


def test_iq4_nl_is_kept_in_pairs_of_blocks():
    """IQ4_NL rows of a multiple of 64 weights keep the file's bytes as 36-byte pairs of blocks (a
    size no other format has), dequantised as gguf-py does, bit for bit; odd block counts cannot pair."""
    kept, want = kept_iq4_nl(5, 3, seed=6)
    assert quant.format_of(kept) == "IQ4_NL" and quant.matrix_shape(kept) == want.shape == (5, 192)
    np.testing.assert_array_equal(np.asarray(quant.dequantize(jnp.asarray(kept))).view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.iq4_nl_pairs(random_blocks("IQ4_NL", 2, 3, seed=1))


@pytest.mark.parametrize("fmt", NEW_FORMATS)
def test_dequantize_is_gguf_pys_bit_for_bit(fmt):
    blocks = random_blocks(fmt, 5, 3, seed=1)
    want = gguf_py(blocks, fmt)
    assert quant.format_of(blocks) == fmt and quant.matrix_shape(blocks) == want.shape
    got = np.asarray(quant.dequantize(jnp.asarray(blocks)))
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # -0.0 too
    rows = np.asarray(quant.dequantize(jnp.asarray(blocks[[3, 0, 3]])))        # embedding rows
    np.testing.assert_array_equal(rows.view(np.uint32), want[[3, 0, 3]].view(np.uint32))


kernel = jax.jit(cpu_gemm.matmul_wt_cpu)


@needs_kernel
@pytest.mark.parametrize("fmt", [*NEW_FORMATS, "IQ4_NL"])
def test_the_kernel_gives_the_float32_kernels_bits(fmt):
    """The blocks widened in the kernel are gguf-py's floats: the product is the float32 kernel's on
    gguf-py's dequantised matrix, bit for bit, at 1 row (gemv), a few, 64 (one row block) and 260
    (several, threaded), odd N (tile edges, several column blocks)."""
    for n, blocks in ((7, 2), (49, 3)):
        w, dense = kept_iq4_nl(n, blocks, seed=n) if fmt == "IQ4_NL" else (w := random_blocks(fmt, n, blocks, seed=n),
                                                                          gguf_py(w, fmt))
        k = dense.shape[1]
        for m in (1, 7, 64, 260):
            x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
            got = np.asarray(kernel(x, jnp.asarray(w)))
            np.testing.assert_array_equal(got, np.asarray(kernel(x, dense)), err_msg=f"{n} x {k}, {m} rows")
        np.testing.assert_allclose(got, x.astype(np.float64) @ dense.astype(np.float64).T, rtol=1e-4,
                                   atol=1e-5 * np.sqrt(k) * np.abs(dense).max() * np.abs(x).max())


@needs_kernel
@pytest.mark.parametrize("fmt", ["Q2_K", "IQ4_XS"])
def test_cpu_q8_has_an_int8_path_for_every_kept_format(fmt):
    """`--gemm cpu_q8` has int8 arithmetic for every format ggml_blocks keeps (none is widened exactly
    any more): each block size calls its own format's q8 kernel, never one reading another layout, and
    the result is close to the exact one, not its bits (tests/test_cpu_gemm_q8_k.py pins the arithmetic)."""
    assert set(cpu_gemm.Q8_FORMATS) == set(quant.FORMATS)
    w = jnp.asarray(random_blocks(fmt, 9, 2, seed=3))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, quant.matrix_shape(w)[1])).astype(np.float32))
    text = jax.jit(lambda x, w: matmul_wt(x, w, CPU_Q8)).lower(x, w).as_text()
    assert [t for t in cpu_gemm.Q8_TARGETS.values() if t in text] == [cpu_gemm.Q8_TARGETS[fmt]]
    assert cpu_gemm.BLOCK_TARGETS[fmt] not in text
    got, exact = np.asarray(matmul_wt(x, w, CPU_Q8)), np.asarray(matmul_wt(x, w, CPU))
    assert not np.array_equal(got, exact)
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-2 * np.abs(exact).max())


def test_hf_mxfp4_becomes_ggml_blocks_of_the_same_values():
    """gpt-oss's HF MXFP4 (`*_blocks`, value 2i / 2i + 1 in a byte's low / high nibble, and E8M0
    `*_scales`) rearranged into GGML MXFP4 blocks: every weight the value model/architectures/gpt_oss.py's
    dequantisation gives (+0.0 for E2M1's -0.0), and gguf-py's dequantisation of the result."""
    from imp_jax.model.architectures.gpt_oss import dequantize_mxfp4

    rng = np.random.default_rng(8)
    blocks = rng.integers(0, 256, (3, 5, 4, 16), dtype=np.uint8)
    scales = rng.integers(110, 140, (3, 5, 4), dtype=np.uint8)
    scales[0, 0, :3] = (2, 200, 255)
    kept = quant.mxfp4_from_hf(blocks, scales)
    assert quant.format_of(kept[0]) == "MXFP4" and kept.shape == (3, 5, 4, 17)
    want = dequantize_mxfp4(blocks, scales)
    got = np.asarray(quant.dequantize(jnp.asarray(kept)))
    np.testing.assert_array_equal(got, want)                         # == : -0.0 equals +0.0
    np.testing.assert_array_equal(got.view(np.uint32), gguf_py(kept.reshape(15, 4, 17), "MXFP4").reshape(got.shape).view(np.uint32))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        quant.mxfp4_from_hf(blocks, scales[..., :3])


def test_tensor_parallel_columns_keep_whole_super_blocks():
    from imp_jax.model.tensor_parallel import take_columns

    w = random_blocks("Q4_K", 3, 4, seed=5)
    dense = gguf_py(w, "Q4_K")
    index = np.concatenate([np.arange(512, 768), np.full(256, -1)])   # super-block 2, then a zero one
    kept = take_columns(w, index)
    assert quant.format_of(kept) == "Q4_K" and kept.shape == (3, 2, 144)
    np.testing.assert_array_equal(gguf_py(kept, "Q4_K")[:, :256], dense[:, 512:768])
    assert not gguf_py(kept, "Q4_K")[:, 256:].any()
    split = take_columns(w, np.arange(32, 288))                       # not super-block aligned: floats
    assert split.dtype == np.float32
    np.testing.assert_array_equal(split, dense[:, 32:288])


# ------------------------------------------------------------------ a tiny mixed-type GGUF
HIDDEN, FFN, HEADS, KV_HEADS = 256, 512, 4, 2
HEAD_DIM = HIDDEN // HEADS
DENSE_STD = 0.5   # the quantisable formats' weights: N(0, DENSE_STD^2 / K)
# per layer: {HF leaf: type}; q/k/v and gate/up share a type so they stay fused as blocks, or
# (layer 2, as llama.cpp's Q4_K_M gives attn_v a wider type) mix Q4_0 / Q5_0 / Q8_0, fused as Q8_0;
# layer 1's IQ4_NL down_proj is kept in pairs of blocks, layer 2's IQ4_XS o_proj as itself
LAYERS = [
    {"self_attn.q_proj": Q.Q4_K, "self_attn.k_proj": Q.Q4_K, "self_attn.v_proj": Q.Q4_K, "self_attn.o_proj": Q.Q3_K,
     "mlp.gate_proj": Q.Q6_K, "mlp.up_proj": Q.Q6_K, "mlp.down_proj": Q.Q2_K},
    {"self_attn.q_proj": Q.Q5_0, "self_attn.k_proj": Q.Q5_0, "self_attn.v_proj": Q.Q5_0, "self_attn.o_proj": Q.Q5_1,
     "mlp.gate_proj": Q.Q5_K, "mlp.up_proj": Q.Q5_K, "mlp.down_proj": Q.IQ4_NL},
    {"self_attn.q_proj": Q.Q5_0, "self_attn.k_proj": Q.Q5_0, "self_attn.v_proj": Q.Q8_0, "self_attn.o_proj": Q.IQ4_XS,
     "mlp.gate_proj": Q.Q4_0, "mlp.up_proj": Q.Q8_0, "mlp.down_proj": Q.Q4_K},
]
SHAPES = {"self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN), "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
          "mlp.gate_proj": (FFN, HIDDEN), "mlp.up_proj": (FFN, HIDDEN), "mlp.down_proj": (HIDDEN, FFN)}


def write_mixed_gguf(path: Path) -> None:
    from tiny_gguf import sentencepiece_vocab, write_gguf_file

    rng = np.random.default_rng(0)
    tokens, types, scores = sentencepiece_vocab()
    meta = dict(block_count=len(LAYERS), context_length=256, embedding_length=HIDDEN, feed_forward_length=FFN,
                head_count=HEADS, head_count_kv=KV_HEADS, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5,
                tokenizer_model="llama", token_scores=scores, bos_token_id=1, eos_token_id=2, unk_token_id=0,
                token_list=tokens, token_types=types, vocab_size=len(tokens))
    tensors: dict[str, np.ndarray] = {}
    stored: dict[str, Q] = {}

    def put(name: str, shape: tuple[int, int], qtype: Q) -> None:
        fmt, seed = qtype.name, int(rng.integers(1 << 30))
        if fmt in ("Q4_K", "Q6_K", "Q4_0", "Q5_0", "Q5_1", "Q8_0"):
            # a converted model's blocks, of weights ~ N(0, DENSE_STD^2 / K): centred, and small enough
            # that cpu_q8's int8 rounding moves the logits a little, not onto another trajectory
            dense = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * (DENSE_STD / np.sqrt(shape[1]))
            raw = quantize_k(dense, fmt) if fmt.endswith("_K") else quantize(dense, qtype)
            blocks = raw.reshape(shape[0], -1, quant.FORMATS[fmt])
        else:
            # small enough that the random model is not chaotic (cpu_q8's int8 rounding stays a 0.5% change
            # of the logits, not a different trajectory); IQ4_XS's random bytes give weights about 4x a
            # K-quant's for the same d (|sc - 32| * |table[q]|)
            scale = 0.2 / shape[1] / (4 if fmt == "IQ4_XS" else 1)
            blocks = random_blocks(fmt, shape[0], shape[1] // BLOCK_WEIGHTS[fmt], seed=seed, scale=scale)
        blocks = blocks.reshape(shape[0], -1)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            # the writer permutes llama's q/k rows as the converter does: the file keeps them as drawn
            blocks = unpermute_rotary(blocks, HEADS if "q_proj" in name else KV_HEADS)
        tensors[name], stored[name] = blocks, qtype

    put("model.embed_tokens.weight", (len(tokens), HIDDEN), Q.Q6_K)
    put("lm_head.weight", (len(tokens), HIDDEN), Q.Q4_K)
    tensors["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    for i, types_ in enumerate(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = np.ones(HIDDEN, np.float32)
        for leaf, qtype in types_.items():
            put(f"model.layers.{i}.{leaf}.weight", SHAPES[leaf], qtype)
    write_gguf_file(path, "llama", meta, tensors, qtype=lambda name: stored.get(name, Q.F32))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-kquants.gguf"
    write_mixed_gguf(path)
    return path


@needs_kernel
def test_a_mixed_k_quant_gguf_keeps_its_blocks_and_the_dequantised_logits(mixed):
    """Every matrix stays as the file's blocks (a matrix's bytes on the device == its bytes in the
    file; fused parts mixing Q4_0 / Q5_0 / Q8_0 as Q8_0), and the model computes the dequantised
    model's logits bit for bit with `--gemm cpu`, and close to them with `--gemm cpu_q8`."""
    from paged import PagedRunner

    from imp_jax.model.config import ModelConfig
    from imp_jax.model.formats.gguf_loader import load_gguf
    from imp_jax.model.architectures.llama import DecoderLM
    from imp_jax.model.formats.loader import load_model
    from imp_jax.model.weights import WeightSource
    from imp_jax.runtime.execution.batch import SeqChunk

    kept = load_model(mixed, dtype="float32", gemm="exact").model
    assert kept.options.kernels.gemm == "exact"
    formats = {name: [quant.format_of(w) for w in ws] for name, ws in kept.layers.matrices().items()}
    assert formats == {"qkv_proj": ["Q4_K", "Q5_0", "Q8_0"], "o_proj": ["Q3_K", "Q5_1", "IQ4_XS"],
                       "gate_up_proj": ["Q6_K", "Q5_K", "Q8_0"], "down_proj": ["Q2_K", "IQ4_NL", "Q4_K"]}
    assert quant.format_of(kept.embed[...]) == "Q6_K" and quant.format_of(kept.lm_head[...]) == "Q4_K"
    reader = gguf.GGUFReader(str(mixed))
    file_bytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    assert kept.embed[...].nbytes == file_bytes["token_embd.weight"]
    assert kept.layers.matrices()["down_proj"][0].nbytes == file_bytes["blk.0.ffn_down.weight"]
    assert kept.layers.matrices()["o_proj"][2].nbytes == file_bytes["blk.2.attn_output.weight"]   # IQ4_XS
    assert kept.layers.matrices()["qkv_proj"][0].nbytes == sum(file_bytes[f"blk.0.attn_{p}.weight"] for p in "qkv")
    reader_type = {t.name: t.tensor_type.name for t in reader.tensors}
    q8_0_bytes = lambda name: file_bytes[name] // BLOCK_BYTES[reader_type[name]] * quant.FORMATS["Q8_0"]
    assert kept.layers.matrices()["down_proj"][1].nbytes == file_bytes["blk.1.ffn_down.weight"]   # IQ4_NL
    assert kept.layers.matrices()["qkv_proj"][2].nbytes == sum(q8_0_bytes(f"blk.2.attn_{p}.weight") for p in "qkv")

    ckpt = load_gguf(mixed)
    cfg = ModelConfig.from_hf(ckpt.hf_config, source=str(mixed))
    plain = DecoderLM.from_hf_tensors(cfg, WeightSource(ckpt.tensors), kept.options)   # float32 matrices
    assert all(w.ndim == 2 for ws in plain.layers.matrices().values() for w in ws)
    chunks = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5], 0, [1])]   # 9 rows: the float32 kernel's summation order
    want = PagedRunner(plain).run(chunks, 16, 1)[0]
    assert np.isfinite(want).all() and want.std() > 0
    np.testing.assert_array_equal(PagedRunner(kept).run(chunks, 16, 1)[0], want)
    q8 = load_model(mixed, dtype="float32", kernels=dataclasses.replace(kept.options.kernels, gemm="cpu_q8")).model
    # cpu_q8 runs every matrix on int8 activations (the K-quants, IQ4_XS / IQ4_NL, Q5_x, and Q8_0: layer
    # 2's widened fusions): close to the dequantised model, not its bits
    # (on a CPU with the AVX-512 path, the Q5_0, Q8_0, Q4_K, Q6_K, IQ4_XS and IQ4_NL ones interleaved 16 rows at a time)
    int8, interleaved = set(), set()
    for w in [q8.lm_head[...], *(w for ws in q8.layers.matrices().values() for w in ws)]:
        x = jnp.ones((3, quant.matrix_shape(w)[1]), jnp.float32)
        text = jax.jit(lambda x, w: matmul_wt(x, w, CPU_Q8)).lower(x, w).as_text()
        fmt = quant.format_of(w)
        base = ggml_x16.FORMATS[fmt][0] if fmt in ggml_x16.FORMATS else fmt
        assert cpu_gemm.Q8_TARGETS[fmt] in text and cpu_gemm.BLOCK_TARGETS[base] not in text, fmt
        int8 |= {base}
        interleaved |= {base} if fmt != base else set()
    assert int8 == {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "Q5_0", "Q5_1", "Q8_0"}
    assert interleaved == ({"Q5_0", "Q8_0", "Q4_K", "Q6_K", "IQ4_XS", "IQ4_NL"} if cpu_gemm.interleaves() else set())   # no Q4_0 / Q4_1 here
    got = PagedRunner(q8).run(chunks, 16, 1)[0]
    assert not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.ptp(want))
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_keeps_the_blocks_and_dequantises_inside_the_program(mixed, dtype):
    """`--quantized-weights keep` under XLA's dot (a GPU's default): every matrix stays as the file's
    blocks and is dequantised in the program, matrix by matrix, to the values a load-time
    dequantisation stores for the model's dtype: the logits are the dequantised model's, bit for bit."""
    from paged import PagedRunner

    from imp_jax.kernels_pallas.backends import select_kernels
    from imp_jax.model.formats.loader import attention_shape, load_model, open_checkpoint
    from imp_jax.runtime.execution.batch import SeqChunk

    keep = Kernels(gemm="xla", quantized="keep")
    assert keep.keeps_blocks and not Kernels(gemm="xla").keeps_blocks and CPU.keeps_blocks
    assert not Kernels(gemm="exact", quantized="dequantize").keeps_blocks
    kept = load_model(mixed, dtype=dtype, kernels=keep).model
    plain = load_model(mixed, dtype=dtype, kernels=Kernels(gemm="xla", quantized="dequantize")).model
    assert quant.format_of(kept.lm_head[...]) == "Q4_K" and quant.format_of(plain.lm_head[...]) is None
    assert {quant.format_of(w) for ws in kept.layers.matrices().values() for w in ws} == {
        "Q4_K", "Q5_0", "Q8_0", "Q3_K", "Q5_1", "Q6_K", "Q5_K", "Q2_K", "IQ4_XS", "IQ4_NL"}
    chunks = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5], 0, [1])]
    want = PagedRunner(plain).run(chunks, 16, 1)[0]
    np.testing.assert_array_equal(PagedRunner(kept).run(chunks, 16, 1)[0], want)

    gpu = type("Device", (), {"platform": "gpu", "device_kind": "test"})()   # what a GPU resolves auto to
    shape = attention_shape(open_checkpoint(mixed).config, jnp.bfloat16, jnp.bfloat16, 16, "gpu")
    assert select_kernels(gpu, shape).keeps_blocks
    assert not select_kernels(gpu, shape, quantized="dequantize").keeps_blocks
    with pytest.raises(ValueError, match="quantized-weights"):
        select_kernels(gpu, shape, quantized="int3")
