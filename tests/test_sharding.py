"""Ready to shard: every parameter and the KV cache name their axes, and the step's shardings come
from those names (here on one device, so every sharding is whole; several devices:
test_tensor_parallel.py)."""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from imp_jax.model.base import AXES, KV_CACHE_AXES
from imp_jax.runtime.parallel.sharding import RULES, TP, default_mesh, kv_sharding, partition_spec, state_shardings


def test_logical_names_map_onto_the_tp_axis_and_trailing_axes_stay_whole():
    assert partition_spec(("vocab", "embed"), 2) == P(TP, None)
    assert partition_spec(("embed", "mlp"), 3) == P(None, TP, None)        # GGML blocks: [N, K/32, bytes]
    assert partition_spec(None, 1) == P(None)
    assert partition_spec(KV_CACHE_AXES, 5) == P(None, None, None, TP, None)
    assert set(RULES) <= set(AXES)


def test_every_parameter_of_the_decoder_names_its_axes(smollm2_loaded):
    """What tensor parallelism needs: no parameter without names, every name a known one, and the
    shardings built from them cover the state (here on one device)."""
    state = nnx.state(smollm2_loaded.model)
    variables = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    for v in variables:
        axes = v.get_metadata().get("axes")
        assert axes is not None and set(axes) - {None} <= set(AXES), (v, axes)
        assert len(axes) <= v.get_value().ndim
    mesh = default_mesh()
    shardings = jax.tree.leaves(state_shardings(state, mesh))
    assert len(shardings) == len(variables)
    assert all(s.mesh == mesh for s in shardings) and kv_sharding(mesh).spec[3] == TP


def test_the_engine_step_runs_on_its_mesh(smollm2_loaded):
    """The compiled step places the state and the KV cache with the shardings it was given."""
    from imp_jax.runtime.execution.step import CompiledStep, StepShapes

    mesh = default_mesh()
    kv_shape = smollm2_loaded.model.kv_cache_shape(4, 16)
    kv = tuple(np.zeros(kv_shape, np.float32) for _ in range(2))
    step = CompiledStep(smollm2_loaded.model, kv, StepShapes(max_blocks=2, vocab_size=49152), [(1, 1)], mesh)
    assert all(x.sharding.spec == kv_sharding(mesh).spec for x in step.kv)
    embed = step.state["embed"].get_value()
    assert embed.sharding.mesh == mesh and embed.sharding.spec == P(TP, None, None)   # Q8_0 blocks
