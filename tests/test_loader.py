"""Loading HF directories: sharded safetensors give the same weights as one file."""
from __future__ import annotations

import json

import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from imp_jax.model.formats.loader import load_model


def test_sharded_safetensors_load_like_a_single_file(tiny_hf_dir, tmp_path):
    tensors = load_file(str(tiny_hf_dir / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for f in tiny_hf_dir.iterdir():
        if f.name != "model.safetensors":
            (sharded / f.name).write_bytes(f.read_bytes())
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / shard))
    weight_map = {k: shard for shard, keys in halves.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    one = load_model(tiny_hf_dir, dtype="float32").model
    two = load_model(sharded, dtype="float32").model
    from flax import nnx

    for a, b in zip(jax.tree.leaves(nnx.state(one)), jax.tree.leaves(nnx.state(two)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_bf16_checkpoint_loads_with_bf16_matrices_under_float32(tiny_hf_dir):
    """Saved in bf16 and run in float32 on a CPU with the GEMM kernel: the loader keeps the
    matrices bf16 (exact) and widens the rest, so the values are the checkpoint's."""
    import jax.numpy as jnp
    from ml_dtypes import bfloat16

    path = tiny_hf_dir / "model.safetensors"
    tensors = {k: v.astype(bfloat16) for k, v in load_file(str(path)).items()}
    save_file(tensors, str(path))
    model = load_model(tiny_hf_dir, dtype="float32").model
    kernel = model.options.kernels.reads_narrow_weights
    want = jnp.bfloat16 if kernel else jnp.float32
    assert all(w.dtype == want for ws in model.layers.matrices().values() for w in ws)
    assert model.embed[...].dtype == want
    assert all(v.dtype == jnp.float32 for v in model.layers.vectors().values())
    np.testing.assert_array_equal(np.asarray(model.embed[...], np.float32),
                                  tensors["model.embed_tokens.weight"].astype(np.float32))
