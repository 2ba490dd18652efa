"""x @ w.T in plain XLA, for weights in [out, in] layout (plain, or GGML blocks dequantised first)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from imp_jax.kernels_pallas import ggml_blocks


def matmul_wt_xla(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w.T for w [N, K], accumulated and returned in float32."""
    if ggml_blocks.format_of(w) is not None:
        # the values a load-time dequantisation stores for a model of x's dtype: float32, rounded once
        w = ggml_blocks.dequantize(w).astype(x.dtype if jnp.issubdtype(x.dtype, jnp.floating) else jnp.float32)
    dtype = jnp.promote_types(x.dtype, w.dtype)   # float32 x with bf16 w: w widened, exactly
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), (((x.ndim - 1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
