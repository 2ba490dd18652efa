"""Model configuration: one dataclass for the decoder family, parsed from HF config.json dicts."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from imp_jax.errors import ModelLoadError

ROPE_TYPES = ("default", "linear", "llama3")
QKV_BIAS_ARCHS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")   # q/k/v biases unless the config says otherwise
QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
ROUTERS = ("softmax_topk", "topk_softmax")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`: `linear` divides positions by `factor`; `llama3` rescales low frequencies."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama, Mistral, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False              # RMSNorm on q and k per head before RoPE (Qwen3)
    sliding_window: int | None = None  # attend to at most this many previous tokens (Mistral)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    # --- mixture of experts (model/moe.py: Mixtral, Qwen2-MoE, Qwen3-MoE). The defaults (no experts)
    # leave every dense family as it was.
    num_experts: int = 0                      # routed experts per sparse layer; 0: a dense model
    num_experts_per_tok: int = 0              # top-k
    moe_intermediate_size: int = 0            # each routed expert's; 0: intermediate_size (Mixtral)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    norm_topk_prob: bool = False              # renormalise the k kept probabilities to sum to 1
    router: str = "softmax_topk"              # "softmax_topk" or "topk_softmax" (softmax of the k logits)
    decoder_sparse_step: int = 1              # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()     # ... and i is not listed here (dense MLP of intermediate_size)

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer i routes over experts (transformers' Qwen2-MoE rule; every layer for Mixtral)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [head_dim // 2] with the configured scaling applied (float64)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = self.rope_scaling
        if rs.rope_type == "linear":
            inv = inv / rs.factor
        elif rs.rope_type == "llama3":
            low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
            high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
            wavelen = 2 * np.pi / inv
            smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
                rs.high_freq_factor - rs.low_freq_factor)
            mid = (1 - smooth) * inv / rs.factor + smooth * inv
            inv = np.where(wavelen > low_wavelen, inv / rs.factor,
                           np.where(wavelen < high_wavelen, inv, mid))
        return inv

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parse a HF config.json dict; a missing or ill-typed field is a ModelLoadError naming it."""
        if not isinstance(hf, dict):
            raise ModelLoadError(f"{source}: expected a JSON object")
        archs = hf.get("architectures")
        if not isinstance(archs, list) or not archs or not isinstance(archs[0], str):
            raise ModelLoadError(f"{source}: 'architectures' must be a non-empty list of names")

        def need(key: str, typ: type = int) -> Any:
            if key not in hf or hf[key] is None:
                raise ModelLoadError(f"{source}: missing '{key}'")
            try:
                return typ(hf[key])
            except (TypeError, ValueError):
                raise ModelLoadError(f"{source}: '{key}' must be {typ.__name__}, got {hf[key]!r}") from None

        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        if num_heads % kv_heads:
            raise ModelLoadError(f"{source}: num_attention_heads {num_heads} is not a multiple of "
                                 f"num_key_value_heads {kv_heads}")
        eos = hf.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos] if eos is not None else []))
        arch = archs[0]
        window = hf.get("sliding_window")
        if arch.startswith("Qwen") and not hf.get("use_sliding_window", False):
            window = None  # Qwen configs carry a window they do not use
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))),
            rope_scaling=_parse_rope_scaling(hf.get("rope_scaling") or hf.get("rope_parameters"), source),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", hf.get("qkv_bias", arch in QKV_BIAS_ARCHS))),
            qk_norm=arch in QK_NORM_ARCHS,
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
            **_moe_fields(hf, arch, source),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read and parse a config.json file."""
        path = Path(path)
        try:
            hf = read_json(path)
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: config.json not found") from None
        return cls.from_hf(hf, source=str(path))


def read_json(path: Path) -> Any:
    """A JSON file's content; malformed content is a ModelLoadError naming the file (absence raises FileNotFoundError)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON ({e})") from None


def _parse_rope_scaling(rs: dict[str, Any] | None, source: str) -> RopeScaling:
    if not rs:
        return RopeScaling()
    kind = rs.get("rope_type") or rs.get("type") or "default"
    if kind not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: rope_scaling type '{kind}' is not supported "
                             f"(supported: {', '.join(ROPE_TYPES)})")
    return RopeScaling(
        rope_type=kind,
        factor=float(rs.get("factor", 1.0)),
        low_freq_factor=float(rs.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rs.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rs.get("original_max_position_embeddings", 8192)),
    )


def _moe_fields(hf: dict[str, Any], arch: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a HF config (none for a dense one). Mixtral names its expert
    count `num_local_experts` and always renormalises the top-k weights; the Qwen MoEs name it
    `num_experts` (Qwen3-MoE configs written by transformers 5 say `num_local_experts`)."""
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    if not experts:
        return {}
    try:
        experts, k = int(experts), int(hf.get("num_experts_per_tok") or 0)
        mlp_only = tuple(int(i) for i in hf.get("mlp_only_layers") or ())
        fields = dict(
            num_experts=experts, num_experts_per_tok=k,
            moe_intermediate_size=int(hf.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
            norm_topk_prob=True if arch == "MixtralForCausalLM" else bool(hf.get("norm_topk_prob", False)),
            decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1),
            mlp_only_layers=mlp_only)
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: bad mixture-of-experts field ({e})") from None
    if not 1 <= k <= experts:
        raise ModelLoadError(f"{source}: 'num_experts_per_tok' must be in 1..{experts} (the experts), "
                             f"got {hf.get('num_experts_per_tok')!r}")
    return fields
