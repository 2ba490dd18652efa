"""What a model family declares in its own file (model/architectures/*.py, as `FAMILY`): its config fields
beyond the common decoder's and how llama.cpp names its GGUF files. model/registry.py collects the
declarations; model/config.py and model/formats/gguf_loader.py read them, so a new family or hyperparameter
needs no edit there."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

# (HF config dict, the common fields parsed from it, its source name) -> ModelConfig field values
ConfigParser = Callable[[Mapping[str, Any], dict[str, Any], str], dict[str, Any]]
# (the GGUF architecture, the file's metadata (formats/gguf_metadata.py), the HF config built so far, the raw
# tensors by GGUF name) -> HF config keys
GGUFConfigReader = Callable[[str, Any, dict[str, Any], Mapping[str, Any]], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class GGUFNames:
    """One llama.cpp architecture of a family: its `general.architecture`, the HF architecture it loads as, its
    metadata keys (`{arch}.KEY`) and the tensor names where they differ from the common decoder's
    (gguf_loader.LAYER_NAMES), and what llama.cpp's converter did to the stored tensors."""

    arch: str
    architecture: str
    experts: bool = False          # the entry for files with `{arch}.expert_count` (a `llama` one is a Mixtral)
    metadata: Mapping[str, str] = dataclasses.field(default_factory=dict)   # `{arch}.KEY` -> HF key, when set
    config: GGUFConfigReader | None = None   # the HF keys plain renames cannot say
    layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)   # GGUF layer leaf -> HF leaf
    bare: tuple[str, ...] = ()     # GGUF leaves whose HF tensor is a bare parameter (llama.cpp adds `.weight`)
    permuted_qk: bool = False      # Q/K rows in llama.cpp's interleaved rotary order (gguf_loader.permute_rotary)
    norm_plus_one: bool = False    # norms stored as HF's weight + 1 (Gemma)
    split_qkv: bool = False        # a fused `attn_qkv` is read as HF's q, k and v projections (row ranges)
    fused_gate_up: bool = False    # without `ffn_gate`, `ffn_up` holds HF's fused gate|up (Phi-3)


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """An image-text architecture whose decoder config is a `text_config` (or, for Qwen2.5-VL, flat beside
    `vision_config`): the defaults that sub-config's own class fills in (saved configs omit them) and the
    text `model_type`s its decoder may have (empty: any)."""

    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    model_types: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Family:
    """A family's declaration: `config`, the ModelConfig (sub)class holding its own fields; `parse`, which reads
    them (and any common field it words otherwise, e.g. Qwen3's q/k norm) from a HF config dict; `gguf`, its
    llama.cpp architectures; `text_configs`, its image-text architectures' decoder configs (model/language_model_config.py)."""

    config: type
    parse: ConfigParser | None = None
    gguf: tuple[GGUFNames, ...] = ()
    text_configs: Mapping[str, TextConfig] = dataclasses.field(default_factory=dict)
