"""Q4_K / Q6_K quantisation in NumPy (gguf-py dequantises them but cannot make them) and a SmolLM2 GGUF
rewritten with llama.cpp's Q4_K_M layout, for tests that must run where llama-quantize is not built.

The quantisers are plain (a min/max fit per sub-block, not llama.cpp's search for the best scales): the
blocks are valid and the values near the weights, which is all a test of the *reading* side needs. The
layout is what `llama-quantize ... Q4_K_M` makes of SmolLM2 (scripts/bench_peers.sh quantize): rows of
576 weights are not whole 256-weight super-blocks, so q/k/o/gate/up fall back to Q5_0 and the
embedding to Q8_0; ffn_down is Q6_K in the layers llama.cpp gives more bits and Q4_K in the others, and
attn_v Q8_0 / Q5_0 there (its Q6_K / Q4_K's fallbacks). The same type counts as llama-quantize's file.
"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from tiny_gguf import Stored, write_named_gguf

QK_K = 256


def _f16(x: np.ndarray) -> np.ndarray:
    """float32 -> the float16 values as float32 (what a block stores and a reader sees)."""
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K % 256 == 0) -> Q4_K blocks uint8 [N, K / 256 * 144]:
    w = (d * sc_j) * q - dmin * mn_j, 8 sub-blocks of 32, 6-bit sc / mn, 4-bit q."""
    n, k = x.shape
    sb = x.reshape(n, k // QK_K, 8, 32).astype(np.float32)
    lo = np.minimum(sb.min(-1), 0.0)
    scale = (sb.max(-1) - lo) / 15.0                              # [n, b, 8]
    d = _f16(scale.max(-1) / 63.0)                                # [n, b]
    dmin = _f16(-lo.min(-1) / 63.0)
    safe = lambda a: np.where(a > 0, a, 1.0)
    sc = np.clip(np.rint(scale / safe(d)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(-lo / safe(dmin)[..., None]), 0, 63).astype(np.uint8)
    step = d[..., None] * sc
    q = np.clip(np.rint((sb + (dmin[..., None] * mn)[..., None]) / safe(step)[..., None]), 0, 15).astype(np.uint8)
    out = np.zeros((n, k // QK_K, 144), np.uint8)
    out[..., 0:2] = d.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:4] = dmin.astype(np.float16)[..., None].view(np.uint8)
    out[..., 4:8] = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    out[..., 8:12] = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    out[..., 12:16] = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    q = q.reshape(n, k // QK_K, 4, 2, 32)                        # sub-block 2g + plane
    out[..., 16:] = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(n, k // QK_K, 128)
    return out.reshape(n, -1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K % 256 == 0) -> Q6_K blocks uint8 [N, K / 256 * 210]:
    w = (d * sc_j) * (q - 32), 16 sub-blocks of 16, int8 sc, 6-bit q."""
    n, k = x.shape
    sb = x.reshape(n, k // QK_K, 16, 16).astype(np.float32)
    scale = np.abs(sb).max(-1) / 31.0                             # [n, b, 16]
    d = _f16(scale.max(-1) / 127.0)
    safe = lambda a: np.where(a > 0, a, 1.0)
    sc = np.clip(np.rint(scale / safe(d)[..., None]), -128, 127).astype(np.int8)
    step = d[..., None] * sc
    q = (np.clip(np.rint(sb / safe(step)[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, k // QK_K, 256)
    out = np.zeros((n, k // QK_K, 210), np.uint8)
    low, high = q & 15, q >> 4
    for half in range(2):
        h = low[..., half * 128:(half + 1) * 128].reshape(n, -1, 2, 64)      # plane = weight // 64 in the half
        out[..., half * 64:(half + 1) * 64] = h[..., 0, :] | (h[..., 1, :] << 4)
        t = high[..., half * 128:(half + 1) * 128].reshape(n, -1, 4, 32)     # plane = weight // 32 in the half
        out[..., 128 + half * 32:128 + (half + 1) * 32] = (t[..., 0, :] | (t[..., 1, :] << 2) | (t[..., 2, :] << 4)
                                                             | (t[..., 3, :] << 6))
    out[..., 192:208] = sc.view(np.uint8)
    out[..., 208:210] = d.astype(np.float16)[..., None].view(np.uint8)
    return out.reshape(n, -1)


def blocks_of(x: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.Q4_K:
        return quantize_q4_k(x)
    if qtype == Q.Q6_K:
        return quantize_q6_k(x)
    return quantize(x, qtype)


def q4_k_m_type(name: str, layer: int, layers: int) -> Q | None:
    """The type llama-quantize's Q4_K_M gives SmolLM2's tensor `name` (None: kept as stored, F32 norms)."""
    if name.endswith("norm.weight"):
        return None
    if name == "token_embd.weight":
        return Q.Q8_0
    # llama.cpp's use_more_bits: the first and last eighth of the layers, and every third between
    more = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
    if name.endswith("ffn_down.weight"):
        return Q.Q6_K if more else Q.Q4_K
    if name.endswith("attn_v.weight"):   # Q6_K / Q4_K, which 576-weight rows cannot hold: Q8_0 / Q5_0
        return Q.Q8_0 if more else Q.Q5_0
    return Q.Q5_0


def write_q4_k_m(src: Path, dst: Path) -> dict[str, Q]:
    """`src` (a GGUF) rewritten with the Q4_K_M layout above, from its dequantised weights; the metadata
    (tokenizer, chat template, hyperparameters) copied. Returns each tensor's new type."""
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    metadata = {field.name: (field.contents(), field.types[0],
                             field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
                for field in reader.fields.values()
                if not field.name.startswith("GGUF.") and field.name != "general.architecture"}
    types: dict[str, Q] = {}
    tensors: dict[str, Stored] = {}
    for t in reader.tensors:
        shape = tuple(int(s) for s in reversed(t.shape))   # [rows, row length]
        values = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        types[t.name] = qtype = q4_k_m_type(t.name, layer, layers) or Q.F32
        tensors[t.name] = values if qtype == Q.F32 else (blocks_of(values, qtype), qtype)
    write_named_gguf(dst, arch, metadata, tensors)
    return types
