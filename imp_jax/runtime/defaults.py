"""Sampling defaults: the request's value, else the model's generation_config.json, else neutral."""
from __future__ import annotations

import dataclasses
from typing import Any

from imp_jax.runtime.request import SamplingParams

NEUTRAL = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)
# generation_config.json keys that set a default; do_sample=false makes the default greedy.
_GEN_KEYS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "repetition_penalty")


def model_defaults(generation_config: dict[str, Any]) -> dict[str, float | int]:
    """The defaults a request without sampling fields gets from this model."""
    out = dict(NEUTRAL)
    for key in _GEN_KEYS:
        if generation_config.get(key) is not None:
            out[key] = type(NEUTRAL[key])(generation_config[key])
    if generation_config.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def resolve_params(params: SamplingParams, generation_config: dict[str, Any]) -> SamplingParams:
    """A copy of `params` with every None sampling knob filled from the model's defaults."""
    defaults = model_defaults(generation_config)
    filled = {k: v for k, v in defaults.items() if getattr(params, k) is None}
    return dataclasses.replace(params, **filled)
