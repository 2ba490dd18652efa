"""Load a model from a HF directory, a GGUF file or a converted checkpoint into a ready DecoderLM."""
from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import quant
from imp_jax.model.config import ModelConfig, read_json
from imp_jax.model.registry import get_model_class, import_model_class

if TYPE_CHECKING:
    from imp_jax.model.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.loader")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass
class LoadedModel:
    """Everything the engine needs about one model."""

    model: Any                 # an nnx.Module honouring the causal-LM contract
    config: ModelConfig
    tokenizer: "Tokenizer"
    generation_config: dict[str, Any]
    served_name: str
    path: Path
    dtype: Any


def resolve_dtype(dtype: str) -> Any:
    """`auto` is bfloat16 on GPU and float32 elsewhere (bf16 is slower than f32 on XLA CPU)."""
    if dtype == "auto":
        return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"--dtype {dtype!r}: expected auto, float32 or bfloat16") from None


def default_layer_loop() -> str:
    """The layer loop form used unless asked otherwise (see docs/PERF.md for the measurement)."""
    return "scan"


def load_model(name_or_path: str | Path, *, dtype: str = "auto", layer_loop: str | None = None,
               model_class: str | None = None) -> LoadedModel:
    """Resolve `name_or_path` (path or alias) and build the model, tokenizer and configs."""
    from imp_jax.model.hub import resolve_model  # late: hub shells out to pip only for aliases

    resolved = resolve_model(str(name_or_path))
    jdtype = resolve_dtype(dtype)
    layer_loop = layer_loop or default_layer_loop()
    t0 = time.perf_counter()
    log.info("loading %s (%s) as %s", resolved.path, resolved.kind, jnp.dtype(jdtype).name)
    if resolved.kind == "converted":
        from imp_jax.convert import load_converted
        loaded = load_converted(resolved.path, dtype=jdtype, layer_loop=layer_loop, model_class=model_class)
        loaded.served_name = resolved.served_name
    else:
        if resolved.kind == "gguf":
            from imp_jax.model.gguf_loader import load_gguf
            ckpt = load_gguf(resolved.path)
            hf_config, tensors, tokenizer, gen = ckpt.hf_config, ckpt.tensors, ckpt.tokenizer, ckpt.generation_config
            config = parse_config(lambda: ModelConfig.from_hf(hf_config, source=str(resolved.path)),
                                  str(resolved.path))
        else:
            config = parse_config(lambda: ModelConfig.from_file(resolved.path / "config.json"),
                                  str(resolved.path / "config.json"))
            tensors = SafetensorsDir(resolved.path)
            from imp_jax.model.tokenizer import Tokenizer
            tokenizer = Tokenizer.from_hf_dir(resolved.path)
            gen = read_generation_config(resolved.path)
        cls = import_model_class(model_class) if model_class else get_model_class(config.architecture)
        model = build_from_tensors(cls, config, tensors, jdtype, layer_loop, str(resolved.path))
        loaded = LoadedModel(model, config, tokenizer, gen, resolved.served_name, resolved.path, jdtype)
    keep = getattr(loaded.model, "keep_exact_bf16", None)   # optional for a model class
    if keep is not None:
        keep()
    log.info("weights: %s", describe_weights(loaded.model))
    log.info("loaded %s: %d layers, hidden %d, vocab %d in %.1fs", loaded.served_name,
             loaded.config.num_layers, loaded.config.hidden_size, loaded.config.vocab_size,
             time.perf_counter() - t0)
    return loaded


def describe_weights(model: Any) -> str:
    """One line for the log: the weights' MiB and how many arrays of each storage format."""
    arrays = jax.tree.leaves(nnx.state(model))
    formats = Counter(quant.format_of(a) or jnp.dtype(a.dtype).name for a in arrays)
    mib = sum(a.nbytes for a in arrays) / 2**20
    return f"{mib:.0f} MiB in " + ", ".join(f"{n} {f}" for f, n in formats.most_common())


def parse_config(parse: Callable[[], ModelConfig], source: str) -> ModelConfig:
    """Run a config parser, turning a value it cannot convert (int("x")) into a ModelLoadError."""
    try:
        return parse()
    except (TypeError, ValueError, AttributeError) as e:
        raise ModelLoadError(f"{source}: bad value in the model config ({e})") from None


def build_from_tensors(cls: type, config: ModelConfig, tensors: Mapping[str, np.ndarray],
                       dtype: Any, layer_loop: str, source: str) -> Any:
    """Instantiate `cls` from HF-named tensors, turning a missing or misshapen tensor into ModelLoadError."""
    def get(name: str) -> np.ndarray:
        try:
            return tensors[name]
        except KeyError:
            raise ModelLoadError(f"{source}: weight '{name}' not found") from None
    extra = {}
    if hasattr(tensors, "blocks") and "blocks" in inspect.signature(cls.from_hf_tensors).parameters:
        def blocks(name: str) -> np.ndarray | None:
            return tensors.blocks(name) if name in tensors else None   # a missing one: get() says so
        extra["blocks"] = blocks
    try:
        return cls.from_hf_tensors(config, get, dtype=dtype, layer_loop=layer_loop, **extra)
    except ValueError as e:
        raise ModelLoadError(f"{source}: {e}") from None


def read_generation_config(path: Path) -> dict[str, Any]:
    """generation_config.json if present and valid, else {}."""
    f = path / "generation_config.json"
    if not f.exists():
        return {}
    gen = read_json(f)
    return gen if isinstance(gen, dict) else {}


class SafetensorsDir(Mapping[str, np.ndarray]):
    """Lazy float32 view of the tensors in `*.safetensors` files (single file or sharded with an index)."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ModelLoadError(f"{index}: malformed index ({e})") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{path}: no *.safetensors weight file found")
        self._where: dict[str, Any] = {}
        for name in files:
            if not (path / name).exists():
                raise ModelLoadError(f"{path / name}: weight file listed in the index is missing")
            try:
                handle = safe_open(str(path / name), framework="flax")
            except Exception as e:  # SafetensorError, OSError: a truncated or foreign file
                raise ModelLoadError(f"{path / name}: unreadable safetensors file ({e})") from None
            for key in handle.keys():
                self._where[key] = handle

    def __getitem__(self, name: str) -> np.ndarray:
        return np.asarray(self._where[name].get_tensor(name), dtype=np.float32)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
