"""The decoder's config inside an image-text checkpoint's config.json: its `text_config`, over the defaults
that sub-config's class fills in (saved configs omit them), under the top-level `architectures`. Which
architectures are image-text, and their sub-configs' defaults, each family declares (`Family.text_configs`)."""
from __future__ import annotations

from typing import Any

from imp_jax.errors import ModelLoadError
from imp_jax.model import registry
from imp_jax.model.family import TextConfig


def text_config(architecture: str) -> TextConfig | None:
    """The declaration of an image-text architecture's decoder config (None: not an image-text one)."""
    family = registry.family(architecture)
    return None if family is None else family.text_configs.get(architecture)


def language_model_config(hf: dict[str, Any], archs: list[str], source: str) -> dict[str, Any]:
    """The decoder's config of an image-text checkpoint: its `text_config` over that sub-config's defaults,
    under the top-level `architectures`, top-level bos/eos filling in. Idefics3 / SmolVLM: the text model
    must be a Llama, and the top-level tie_word_embeddings wins (transformers ties the top-level LM head by it).
    Qwen2.5-VL: the hub's configs are flat (the text fields at the top level, beside `vision_config`); either
    level's tie_word_embeddings ties (transformers 5 forwards a pre-v5 text_config's)."""
    qwen = archs[0] == "Qwen2_5_VLForConditionalGeneration"
    text = hf.get("text_config")
    if qwen and text is None:
        text = {k: v for k, v in hf.items() if k != "vision_config"}
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: {archs[0]} without a 'text_config' object")
    declared = text_config(archs[0])
    if declared is None:
        raise ModelLoadError(f"{source}: {archs[0]} is not an image-text architecture")
    allowed = declared.model_types
    if allowed and text.get("model_type", allowed[0]) not in allowed:
        raise ModelLoadError(f"{source}: text model_type {text.get('model_type')!r} is not supported "
                             f"for {archs[0]} (supported: {', '.join(allowed)})")
    top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf}
    tie = ({} if not allowed or "tie_word_embeddings" not in hf
           else {"tie_word_embeddings": hf["tie_word_embeddings"]})
    if qwen:
        tie = {"tie_word_embeddings": bool(hf.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))}
    return {**declared.defaults, **top, **text, **tie, "architectures": archs}
