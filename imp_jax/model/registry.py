"""Model registry: HF `architectures` names -> causal LM classes, as a static table of import paths
(and user classes by `--model-class package.module:Class`); each class's module declares its family
(`FAMILY`, model/family.py), which `family` and `families` collect."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from imp_jax.errors import ModelLoadError

if TYPE_CHECKING:
    from imp_jax.model.family import Family

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "imp_jax.model.architectures.llama:DecoderLM",
    "MistralForCausalLM": "imp_jax.model.architectures.llama:DecoderLM",
    "Qwen2ForCausalLM": "imp_jax.model.architectures.llama:DecoderLM",
    "Qwen3ForCausalLM": "imp_jax.model.architectures.llama:DecoderLM",
    "Phi3ForCausalLM": "imp_jax.model.architectures.phi3:Phi3LM",   # Phi-3, Phi-3.5-mini, Phi-4, Phi-4-mini
    "Gemma2ForCausalLM": "imp_jax.model.architectures.gemma:GemmaLM",
    "Gemma3ForCausalLM": "imp_jax.model.architectures.gemma:GemmaLM",
    "Gemma3ForConditionalGeneration": "imp_jax.model.architectures.gemma:GemmaLM",   # images: model/vision/gemma3.py
    # image-text: the Llama decoder, images as embedding overrides (model/vision/side.py)
    "Idefics3ForConditionalGeneration": "imp_jax.model.architectures.llama:DecoderLM",
    "SmolVLMForConditionalGeneration": "imp_jax.model.architectures.llama:DecoderLM",
    "Qwen2_5_VLForConditionalGeneration": "imp_jax.model.architectures.llama:DecoderLM",   # Qwen2 with M-RoPE (positions [3, T])
    # mixture of experts (model/architectures/moe.py)
    "MixtralForCausalLM": "imp_jax.model.architectures.moe:MoELM",
    "Qwen2MoeForCausalLM": "imp_jax.model.architectures.moe:MoELM",
    "Qwen3MoeForCausalLM": "imp_jax.model.architectures.moe:MoELM",
    "GptOssForCausalLM": "imp_jax.model.architectures.gpt_oss:GptOssLM",   # attention sinks, MXFP4 experts dequantised
}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def get_model_class(architecture: str) -> type:
    """The class serving an HF architecture name, or a ModelLoadError listing what is supported."""
    spec = ARCHITECTURES.get(architecture)
    if spec is None:
        raise ModelLoadError(f"unknown architecture '{architecture}' (supported: "
                             f"{', '.join(supported_architectures())}; or pass --model-class "
                             f"package.module:Class)", code="unknown_architecture")
    return import_model_class(spec)


def family(architecture: str) -> Family | None:
    """The declaration of the family serving an HF architecture name (None: not a registered one)."""
    spec = ARCHITECTURES.get(architecture)
    return None if spec is None else _family(spec.partition(":")[0])


def families() -> tuple[Family, ...]:
    """Every registered family's declaration, in the table's order."""
    return tuple(_family(m) for m in dict.fromkeys(spec.partition(":")[0] for spec in ARCHITECTURES.values()))


def _family(module_name: str) -> Family:
    return importlib.import_module(module_name).FAMILY


def import_model_class(spec: str) -> type:
    """Load a model class from 'package.module:Class'."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelLoadError(f"--model-class {spec!r}: expected 'package.module:Class'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"--model-class {spec!r}: {e}") from None
