"""Sampling defaults: the request's value, else the model's generation_config.json, else imp's
preset for the model's architecture (docs/API.md "Defaults")."""
from __future__ import annotations

import dataclasses
from typing import Any

from imp_jax.runtime.request import SamplingParams

# imp's preset: a chat request that sets no knob samples the way local models are meant to be run,
# not at temperature 1.0 with no truncation (OpenAI's defaults). A client can always send the
# neutral values (temperature 1, top_p 1, top_k 0, repetition_penalty 1).
PRESET = dict(temperature=0.6, top_p=0.95, top_k=50, min_p=0.0, typical_p=1.0, repetition_penalty=1.05)
# Per architecture family (matched on the lower-cased `architectures[0]` prefix), as imp's presets.
ARCH_PRESETS: dict[str, dict[str, float | int]] = {
    "qwen": dict(top_k=20),
    "gemma": dict(top_p=0.9, top_k=20),
    "gptoss": dict(temperature=1.0, top_p=1.0),
}
# generation_config.json keys that set a default; do_sample=false makes the default greedy.
_GEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty")


def arch_preset(architecture: str) -> dict[str, float | int]:
    """imp's preset for an architecture name such as `Qwen3ForCausalLM`."""
    out = dict(PRESET)
    name = architecture.lower()
    for prefix, override in ARCH_PRESETS.items():
        if name.startswith(prefix):
            out.update(override)
    return out


def model_defaults(generation_config: dict[str, Any], architecture: str = "") -> dict[str, float | int]:
    """The defaults a request without sampling fields gets from this model."""
    out = arch_preset(architecture)
    for key in _GEN_KEYS:
        if generation_config.get(key) is not None:
            out[key] = type(PRESET[key])(generation_config[key])
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def resolve_params(params: SamplingParams, generation_config: dict[str, Any],
                   architecture: str = "") -> SamplingParams:
    """A copy of `params` with every None sampling knob filled from the model's defaults."""
    defaults = model_defaults(generation_config, architecture)
    filled = {k: v for k, v in defaults.items() if getattr(params, k) is None}
    return dataclasses.replace(params, **filled)
