"""Random GGML blocks of each quantisation format a GGUF may hold (valid: finite scales), and gguf-py's own
dequantisation of them: test data for the block kernels (tests/test_kquants.py and its siblings) and for
scripts that write quantised GGUFs (scripts/bench_moe.py)."""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from imp_jax.kernels_pallas import ggml_blocks as quant


# byte offsets of each format's f16 scales: random bytes there could be inf / NaN
F16_FIELDS = {"Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2],
              "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": []}


BLOCK_BYTES = {**quant.FORMATS, "IQ4_NL": quant.IQ4_NL_BYTES}   # the file's block sizes (IQ4_NL loads as Q8_0)


BLOCK_WEIGHTS = {**quant.WEIGHTS, "IQ4_NL": quant.BLOCK}


def random_blocks(fmt: str, n: int, blocks: int, seed: int, scale: float = 0.05) -> np.ndarray:
    """uint8 [n, blocks, bytes]: gguf-py's quantisation of a random matrix where gguf-py has one
    (Q4_0, Q4_1, Q8_0, Q5_0, Q5_1), else random bytes with random finite f16 scales (every bit pattern of the rest is a
    valid block)."""
    rng = np.random.default_rng(seed)
    if fmt in ("Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q8_0"):
        x = rng.standard_normal((n, blocks * quant.WEIGHTS[fmt])).astype(np.float32)
        return quantize(x, Q[fmt]).reshape(n, blocks, quant.FORMATS[fmt])
    b = rng.integers(0, 256, (n, blocks, BLOCK_BYTES[fmt]), dtype=np.uint8)
    if fmt == "MXFP4":   # E8M0 exponents: typical ones, the smallest normal scale, the largest (x 12: inf)
        b[..., 0] = rng.integers(118, 130, (n, blocks))
        b.reshape(-1, 17)[:2, 0] = (2, 255)
    for at in F16_FIELDS[fmt]:
        b[..., at:at + 2] = (rng.standard_normal((n, blocks)) * scale).astype(np.float16)[..., None].view(np.uint8)
    return b


def gguf_py(blocks: np.ndarray, fmt: str) -> np.ndarray:
    return dequantize(blocks.reshape(blocks.shape[0], -1), Q[fmt]).reshape(blocks.shape[0], -1)
