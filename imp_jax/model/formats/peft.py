"""Read a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) for a model.

Every check happens here, before a slot is touched: the config (plain LoRA only: no DoRA, no bias
tensors, no modules_to_save), each tensor's module (one the model names in `lora_targets()`: the
decoder layers' projections, `lm_head`, and `embed_tokens` as PEFT's Embedding LoRA, whose
lora_embedding_A [r, vocab] / lora_embedding_B [hidden, r] read as A and B; these two are "layer 0"),
its layer, rank (<= the slabs' max rank), shapes against the model and values (finite, |w| <=
MAX_ABS_WEIGHT). A failure is an AdapterError naming the module. The alpha / r scale (alpha / sqrt(r) with rsLoRA; alpha_pattern and rank_pattern
honoured) is folded into B, so the engine only copies matrices into a slot.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np

from imp_jax.model.lora import LoraTarget

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(model\.layers\.(\d+)\.[a-z_]+\.([a-z_0-9]+))\.lora_([AB])\.weight$")
# the model-wide modules: a Linear LoRA on the LM head, PEFT's Embedding LoRA on the token embedding
_GLOBAL_KEY = re.compile(
    r"^base_model\.model\.((?:model\.)?(lm_head|embed_tokens))\.lora_(?:embedding_)?([AB])(?:\.weight)?$")
# the copies of the frozen base embedding / head PEFT saves beside an adapter on them (save_embedding_layers)
_BASE_COPY = re.compile(r"^base_model\.model\.(?:model\.)?(?:lm_head|embed_tokens)\.base_layer\.weight$")


# Trained LoRA matrices hold values far below 1 (alpha / r folded into B included); one past this is a
# broken or hostile file. Below float16's largest value (65504), so a slab of either type holds it.
MAX_ABS_WEIGHT = 1e4


class AdapterError(ValueError):
    """The adapter cannot be loaded into this model (the message says which file, field or module)."""


@dataclasses.dataclass
class Adapter:
    """An adapter ready for a slot: per (module, layer), A [r, in] and scale * B [out, r] in float32
    (PEFT's layouts, the [out, in] of the model's matrices)."""

    path: Path
    rank: int                                              # the largest module rank
    weights: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]]
    digest: str = ""   # its content fingerprint, set by whoever serves it (runtime/scheduling/lora.py adapter_digest)

    @property
    def modules(self) -> list[str]:
        return sorted({m for m, _ in self.weights})


def read_adapter(path: str | Path, targets: dict[str, LoraTarget], num_layers: int, max_rank: int) -> Adapter:
    """The adapter at `path` (a PEFT directory, or its adapter_model.safetensors), checked against a model
    whose LoRA targets are `targets`; AdapterError when it does not fit."""
    path = Path(path)
    if path.is_file() and path.name == WEIGHTS_FILE:
        path = path.parent
    if not path.is_dir():
        raise AdapterError(f"{path}: no such adapter directory")
    cfg = _read_config(path)
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        other = " (adapter_model.bin is not read: save with safe_serialization=True)" \
            if (path / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{path}: {WEIGHTS_FILE} missing{other}")
    tensors = _read_tensors(weights_file)
    pairs: dict[tuple[str, int], dict[str, np.ndarray]] = {}
    names: dict[tuple[str, int], str] = {}
    for key, value in tensors.items():
        if _BASE_COPY.match(key):
            continue
        m, g = _KEY.match(key), _GLOBAL_KEY.match(key)
        if m is None and g is None:
            raise AdapterError(f"{path}: tensor '{key}' is not a LoRA A/B matrix of a module imp_jax adapts "
                               f"({', '.join(targets)})")
        full, layer, module, ab = (m.group(1), int(m.group(2)), m.group(3), m.group(4)) if m else \
            (g.group(1), 0, g.group(2), g.group(3))
        names[(module, layer)] = full
        if module not in targets:
            raise AdapterError(f"{path}: target module '{module}' ({full}) is not one this model adapts; "
                               f"supported: {', '.join(targets)}")
        if layer >= num_layers:
            raise AdapterError(f"{path}: {full}: the model has {num_layers} layers")
        pairs.setdefault((module, layer), {})[ab] = value
    if not pairs:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA matrices")
    out: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
    rank = 0
    for (module, layer), ab in sorted(pairs.items()):
        full = names[(module, layer)]
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{path}: {full} has lora_{''.join(ab)} without its lora_{'B' if 'A' in ab else 'A'}")
        a, b, t = ab["A"], ab["B"], targets[module]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != r:
            raise AdapterError(f"{path}: {full}: lora_A {list(a.shape)} and lora_B {list(b.shape)} are not a "
                               f"rank-r pair ([r, in] and [out, r])")
        if a.shape[1] != t.in_dim or b.shape[0] != t.out_dim:
            raise AdapterError(f"{path}: shape mismatch in {full}: the adapter maps {a.shape[1]} -> {b.shape[0]}, "
                               f"the model's {module} maps {t.in_dim} -> {t.out_dim} (an adapter for another model?)")
        if r > max_rank:
            raise AdapterError(f"{path}: {full} has rank {r}, above --max-lora-rank {max_rank}")
        alpha = float(_pattern(cfg.get("alpha_pattern"), full, cfg["lora_alpha"]))
        scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        out[(module, layer)] = (a, np.asarray(b * scale, np.float32))
        for ab_name, w in zip(("A", "B"), out[(module, layer)]):
            _check_values(path, f"{full}.lora_{ab_name}", w)
        rank = max(rank, r)
    return Adapter(path, rank, out)


def _check_values(path: Path, tensor: str, w: np.ndarray) -> None:
    """Refuse NaN, infinity and |w| > MAX_ABS_WEIGHT (B scaled by alpha / r): such values make the
    adapter's rows garbage, and where kernels mix slots they must not reach other rows (model/lora.py)."""
    if not np.isfinite(w).all():
        raise AdapterError(f"{path}: {tensor} holds NaN or infinite values")
    peak = float(np.abs(w).max(initial=0.0))
    if peak > MAX_ABS_WEIGHT:
        raise AdapterError(f"{path}: {tensor} holds a value of magnitude {peak:.3g}, past the bound "
                           f"{MAX_ABS_WEIGHT:g} for a LoRA weight (B scaled by alpha / r)")


def _read_config(path: Path) -> dict[str, Any]:
    f = path / CONFIG_FILE
    try:
        cfg = json.loads(f.read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path}: {CONFIG_FILE} missing (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{f}: unreadable ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{f}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{f}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
    refusals = [("use_dora", "DoRA adapters are not supported"), ("fan_in_fan_out", "fan_in_fan_out layers are not supported"),
                ("modules_to_save", "modules_to_save (fully trained extra modules) is not supported")]
    for field, why in refusals:
        if cfg.get(field):
            raise AdapterError(f"{f}: {field} is set: {why}")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{f}: bias {cfg['bias']!r}: adapters with bias tensors are not supported")
    alpha = cfg.get("lora_alpha", cfg.get("r", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"{f}: lora_alpha must be a positive number")
    cfg["lora_alpha"] = alpha
    return cfg


def _pattern(patterns: Any, name: str, default: Any) -> Any:
    """PEFT's per-module override: the first key matching the module's name (as PEFT matches them)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _read_tensors(f: Path) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    try:
        with safe_open(str(f), framework="flax") as h:   # flax reads bfloat16, numpy cannot
            return {k: np.asarray(h.get_tensor(k), np.float32) for k in h.keys()}
    except Exception as e:   # safetensors raises its own errors for a damaged file
        raise AdapterError(f"{f}: unreadable safetensors file ({e})") from None
