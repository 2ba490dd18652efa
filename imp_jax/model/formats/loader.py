"""Load a model: open a checkpoint (HF directory, GGUF file, converted directory), then build it
with the options the engine chose. `load_model` does both for one device.

Two steps, because the kernels the engine picks depend on the model's shape (head_dim, dtypes),
which only the opened checkpoint knows, and the weights' storage depends on the kernels.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import (AttentionShape, Kernels, ggml_blocks, ggml_x16, kv_storage_dtype,
                                    select_tested_kernels)
from imp_jax.model.base import ModelOptions, default_layer_loop, takes_embed_rows
from imp_jax.model.config import ModelConfig, read_json
from imp_jax.model.formats.converted import read_converted, restore_model
from imp_jax.model.formats.hub import resolve_model
from imp_jax.model.registry import get_model_class, import_model_class
from imp_jax.model.vision.side import (LoadedVision, VisionCheckpoint, build_vision, describe_vision,
                                       is_vision_language, open_vision, text_tensors)
from imp_jax.model.weights import WeightFormats, WeightSource, describe, interleave_for_q8, narrow_exact_bf16

if TYPE_CHECKING:
    from imp_jax.model.text.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.loader")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    """Everything the engine needs about one model."""

    model: Any                 # an nnx.Module honouring the causal-LM contract (model/base.py)
    config: ModelConfig
    tokenizer: "Tokenizer"
    generation_config: dict[str, Any]
    served_name: str
    path: Path
    dtype: Any
    vision: LoadedVision | None = None   # the image side: set when the model sees images (model/vision/)


@dataclasses.dataclass
class Checkpoint:
    """A model on disk, opened: config, tokenizer and generation defaults read, weights not built."""

    kind: str                                     # "gguf" | "hf_dir" | "converted"
    path: Path
    served_name: str
    config: ModelConfig
    tokenizer: "Tokenizer"
    generation_config: dict[str, Any]
    tensors: Mapping[str, np.ndarray] | None      # HF-named tensors; None for a converted checkpoint
    stored_dtype: str = "float32"                 # a converted checkpoint's array dtype
    quantized: dict[str, str] | None = None       # a converted checkpoint's matrices stored as GGML blocks
    vision: VisionCheckpoint | None = None        # an image-text HF directory's image side

    @property
    def ggml_blocks(self) -> bool:
        """Whether some matrices are stored as GGML blocks the CPU GEMM reads (a quantised GGUF, read from
        its header; a checkpoint converted from one): what `--gemm auto` picks the int8 kernel for."""
        if self.quantized:
            return True
        qtype = getattr(self.tensors, "qtype", None)
        return qtype is not None and any(qtype(name) in ggml_blocks.FORMATS for name in self.tensors)


def resolve_dtype(dtype: str, platform: str = "cpu") -> Any:
    """`auto` is bfloat16 on GPU and float32 elsewhere (bf16 is slower than f32 on XLA CPU)."""
    if dtype == "auto":
        return jnp.bfloat16 if platform == "gpu" else jnp.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"--dtype {dtype!r}: expected auto, float32 or bfloat16") from None


def open_checkpoint(name_or_path: str | Path, mmproj: str | None = None) -> Checkpoint:
    """Resolve `name_or_path` (path or alias; fetched on first use) and read everything but the weights.
    `mmproj`: a llama.cpp vision projector GGUF giving a GGUF text model its image side (model/vision/mmproj.py)."""
    from imp_jax.model.text.tokenizer import Tokenizer

    resolved = resolve_model(str(name_or_path))
    path = resolved.path
    if mmproj is not None and resolved.kind != "gguf":
        what = "an HF directory (which carries its own image side)" if resolved.kind == "hf_dir" else \
            "a converted checkpoint"
        raise ModelLoadError(f"--mmproj {mmproj}: a vision projector pairs with a GGUF text model; {path} is {what}")
    if resolved.kind == "gguf":
        from imp_jax.model.formats.gguf_loader import load_gguf
        gguf = load_gguf(path)
        config = parse_config(lambda: ModelConfig.from_hf(gguf.hf_config, source=str(path)), str(path))
        vision = None
        if mmproj is not None:
            from imp_jax.model.vision.mmproj import open_mmproj
            vision = open_mmproj(mmproj, config.architecture, config.hidden_size, gguf.tokenizer)
        return Checkpoint("gguf", path, resolved.served_name, config, gguf.tokenizer, gguf.generation_config,
                          gguf.tensors, vision=vision)
    if resolved.kind == "converted":
        marker, config = read_converted(path)
        return Checkpoint("converted", path, resolved.served_name, config, Tokenizer.from_hf_dir(path),
                          read_generation_config(path), None, marker["dtype"], marker.get("quantized"))
    config = parse_config(lambda: ModelConfig.from_file(path / "config.json"), str(path / "config.json"))
    tensors: Mapping[str, np.ndarray] = SafetensorsDir(path)
    vision = None
    if is_vision_language(config.architecture):   # the decoder reads e.g. `model.text_model.*` as `model.*`
        vision = open_vision(path, read_json(path / "config.json"), tensors)
        tensors = text_tensors(tensors)
    return Checkpoint("hf_dir", path, resolved.served_name, config, Tokenizer.from_hf_dir(path),
                      read_generation_config(path), tensors, vision=vision)


def build_model(ckpt: Checkpoint, options: ModelOptions, model_class: str | None = None) -> LoadedModel:
    """The model of `ckpt` built with `options`, its matrices stored as `WeightFormats.for_model`
    decides for the options' kernels (logged)."""
    t0 = time.perf_counter()
    log.info("loading %s (%s) as %s", ckpt.path, ckpt.kind, jnp.dtype(options.dtype).name)
    cls = import_model_class(model_class) if model_class else get_model_class(ckpt.config.architecture)
    formats = WeightFormats.for_model(options.kernels, options.dtype)
    if ckpt.tensors is None:
        model = restore_model(cls, ckpt.config, ckpt.path, options, ckpt.stored_dtype, ckpt.quantized,
                              keep_blocks=formats.ggml_blocks)
    else:
        model = build_from_tensors(cls, ckpt.config, WeightSource(ckpt.tensors, formats, str(ckpt.path)), options)
    narrow_exact_bf16(model, formats)
    interleaved = interleave_for_q8(model, options.kernels, options.tensor_parallel)
    if interleaved:
        log.info("q8 GEMM: %d %s matrices interleaved 16 rows at a time for the AVX-512 tiles", interleaved,
                 " / ".join(ggml_x16.OF))
    log.info("weights: %s", describe(model))
    vision = None
    if ckpt.vision is not None and takes_embed_rows(cls):   # a class without the overrides serves text only
        vision = build_vision(ckpt.vision, options.dtype)
        log.info("vision: %s", describe_vision(ckpt.vision.config))
    log.info("loaded %s: %d layers, hidden %d, vocab %d in %.1fs", ckpt.served_name, ckpt.config.num_layers,
             ckpt.config.hidden_size, ckpt.config.vocab_size, time.perf_counter() - t0)
    return LoadedModel(model, ckpt.config, ckpt.tokenizer, ckpt.generation_config, ckpt.served_name,
                       ckpt.path, options.dtype, vision)


def attention_shape(config: ModelConfig, dtype: Any, kv_dtype: Any, block_size: int,
                    platform: str) -> AttentionShape:
    """The attention calls' shape for a model of `config` computing in `dtype` over a KV cache of `kv_dtype`."""
    return AttentionShape(jnp.dtype(dtype), kv_storage_dtype(kv_dtype, platform), config.num_heads,
                          config.num_kv_heads, config.head_dim, block_size, sinks=config.attention_sinks)


def load_model(name_or_path: str | Path, *, dtype: str = "auto", layer_loop: str | None = None,
               model_class: str | None = None, kernels: Kernels | None = None, gemm: str = "auto",
               mmproj: str | None = None) -> LoadedModel:
    """Open and build a model for the default device: `kernels` default to what `select_tested_kernels`
    picks there for `gemm` (the server's --gemm) and a KV cache of the model's dtype, as the engine builder
    does: with `auto`, cpu_q8 for a quantised GGUF on an x86-64 CPU; `exact` gives transformers' products."""
    device = jax.local_devices()[0]
    ckpt = open_checkpoint(name_or_path, mmproj)
    jdtype = resolve_dtype(dtype, device.platform)
    if kernels is None:
        kernels = select_tested_kernels(device, attention_shape(ckpt.config, jdtype, jdtype, 16, device.platform),
                                        gemm=gemm, ggml_blocks=ckpt.ggml_blocks)
    options = ModelOptions(jdtype, layer_loop or default_layer_loop(device.platform), kernels)
    return build_model(ckpt, options, model_class)


def parse_config(parse: Callable[[], ModelConfig], source: str) -> ModelConfig:
    """Run a config parser, turning a value it cannot convert (int("x")) into a ModelLoadError."""
    try:
        return parse()
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{source}: bad value in the model config ({e})") from None


def build_from_tensors(cls: type, config: ModelConfig, weights: WeightSource, options: ModelOptions) -> Any:
    """`cls.from_hf_tensors`, turning a misshapen tensor into a ModelLoadError (a missing one is one already)."""
    try:
        return cls.from_hf_tensors(config, weights, options)
    except ValueError as e:
        raise ModelLoadError(f"{weights.source}: {e}") from None


def read_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json if present and valid, else {}."""
    f = path / "generation_config.json"
    if not f.exists():
        return {}
    gen = read_json(f)
    return gen if isinstance(gen, dict) else {}


def _shard_file(folder: Path, name: Any) -> Path:
    """Weight file `name` (from the index, or found by glob) of model `folder`; a ModelLoadError unless it
    names a file in the folder: no absolute name, no `..` (an index, which may come with a downloaded
    model, must not make the server read files elsewhere). Links the folder itself holds are the
    operator's layout and are followed (a Hugging Face cache snapshot links every file to ../../blobs)."""
    if not isinstance(name, str) or not name or Path(name).is_absolute() or ".." in Path(name).parts:
        raise ModelLoadError(f"{folder}: the index names weight file {str(name)[:200]!r}, not a file name "
                             "inside the model folder")
    shard = folder / name
    if not shard.is_file():
        raise ModelLoadError(f"{shard}: weight file listed in the index is missing")
    return shard


class SafetensorsDir(Mapping[str, np.ndarray]):
    """Lazy float32 view of the tensors in `*.safetensors` files (single file or sharded with an index)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError) as e:
                raise ModelLoadError(f"{index}: malformed index ({e})") from None
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors weight file found")
        self._where: dict[str, Any] = {}
        for name in files:
            shard = _shard_file(path, name)
            try:
                handle = safe_open(str(shard), framework="flax")
            except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
                raise ModelLoadError(f"{shard}: unreadable safetensors file ({e})") from None
            for key in handle.keys():
                self._where[key] = handle

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self._where[name].get_tensor(name), dtype=np.float32)

    def __contains__(self, name: object) -> bool:
        return name in self._where   # without reading the tensor

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
