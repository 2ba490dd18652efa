"""Phi-3 / Phi-3.5 / Phi-4 / Phi-4-mini (`Phi3ForCausalLM`): the Llama decoder under other tensor names.

The math is DecoderLM's (model/architectures/llama.py): RMSNorm, fused q|k|v and gate|up projections, SiLU-gated
MLP, no biases. What differs is handled by the config (model/config.py): `partial_rotary_factor`
(Phi-4-mini rotates the first 3/4 of each head; `layers.apply_rope` passes the rest through),
`longrope` scaling (per-frequency short/long factors and an attention factor on cos/sin, with the
long-or-short choice made once per served context: `ModelConfig.for_context`) and a sliding
window where the config sets one (Phi-3-mini-4k). Phi's checkpoints already store the projections
fused, as `self_attn.qkv_proj` [q | k | v] and `mlp.gate_up_proj` [gate | up], the very layouts
DecoderLM keeps, so they are read as they are: no split and re-join, and a GGUF's quantised
blocks of them stay blocks.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import numpy as np

from imp_jax.model.base import ModelOptions
from imp_jax.model.config import ModelConfig
from imp_jax.model.family import Family, GGUFNames
from imp_jax.model.formats.gguf_metadata import Metadata
from imp_jax.model.architectures.llama import DecoderLM
from imp_jax.model.lora import LoraTarget
from imp_jax.model.weights import WeightSource

# DecoderLM asks for the split names; Phi stores each group fused under one name
_FUSED = {
    ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"): "self_attn.qkv_proj.weight",
    ("mlp.gate_proj.weight", "mlp.up_proj.weight"): "mlp.gate_up_proj.weight",
}
_LAYER = re.compile(r"(model\.layers\.\d+\.)(.+)")


class FusedPhiWeights(WeightSource):
    """A WeightSource that answers a request for a layer's split q/k/v (gate/up) matrices with the
    checkpoint's fused `qkv_proj` (`gate_up_proj`) matrix, which is their concatenation in that
    order; a checkpoint holding the split names is read as it is."""

    def __init__(self, inner: WeightSource):
        super().__init__(inner._tensors, inner.formats, inner.source)

    def matrix(self, *names: str) -> np.ndarray:
        parts = [_LAYER.fullmatch(n) for n in names]
        if all(parts) and len({p[1] for p in parts}) == 1:
            fused = _FUSED.get(tuple(p[2] for p in parts))
            if fused is not None and parts[0][1] + fused in self:
                return super().matrix(parts[0][1] + fused)
        return super().matrix(*names)


class Phi3LM(DecoderLM):
    """`Phi3ForCausalLM`: DecoderLM reading Phi's fused tensor names."""

    def lora_targets(self) -> dict[str, LoraTarget]:
        """PEFT adapters of Phi name its fused modules: `qkv_proj` and `gate_up_proj` are each one
        part spanning the whole projection."""
        c, base = self.config, super().lora_targets()
        E, I = c.hidden_size, c.intermediate_size
        return {"qkv_proj": LoraTarget("qkv_proj", 0, E, c.q_size + 2 * c.kv_size),
                "gate_up_proj": LoraTarget("gate_up_proj", 0, E, 2 * I),
                **{k: base[k] for k in ("o_proj", "down_proj", "lm_head", "embed_tokens")}}

    @classmethod
    def from_hf_tensors(cls, config: ModelConfig, weights: WeightSource,
                        options: ModelOptions = ModelOptions()) -> "Phi3LM":
        return super().from_hf_tensors(config, FusedPhiWeights(weights), options)


# ------------------------------------------------------------------------------------- the family
def _partial_rotary(arch: str, meta: Metadata, cfg: dict[str, Any], raw: Mapping[str, Any]) -> dict[str, Any]:
    """Phi-4-mini rotates `rope.dimension_count` of each head's dims (issue 24)."""
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    return {"partial_rotary_factor": int(rope_dims) / cfg["head_dim"]} if rope_dims else {}


# the config parses as the common decoder's; a GGUF's sliding window (Phi-3-mini-4k), longrope's original
# context, q|k|v fused as HF's Phi3 stores it, and gate|up fused in `ffn_up` where there is no `ffn_gate`
FAMILY = Family(config=ModelConfig, gguf=(GGUFNames(
    "phi3", "Phi3ForCausalLM", config=_partial_rotary, layer_names={"attn_qkv": "self_attn.qkv_proj"},
    fused_gate_up=True, metadata={"attention.sliding_window": "sliding_window",
                                  "rope.scaling.original_context_length": "original_max_position_embeddings"}),))
