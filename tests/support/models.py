"""Tiny models built from HF tensors as this host's engine runs them, and comparing two built models."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from paged import host_kernels

from imp_jax.kernels_pallas import Kernels
from imp_jax.model.base import ModelOptions
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.loader import build_from_tensors
from imp_jax.model.registry import get_model_class
from imp_jax.model.weights import WeightFormats, WeightSource


def build(cfg: ModelConfig, tensors, dtype=jnp.float32, layer_loop: str = "scan",
          formats: WeightFormats = WeightFormats(), *, kernels: Kernels | None = None, **options):
    """The model of `tensors` (its architecture's class) as this host's engine would run it: its kernels
    unless `kernels` are given; `options`: more ModelOptions fields."""
    options = ModelOptions(dtype, layer_loop, kernels or host_kernels(cfg, dtype), **options)
    return build_from_tensors(get_model_class(cfg.architecture), cfg, WeightSource(tensors, formats), options)


def same_params(a, b) -> None:
    """Two models hold the same parameters: one tree, equal dtypes and bits."""
    pa, pb = nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b))
    assert jax.tree.structure(pa) == jax.tree.structure(pb)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
