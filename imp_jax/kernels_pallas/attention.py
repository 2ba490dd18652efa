"""The one attention entry point the models call: write new K/V, then attend over the pages."""
from __future__ import annotations

import os

import jax

from imp_jax.kernels_pallas import cpu_attention
from imp_jax.kernels_pallas.metadata import AttentionMetadata
from imp_jax.kernels_pallas.ragged_paged_attention import ragged_paged_attention_pallas, supports
from imp_jax.kernels_pallas.reference import ragged_paged_attention_reference, write_kv

BACKENDS = ("reference", "pallas", "cpu")


def hopper_gpu() -> bool:
    """Whether the default device is a Hopper GPU (compute capability 9.x): the kernel's TMA + wgmma.

    Blackwell (10.x+) dropped wgmma for tcgen05, so it stays on the reference for now.
    """
    if jax.default_backend() != "gpu":
        return False
    try:
        return 9.0 <= float(jax.devices()[0].compute_capability) < 10.0
    except (AttributeError, TypeError, ValueError):
        return False


def attention_backend(q: jax.Array | None = None, k_cache: jax.Array | None = None) -> str:
    """`IMP_JAX_ATTENTION` if set; else the Pallas kernel on a Hopper GPU and the C++ kernel on an
    x86-64 CPU, each where it takes these shapes; else the XLA reference.

    Read at trace time: a function already jitted keeps the backend it was traced with.
    """
    forced = os.environ.get("IMP_JAX_ATTENTION", "").strip().lower()
    if forced and forced not in BACKENDS:
        raise ValueError(f"IMP_JAX_ATTENTION={forced!r}: expected one of {', '.join(BACKENDS)}")
    if forced == "cpu" and not cpu_attention.available():
        raise RuntimeError("IMP_JAX_ATTENTION=cpu, but the CPU attention kernel could not be built "
                           "or does not run on this CPU (see the log); use reference")
    if forced:
        return forced
    shapes = q is not None and k_cache is not None
    if hopper_gpu() and (not shapes or supports(q, k_cache)):
        return "pallas"
    if (jax.default_backend() == "cpu" and (not shapes or cpu_attention.supports(q, k_cache))
            and cpu_attention.available()):
        return "cpu"
    return "reference"


def ragged_paged_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
    meta: AttentionMetadata, layer: jax.Array | int, *, sm_scale: float,
    sliding_window: int | None = None, soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Write k/v [T, KVH, D] at meta.slot_mapping into `layer` of the stacked caches, then attend.

    q: [T, H, D]; caches: [L, num_blocks, block_size, KVH, D]. Returns (out [T, H, D], k_cache, v_cache).
    Pallas off a Hopper GPU (forced by IMP_JAX_ATTENTION=pallas) runs in the Mosaic GPU interpreter;
    the CPU kernel forced on shapes it does not take (IMP_JAX_ATTENTION=cpu) runs the reference.
    """
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer)
    kw = dict(sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap)
    backend = attention_backend(q, k_cache)
    if backend == "pallas":
        out = ragged_paged_attention_pallas(q, k_cache, v_cache, meta, layer, **kw, interpret=not hopper_gpu())
    elif backend == "cpu" and cpu_attention.supports(q, k_cache):
        out = cpu_attention.ragged_paged_attention_cpu(q, k_cache, v_cache, meta, layer, **kw)
    else:
        out = ragged_paged_attention_reference(q, k_cache, v_cache, meta, layer, **kw)
    return out, k_cache, v_cache
