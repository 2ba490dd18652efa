"""Converted checkpoints, the reading side: a model's nnx state saved with orbax, plus its config
and tokenizer files (written by `python -m imp_jax.convert`, imp_jax/convert.py).

    DST/imp_jax_checkpoint.json   marker (hub.CONVERTED_MARKER): format, ModelConfig fields, dtype, source
    DST/state/                    orbax checkpoint of the pure dict of `nnx.state(model)`
    DST/tokenizer.json, tokenizer_config.json, generation_config.json   (Tokenizer.from_hf_dir reads them)
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.model.config import ModelConfig, RopeScaling, config_class, read_json
from imp_jax.model.formats.hub import CONVERTED_MARKER

FORMAT = "imp_jax.converted"
FORMAT_VERSION = 2   # 2: per-layer [out, in] matrices (1: stacked [L, in, out])
STATE_DIR = "state"
_SCALARS: dict[str, Any] = {"int": int, "float": (int, float), "bool": bool, "str": str}


def read_converted(path: Path) -> tuple[dict[str, Any], ModelConfig]:
    """The marker of a converted directory, checked, and the ModelConfig it records."""
    marker = read_marker(path)
    return marker, _model_config(marker, path)


def restore_model(cls: type, config: ModelConfig, path: Path, options: Any, stored_dtype: str,
                  quantized: dict[str, str] | None = None, keep_blocks: bool = False) -> Any:
    """Build `cls` abstractly (no random init) and fill it with the arrays under `path/state`, cast
    to the model's dtype as `from_hf_tensors` casts (so logits match the source bit for bit). The
    matrices `quantized` names ({leaf path: GGML format}, `convert --quantize`) are stored as blocks:
    kept so when `keep_blocks`, else dequantised. The arrays come back on the host; the engine places
    them on its devices."""
    try:
        model = nnx.eval_shape(lambda: cls(config, options, rngs=nnx.Rngs(0)))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    if not (path / STATE_DIR).is_dir():
        raise ModelLoadError(f"{path / STATE_DIR}: weights directory missing")
    stored, quantized = jnp.dtype(stored_dtype), quantized or {}

    def spec(key: Any, a: Any) -> jax.ShapeDtypeStruct:
        fmt = quantized.get(matrix_path(key))
        if fmt is None:
            return jax.ShapeDtypeStruct(a.shape, stored)
        n, k = a.shape
        return jax.ShapeDtypeStruct((n, k // ggml_blocks.WEIGHTS[fmt], ggml_blocks.FORMATS[fmt]), jnp.uint8)

    def value(key: Any, a: np.ndarray) -> Any:
        if matrix_path(key) not in quantized:
            return jnp.asarray(a, options.dtype)
        return a if keep_blocks else ggml_blocks.dequantize(jnp.asarray(a)).astype(options.dtype)

    target = jax.tree_util.tree_map_with_path(spec, pure_state(model))
    arrays = restore_arrays(path / STATE_DIR, target)
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, _int_keys(jax.tree_util.tree_map_with_path(value, arrays)))
    nnx.update(model, state)
    return model


def matrix_path(key: Any) -> str:
    """A leaf's path in `pure_state` as the marker's "quantized" map names it: "layers/qkv_proj/0"."""
    parts = [getattr(k, "key", k) for k in key]
    return "/".join(str(p) for p in parts)


def matrix_paths(model: Any) -> list[str]:
    """The `pure_state` paths of the model's `Matrix` parameters (the projections `convert --quantize`
    stores as blocks)."""
    from imp_jax.model.weights import Matrix

    def strings(t: Any) -> Any:
        return {str(k): strings(v) for k, v in t.items()} if isinstance(t, dict) else t
    tree = strings(nnx.to_pure_dict(nnx.state(model, Matrix)))
    return [matrix_path(k) for k, _ in jax.tree_util.tree_leaves_with_path(tree)]


def pure_state(model: Any) -> dict[str, Any]:
    """The model's arrays as nested dicts with string keys (per-layer lists are stored as "0", "1", ...)."""
    def strings(t: Any) -> Any:
        return {str(k): strings(v) for k, v in t.items()} if isinstance(t, dict) else t
    return strings(nnx.to_pure_dict(nnx.state(model)))


def _int_keys(t: Any) -> Any:
    """Undo `pure_state`'s string keys for list indices, as nnx.replace_by_pure_dict expects."""
    if not isinstance(t, dict):
        return t
    return {int(k) if isinstance(k, str) and k.isdigit() else k: _int_keys(v) for k, v in t.items()}


def restore_arrays(state_dir: Path, target: Any) -> Any:
    """Restore the arrays of `target` (a tree of ShapeDtypeStructs) as host numpy arrays, checked
    against what is stored."""
    import orbax.checkpoint as ocp

    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype), target)
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(state_dir)
            _check_stored(getattr(meta, "item_metadata", None), target, state_dir)
            return ckptr.restore(state_dir, args=ocp.args.PyTreeRestore(target, restore_args=restore_args))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelLoadError(f"{state_dir}: cannot restore the weights "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None


def _check_stored(stored: Any, target: Any, state_dir: Path) -> None:
    """Every parameter the model expects is stored with its shape (a mismatch would fail deep inside orbax)."""
    tree = getattr(stored, "tree", None)
    if not isinstance(tree, dict):
        raise ModelLoadError(f"{state_dir}: no readable checkpoint metadata")

    def shapes(t: Any) -> dict[str, tuple[int, ...]]:
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in jax.tree_util.tree_leaves_with_path(t)}
    have, want = shapes(tree), shapes(target)
    problems = [f"{k} missing" for k in want if k not in have]
    problems += [f"{k} stored {have[k]}, model expects {want[k]}"
                 for k in want if k in have and have[k] != want[k]]
    problems += [f"{k} not used by the model" for k in have if k not in want]
    if problems:
        raise ModelLoadError(f"{state_dir}: weights do not fit the model ({'; '.join(problems[:4])})")


def read_marker(path: Path) -> dict[str, Any]:
    """The parsed imp_jax_checkpoint.json of a converted directory, checked for format and version."""
    f = path / CONVERTED_MARKER
    try:
        marker = read_json(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{f}: not found (not a converted checkpoint)") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise ModelLoadError(f"{f}: not an imp_jax converted checkpoint marker")
    if marker.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{f}: format version {marker.get('format_version')!r} is not supported "
                             f"(this imp_jax reads version {FORMAT_VERSION}); convert the model again")
    if marker.get("dtype") not in ("float32", "bfloat16"):
        raise ModelLoadError(f"{f}: 'dtype' must be float32 or bfloat16, got {marker.get('dtype')!r}")
    quantized = marker.get("quantized", {})
    if not isinstance(quantized, dict) or any(
            not isinstance(k, str) or v not in ggml_blocks.FORMATS for k, v in quantized.items()):
        raise ModelLoadError(f"{f}: 'quantized' must map matrix paths to GGML block formats "
                             f"({', '.join(ggml_blocks.FORMATS)})")
    return marker


def _model_config(marker: dict[str, Any], path: Path) -> ModelConfig:
    """ModelConfig (its family's subclass) from the marker's fields (written by dataclasses.asdict); the fields of
    other families, which markers of an older imp_jax list, are left out."""
    fields = marker.get("model_config")
    if not isinstance(fields, dict):
        raise ModelLoadError(f"{path / CONVERTED_MARKER}: 'model_config' must be an object")
    cls = config_class(str(fields.get("architecture")))
    for f in dataclasses.fields(cls):
        typ, value = _SCALARS.get(f.type), fields.get(f.name)
        if typ and f.name in fields and (not isinstance(value, typ) or (typ is int and isinstance(value, bool))):
            raise ModelLoadError(f"{path / CONVERTED_MARKER}: model_config '{f.name}' must be {f.type}, "
                                 f"got {value!r}")
    try:
        fields = {f.name: fields[f.name] for f in dataclasses.fields(cls) if f.name in fields}
        fields["rope_scaling"] = RopeScaling(**fields.get("rope_scaling", {}))
        fields["eos_token_id"] = tuple(fields.get("eos_token_id", ()))
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path / CONVERTED_MARKER}: bad 'model_config' ({e})") from None


