"""Converted checkpoints: a model's nnx state saved with orbax, plus its config and tokenizer files.

`python -m imp_jax.convert SRC DST [--dtype float32|bfloat16]` turns any loadable model (GGUF, HF dir,
alias) into a directory that loads without dequantising or re-stacking weights:

    DST/imp_jax_checkpoint.json   marker (hub.CONVERTED_MARKER): format, ModelConfig fields, dtype, source
    DST/state/                    orbax checkpoint of the pure dict of `nnx.state(model)`
    DST/tokenizer.json, tokenizer_config.json, generation_config.json   (Tokenizer.from_hf_dir reads them)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from imp_jax.errors import ImpError, ModelLoadError
from imp_jax.kernels_pallas import quant
from imp_jax.model.config import ModelConfig, RopeScaling, read_json
from imp_jax.model.hub import CONVERTED_MARKER
from imp_jax.model.loader import LoadedModel, load_model, read_generation_config, resolve_dtype
from imp_jax.model.registry import get_model_class, import_model_class
from imp_jax.model.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.convert")
FORMAT = "imp_jax.converted"
FORMAT_VERSION = 2   # 2: per-layer [out, in] matrices (1: stacked [L, in, out])
STATE_DIR = "state"
_SCALARS: dict[str, Any] = {"int": int, "float": (int, float), "bool": bool, "str": str}


def convert(src: str | Path, dst: str | Path, *, dtype: str = "float32", model_class: str | None = None,
            overwrite: bool = False) -> Path:
    """Load `src` (path or alias) and write it to `dst` as a converted checkpoint; returns `dst`."""
    dst = Path(dst).expanduser().absolute()
    if dst.is_file():
        raise ImpError(f"{dst}: is a file; the destination must be a directory")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise ImpError(f"{dst}: exists and is not empty (pass --overwrite to replace it)")
        shutil.rmtree(dst)
    loaded = load_model(src, dtype=dtype, model_class=model_class)
    save_converted(loaded, dst, source=str(src))
    return dst


def save_converted(loaded: LoadedModel, dst: Path, *, source: str = "") -> None:
    """Write `loaded` under `dst`; the marker goes last, so a crash never leaves a loadable half-checkpoint."""
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # uncompressed: zstd saves a third of the disk but makes restoring several times slower on CPU
    with ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
        ckptr.save(dst / STATE_DIR, args=ocp.args.PyTreeSave(plain_state(loaded.model, loaded.dtype)))
    write_tokenizer(loaded.tokenizer, dst)
    _write_json(dst / "generation_config.json", _generation_config(loaded))
    cls = type(loaded.model)
    marker = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "architecture": loaded.config.architecture,
        "model_class": f"{cls.__module__}:{cls.__qualname__}",
        "dtype": jnp.dtype(loaded.dtype).name,
        "model_config": dataclasses.asdict(loaded.config),
        "source": source or str(loaded.path),
        "served_name": loaded.served_name,
    }
    _write_json(dst / CONVERTED_MARKER, marker)
    log.info("wrote %s in %.1fs", dst, time.perf_counter() - t0)


def write_tokenizer(tok: Tokenizer, dst: Path) -> None:
    """tokenizer.json + tokenizer_config.json such that `Tokenizer.from_hf_dir(dst)` rebuilds `tok`."""
    (dst / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    templates = tok.chat_templates
    config: dict[str, Any] = {
        "bos_token": tok.bos_token, "eos_token": tok.eos_token,
        "pad_token": tok.pad_token, "unk_token": tok.unk_token,
        "add_bos_token": tok.add_bos, "add_eos_token": tok.add_eos,
    }
    if list(templates) == ["default"]:
        config["chat_template"] = templates["default"]
    elif templates:
        config["chat_template"] = [{"name": n, "template": t} for n, t in templates.items()]
    _write_json(dst / "tokenizer_config.json", config)


def _generation_config(loaded: LoadedModel) -> dict[str, Any]:
    """The source's generation defaults, with every end-of-generation id the tokenizer knows listed."""
    gen = dict(loaded.generation_config)
    eos = gen.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else [eos] if eos is not None else []
    ids += sorted(i for i in loaded.tokenizer.eos_ids if i not in ids)
    if ids:
        gen["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return gen


def load_converted(path: str | Path, *, dtype: Any, layer_loop: str,
                   model_class: str | None = None) -> LoadedModel:
    """Build the model abstractly (no random init) and restore its arrays from `path/state` with orbax."""
    path = Path(path).expanduser().absolute()
    marker = read_marker(path)
    config = _model_config(marker, path)
    cls = import_model_class(model_class) if model_class else get_model_class(config.architecture)
    try:
        model = nnx.eval_shape(lambda: cls(config, dtype=dtype, rngs=nnx.Rngs(0), layer_loop=layer_loop))
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    state = nnx.state(model)
    stored = jnp.dtype(marker["dtype"])
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, stored, sharding=device), pure_state(model))
    if not (path / STATE_DIR).is_dir():
        raise ModelLoadError(f"{path / STATE_DIR}: weights directory missing")
    arrays = restore_arrays(path / STATE_DIR, target)
    # cast as from_hf_tensors does (jnp.asarray of the stored values), so logits match the source bit for bit
    arrays = jax.tree.map(lambda a: a if a.dtype == jnp.dtype(dtype) else a.astype(dtype), arrays)
    nnx.replace_by_pure_dict(state, _int_keys(arrays))
    nnx.update(model, state)
    gen = read_generation_config(path)
    tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(model, config, tokenizer, gen, path.name, path, dtype)


def plain_state(model: Any, dtype: Any) -> dict[str, Any]:
    """`pure_state` with matrices kept as GGML blocks dequantised to `dtype`: a converted checkpoint
    stores plain [out, in] matrices, which load on any platform (the blocks were a CPU choice)."""
    def plain(a: Any) -> Any:
        return quant.dequantize(a).astype(dtype) if quant.format_of(a) else a
    return jax.tree.map(plain, pure_state(model))


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
    """Restore the arrays of `target` (a tree of ShapeDtypeStructs with shardings), checked against what is stored."""
    import orbax.checkpoint as ocp

    restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding, dtype=a.dtype), target)
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
    return marker


def _model_config(marker: dict[str, Any], path: Path) -> ModelConfig:
    """ModelConfig from the marker's fields (written by dataclasses.asdict)."""
    fields = marker.get("model_config")
    if not isinstance(fields, dict):
        raise ModelLoadError(f"{path / CONVERTED_MARKER}: 'model_config' must be an object")
    for f in dataclasses.fields(ModelConfig):
        typ, value = _SCALARS.get(f.type), fields.get(f.name)
        if typ and f.name in fields and (not isinstance(value, typ) or (typ is int and isinstance(value, bool))):
            raise ModelLoadError(f"{path / CONVERTED_MARKER}: model_config '{f.name}' must be {f.type}, "
                                 f"got {value!r}")
    try:
        fields = dict(fields)
        fields["rope_scaling"] = RopeScaling(**fields.get("rope_scaling", {}))
        fields["eos_token_id"] = tuple(fields.get("eos_token_id", ()))
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path / CONVERTED_MARKER}: bad 'model_config' ({e})") from None


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m imp_jax.convert", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="model to convert: .gguf file, HF dir or alias")
    ap.add_argument("dst", help="output directory (created)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="weight dtype stored (float32 keeps a GGUF's dequantised values exactly)")
    ap.add_argument("--model-class", default=None, help="package.module:Class for a user model")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        resolve_dtype(args.dtype)
        dst = convert(args.src, args.dst, dtype=args.dtype, model_class=args.model_class,
                      overwrite=args.overwrite)
    except ImpError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
