"""`python -m imp_jax.convert SRC DST [--dtype float32|bfloat16] [--quantize int8|int4]`: write any
loadable model (GGUF, HF dir, alias) as a converted checkpoint, a directory that loads without
dequantising or re-stacking weights. The format, and the reader the loader uses, are in
imp_jax/model/formats/converted.py.

`--quantize` stores every projection matrix (embedding and LM head included) weight-only quantised
per group of 32 input weights, as GGML blocks: int8 = Q8_0 (an f16 scale per group, symmetric), int4
= Q4_1 (an f16 scale and f16 minimum per group, asymmetric, as GPTQ/AWQ-style int4 with zero points).
The loader keeps them as blocks where the backend reads blocks (the CPU GEMM kernel; XLA's dot on a
GPU, dequantising each matrix inside the step) and dequantises them at load elsewhere.
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
import numpy as np

from imp_jax.errors import ImpError
from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.model.formats.converted import FORMAT, FORMAT_VERSION, STATE_DIR, matrix_path, matrix_paths, pure_state
from imp_jax.model.formats.hub import CONVERTED_MARKER
from imp_jax.model.formats.loader import LoadedModel, load_model, resolve_dtype
from imp_jax.model.text.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.convert")


QUANTIZE = {"int8": "Q8_0", "int4": "Q4_1"}   # --quantize -> the GGML block format stored


def convert(src: str | Path, dst: str | Path, *, dtype: str = "float32", model_class: str | None = None,
            overwrite: bool = False, quantize: str | None = None) -> Path:
    """Load `src` (path or alias) and write it to `dst` as a converted checkpoint; returns `dst`."""
    dst = Path(dst).expanduser().absolute()
    if dst.is_file():
        raise ImpError(f"{dst}: is a file; the destination must be a directory")
    if dst.exists() and any(dst.iterdir()):
        if not overwrite:
            raise ImpError(f"{dst}: exists and is not empty (pass --overwrite to replace it)")
        shutil.rmtree(dst)
    if quantize is not None and quantize not in QUANTIZE:
        raise ImpError(f"--quantize {quantize!r}: expected one of {', '.join(QUANTIZE)}")
    loaded = load_model(src, dtype=dtype, model_class=model_class)
    save_converted(loaded, dst, source=str(src), quantize=quantize)
    return dst


def save_converted(loaded: LoadedModel, dst: Path, *, source: str = "", quantize: str | None = None) -> None:
    """Write `loaded` under `dst` (its matrices quantised per `quantize`: QUANTIZE); the marker goes
    last, so a crash never leaves a loadable half-checkpoint."""
    import orbax.checkpoint as ocp

    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    state = plain_state(loaded.model, loaded.dtype)
    quantized = quantize_matrices(loaded.model, state, QUANTIZE[quantize]) if quantize else {}
    # uncompressed: zstd saves a third of the disk but makes restoring several times slower on CPU
    with ocp.PyTreeCheckpointer(use_compression=False) as ckptr:
        ckptr.save(dst / STATE_DIR, args=ocp.args.PyTreeSave(state))
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
    if quantized:
        marker["quantized"] = quantized
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


def plain_state(model: Any, dtype: Any) -> dict[str, Any]:
    """`pure_state` with matrices kept as GGML blocks dequantised to `dtype`: a converted checkpoint
    stores plain [out, in] matrices, which load on any platform (the blocks were a CPU choice)."""
    def plain(a: Any) -> Any:
        return ggml_blocks.dequantize(a).astype(dtype) if ggml_blocks.format_of(a) else a
    return jax.tree.map(plain, pure_state(model))


def quantize_matrices(model: Any, state: dict[str, Any], fmt: str) -> dict[str, str]:
    """Replace, in `state` (plain_state), each 2-D `Matrix` whose rows are whole groups of 32 with its
    `fmt` blocks [N, K / 32, bytes] (gguf-py's quantisation of its float32 values); returns
    {leaf path: fmt} for the marker. Other matrices (a row length not a multiple of 32, stacked MoE
    experts) stay as they are."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    out: dict[str, str] = {}
    qtype = GGMLQuantizationType[fmt]

    def visit(tree: dict[str, Any], prefix: tuple[str, ...]) -> None:
        for key, value in tree.items():
            path = (*prefix, key)
            if isinstance(value, dict):
                visit(value, path)
            elif matrix_path(path) in matrices and np.ndim(value) == 2 and np.shape(value)[1] % ggml_blocks.BLOCK == 0:
                x = np.asarray(value, np.float32)
                tree[key] = gguf_quantize(x, qtype).reshape(x.shape[0], -1, ggml_blocks.FORMATS[fmt])
                out[matrix_path(path)] = fmt

    matrices = set(matrix_paths(model))
    visit(state, ())
    log.info("quantised %d matrices to %s", len(out), fmt)
    return out


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m imp_jax.convert", description=__doc__.splitlines()[0])
    ap.add_argument("src", help="model to convert: .gguf file, HF dir or alias")
    ap.add_argument("dst", help="output directory (created)")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                    help="weight dtype stored (float32 keeps a GGUF's dequantised values exactly)")
    ap.add_argument("--quantize", default=None, choices=sorted(QUANTIZE),
                    help="store the projection matrices weight-only quantised per 32-weight group: int8 "
                         "(Q8_0 blocks) or int4 (Q4_1 blocks, scale + minimum)")
    ap.add_argument("--model-class", default=None, help="package.module:Class for a user model")
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        resolve_dtype(args.dtype)
        dst = convert(args.src, args.dst, dtype=args.dtype, model_class=args.model_class,
                      overwrite=args.overwrite, quantize=args.quantize)
    except ImpError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(dst)
    return 0


if __name__ == "__main__":
    sys.exit(main())
