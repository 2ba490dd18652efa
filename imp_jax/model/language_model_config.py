"""The decoder's config inside an image-text checkpoint's config.json: its `text_config`, over the defaults
that sub-config's class fills in (saved configs omit them), under the top-level `architectures`."""
from __future__ import annotations

from typing import Any

from imp_jax.errors import ModelLoadError

# Gemma3TextConfig's defaults, which a multimodal Gemma 3's `text_config` relies on (it omits them)
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6, max_position_embeddings=131072,
    query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1e6, rope_local_base_freq=1e4,
    bos_token_id=2, eos_token_id=1)

# Image-text architectures whose decoder `text_config` describes, and that sub-config's own defaults
# (Idefics3Config builds its Llama text config with rms_norm_eps 1e-5)
TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "Gemma3ForConditionalGeneration": GEMMA3_TEXT_DEFAULTS,
    "Idefics3ForConditionalGeneration": {"rms_norm_eps": 1e-5},
    "SmolVLMForConditionalGeneration": {"rms_norm_eps": 1e-5},
    "Qwen2_5_VLForConditionalGeneration": {"rms_norm_eps": 1e-5},   # Qwen2_5_VLTextConfig's
}
# the text model_types each image-text architecture's decoder may have (absent: any)
TEXT_MODEL_TYPES: dict[str, tuple[str, ...]] = {
    "Idefics3ForConditionalGeneration": ("llama",), "SmolVLMForConditionalGeneration": ("llama",),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl_text", "qwen2_5_vl"),
}


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
    allowed = TEXT_MODEL_TYPES.get(archs[0])
    if allowed and text.get("model_type", allowed[0]) not in allowed:
        raise ModelLoadError(f"{source}: text model_type {text.get('model_type')!r} is not supported "
                             f"for {archs[0]} (supported: {', '.join(allowed)})")
    top = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in hf}
    tie = ({} if allowed is None or "tie_word_embeddings" not in hf
           else {"tie_word_embeddings": hf["tie_word_embeddings"]})
    if qwen:
        tie = {"tie_word_embeddings": bool(hf.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))}
    return {**TEXT_CONFIG_DEFAULTS[archs[0]], **top, **text, **tie, "architectures": archs}
