"""GPU defaults decided on a CPU: a GGUF's quantised matrices widened at load where they fit beside the
KV cache (runtime/execution/weights_fit.py), and a bfloat16 KV cache."""
from __future__ import annotations

import jax.numpy as jnp

from imp_jax.kernels_pallas import kv_storage_dtype
from imp_jax.model.formats.gguf_loader import load_gguf
from imp_jax.model.formats.loader import resolve_dtype
from imp_jax.runtime.core.builder import resolve_kv_dtype
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.execution.weights_fit import fit_on_gpu, quantized_weights

GIB = 2**30


class Header(dict):
    """Tensors as a GGUF header describes them: name -> (shape, storage type)."""

    def shape(self, name):
        return self[name][0]

    def qtype(self, name):
        return self[name][1]


ONE_B = Header({"embed": ((32000, 2048), "Q6_K"), "norm": ((2048,), "F32"),
                **{f"w{i}": ((2048, 8192), "Q4_K") for i in range(48)}})   # ~0.87 G weights


def fit(free_gib, tensors=ONE_B, **kw):
    args = dict(itemsize=2, free_bytes=None if free_gib is None else int(free_gib * GIB),
                kv_bytes_per_token=32 * 1024, max_model_len=8192) | kw
    return fit_on_gpu(tensors, **args)


def test_counts_quantised_weights_from_the_header():
    quantised, total = quantized_weights(ONE_B)
    assert total - quantised == 2048 and quantised == 32000 * 2048 + 48 * 2048 * 8192


def test_widened_when_weights_and_two_contexts_fit():
    # 1.62 GiB of bf16 weights + 2 x 8192 x 32 KiB (0.5 GiB) of KV = 2.12 GiB
    assert fit(80).choice == "dequantize"
    assert fit(2.4).choice == "dequantize"                 # 0.9 x 2.4 = 2.16 >= 2.12
    kept = fit(2.3)                                        # 0.9 x 2.3 = 2.07 < 2.12
    assert kept.choice == "keep" and "exceeds" in kept.why


def test_longer_contexts_and_tensor_parallelism_move_the_line():
    assert fit(2.6, max_model_len=32768).choice == "keep"  # 2 GiB of KV reserve
    assert fit(1.5).choice == "keep"
    assert fit(1.5, devices=2).choice == "dequantize"      # each device holds half the weights


def test_unknown_memory_keeps_and_float_files_need_no_choice():
    assert fit(None).choice == "keep"
    assert fit(80, tensors=Header({"w": ((64, 64), "F16")})) is None
    assert fit(80, tensors={"w": None}) is None            # safetensors: no storage types to read


def test_the_real_q4_gguf_header(smollm2_gguf_path):
    tensors = load_gguf(smollm2_gguf_path).tensors
    quantised, total = quantized_weights(tensors)
    assert 130e6 < total < 140e6 and quantised > 0.8 * total
    assert fit(80, tensors=tensors).choice == "dequantize"
    assert fit(0.2, tensors=tensors).choice == "keep"


def test_kv_cache_is_bfloat16_on_a_gpu():
    dtype = resolve_dtype("auto", "gpu")
    assert dtype == jnp.bfloat16
    kv = resolve_kv_dtype(EngineConfig(), dtype)
    assert kv == jnp.bfloat16 and kv_storage_dtype(kv, "gpu") == jnp.bfloat16
    assert resolve_kv_dtype(EngineConfig(kv_cache_dtype="float32"), dtype) == jnp.float32
