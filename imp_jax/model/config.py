"""Model configuration: the common decoder's fields, parsed from HF config.json dicts; a family's own fields
live in its ModelConfig subclass, declared in its own file (model/family.py) and found through the registry."""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar, Mapping

import numpy as np

from imp_jax.errors import ModelLoadError
from imp_jax.model import registry
from imp_jax.model.language_model_config import language_model_config, text_config

ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
ROPE_ALIASES = {"su": "longrope",   # Phi-3's early configs name longrope "su"
                "mrope": "default"}  # Qwen2-VL's multimodal RoPE: default frequencies, `mrope_section` apart
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """HF `rope_scaling`: `linear` divides positions by `factor`; `llama3` rescales low frequencies;
    `longrope` (Phi-3/4) divides each frequency by its short or long factor and scales cos/sin by
    `attention_factor`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # --- longrope (Phi-3 / Phi-4, issue 24) ---------------------------------------------------
    # transformers picks long or short factors per forward from the sequence length; a paged KV
    # cache cannot re-rotate cached keys, so the choice is static: long factors when the served
    # context exceeds original_max_position_embeddings (vLLM's rule; `ModelConfig.for_context`).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0       # cos and sin are multiplied by it (short and long alike; also YaRN's)
    use_long_factor: bool = False
    # --- YaRN (gpt-oss): frequencies ramp from interpolated (/ factor) to extrapolated between the
    # correction dims of beta_fast and beta_slow rotations over original_max_position_embeddings
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def __post_init__(self) -> None:   # factors read back from JSON are lists: keep the config hashable
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only transformer (Llama, Mistral, Qwen2, Qwen3, Phi-3); a family with
    fields of its own subclasses it (Gemma, the mixtures of experts, gpt-oss). `raw` is the HF config dict
    it was parsed from, for a family to read a hyperparameter no field names."""

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
    # --- Phi-3 / Phi-4 (issue 24) -----------------------------------------------------------------
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * this dims only (Phi-4-mini)
    # --- Qwen2.5-VL: multimodal RoPE (model/vision/mrope.py) ------------------------------------
    mrope_section: tuple[int, ...] = ()  # rotary half-dims per position component (temporal, height,
                                         # width), in order; () = one component (plain RoPE)
    layer_types: tuple[str, ...] = ()    # per layer "sliding_attention" | "full_attention";
                                         # () = every layer uses `sliding_window` as above (Gemma, gpt-oss)
    raw: Mapping[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # a learned per-head logit joins each softmax's denominator (a family's class says so: gpt-oss)
    attention_sinks: ClassVar[bool] = False

    @property
    def rotary_dim(self) -> int:
        """How many of a head's leading dims RoPE rotates (all of them unless partial_rotary_factor < 1)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rope_attention_scale(self) -> float:
        """What cos and sin are multiplied by (longrope's attention factor; 1 otherwise)."""
        rs = self.rope_scaling
        return rs.attention_factor if rs.rope_type in ("longrope", "yarn") else 1.0

    def for_context(self, max_model_len: int) -> "ModelConfig":
        """This config served with a context of `max_model_len` tokens: longrope takes its long
        factors when that exceeds original_max_position_embeddings, else its short ones."""
        rs = self.rope_scaling
        if rs.rope_type != "longrope":
            return self
        long = max_model_len > rs.original_max_position_embeddings
        return dataclasses.replace(self, rope_scaling=dataclasses.replace(rs, use_long_factor=long))

    def describe_rope(self) -> str:
        """One line on the RoPE variant in use (logged at start-up for longrope's static choice)."""
        rs = self.rope_scaling
        text = f"rope {rs.rope_type}, theta {self.rope_theta:g}, rotary dims {self.rotary_dim}/{self.head_dim}"
        if rs.rope_type == "longrope":
            which = "long" if rs.use_long_factor else "short"
            text += (f"; longrope uses its {which} factors for every position (static: long when the "
                     f"served context exceeds original_max_position_embeddings "
                     f"{rs.original_max_position_embeddings}), attention factor {rs.attention_factor:.6g}")
        return text

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):   # tuple fields come back from JSON as lists (converted checkpoints)
            if str(f.type).startswith("tuple") and isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ModelLoadError(f"layer_types: {bad[0]!r} is not one of {', '.join(LAYER_TYPES)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (None: it attends to the whole sequence)."""
        if self.layer_types and self.layer_types[i] == "full_attention":
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2] with the configured scaling applied (float64)."""
        d = self.rotary_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        rs = self.rope_scaling
        if rs.rope_type == "longrope":
            inv = inv / np.asarray(rs.long_factor if rs.use_long_factor else rs.short_factor, np.float64)
        elif rs.rope_type == "linear":
            inv = inv / rs.factor
        elif rs.rope_type == "yarn":
            inv = _yarn_inv_freq(inv, d, self.rope_theta, rs)
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
        if text_config(archs[0]) is not None:
            hf = language_model_config(hf, archs, source)

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
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        partial = float(hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)))
        if not 0 < partial <= 1 or int(head_dim * partial) % 2:
            raise ModelLoadError(f"{source}: partial_rotary_factor {partial} must be in (0, 1] and rotate "
                                 f"an even number of the {head_dim} head dims")
        max_pos = int(hf.get("max_position_embeddings", 2048))
        fields: dict[str, Any] = dict(
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
            rope_scaling=parse_rope_scaling(rope, source, hf=hf, rotary_dim=int(head_dim * partial),
                                            max_pos=max_pos),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=attention_bias(hf, default=False),
            sliding_window=int(window) if window else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos_ids,
            partial_rotary_factor=partial,
            mrope_section=_mrope_section(rope, int(head_dim * partial), source),
        )
        family = registry.family(arch)
        if family is None:   # a user model's architecture (--model-class): the common fields
            return cls(**fields, raw=dict(hf))
        if family.parse is not None:
            fields.update(family.parse(hf, fields, source))
        return family.config(**fields, raw=dict(hf))

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        """Read and parse a config.json file."""
        path = Path(path)
        try:
            hf = read_json(path)
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: config.json not found") from None
        return cls.from_hf(hf, source=str(path))


def config_class(architecture: str) -> type[ModelConfig]:
    """The ModelConfig (sub)class of an architecture's family (ModelConfig itself for an unregistered one)."""
    family = registry.family(architecture)
    return ModelConfig if family is None else family.config


def attention_bias(hf: Mapping[str, Any], default: bool) -> bool:
    """Whether q/k/v carry biases: the config's `attention_bias` (or `qkv_bias`), else the family's `default`."""
    return bool(hf.get("attention_bias", hf.get("qkv_bias", default)))


def read_json(path: Path) -> Any:
    """A JSON file's content; malformed content is a ModelLoadError naming the file (absence raises FileNotFoundError)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path}: malformed JSON ({e})") from None


def _mrope_section(rope: dict[str, Any], rotary_dim: int, source: str) -> tuple[int, ...]:
    """`mrope_section` of rope_scaling / rope_parameters (() when absent): three counts of rotary half-dims
    that must add up to rotary_dim / 2."""
    section = rope.get("mrope_section")
    if section is None:
        return ()
    if (not isinstance(section, list) or len(section) != 3 or not all(isinstance(n, int) and n >= 0 for n in section)
            or sum(section) != rotary_dim // 2):
        raise ModelLoadError(f"{source}: 'mrope_section' must be 3 counts adding up to {rotary_dim // 2} (half "
                             f"the rotary dims), got {section!r}"[:300])
    return tuple(section)


def opt_float(x: Any) -> float | None:
    return None if x is None else float(x)


def parse_rope_scaling(rs: dict[str, Any] | None, source: str, *, hf: dict[str, Any] | None = None,
                        rotary_dim: int = 0, max_pos: int = 0) -> RopeScaling:
    """`rs` as a RopeScaling; longrope also reads the whole config `hf` (a top-level
    original_max_position_embeddings), the rotary dims and max_position_embeddings."""
    if not rs:
        return RopeScaling()
    kind = rs.get("rope_type") or rs.get("type") or "default"
    kind = ROPE_ALIASES.get(kind, kind)
    if kind == "longrope":
        return _parse_longrope(rs, source, hf or {}, rotary_dim, max_pos)
    if kind == "yarn":
        return _parse_yarn(rs, source, max_pos)
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


def _parse_longrope(rs: dict[str, Any], source: str, hf: dict[str, Any], rotary_dim: int,
                    max_pos: int) -> RopeScaling:
    """Phi-3/4 longrope, as transformers' `_compute_longrope_parameters` reads it: the attention
    factor is `attention_factor` if given, else sqrt(1 + ln(s) / ln(original)) for
    s = `factor` or max_position_embeddings / original (1 when s <= 1)."""
    original = rs.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError(f"{source}: longrope rope_scaling needs 'original_max_position_embeddings'")
    original = int(original)
    factors = {}
    for key in ("short_factor", "long_factor"):
        f = rs.get(key)
        if not isinstance(f, list) or len(f) != rotary_dim // 2 or not all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in f):
            raise ModelLoadError(f"{source}: longrope '{key}' must be a list of {rotary_dim // 2} positive "
                                 f"numbers (half the rotary dims), got {f!r}"[:300])
        factors[key] = tuple(float(x) for x in f)
    factor = float(rs.get("factor") or max_pos / original)
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                       attention_factor=float(attention), use_long_factor=max_pos > original, **factors)


def _parse_yarn(rs: dict[str, Any], source: str, max_pos: int) -> RopeScaling:
    """YaRN as transformers' `_compute_yarn_parameters` reads it: `factor` (else max_position_embeddings
    / original), the attention factor `attention_factor` if given, else 0.1 * ln(factor) + 1 (with
    `mscale` / `mscale_all_dim`: their ratio of that form)."""
    original = rs.get("original_max_position_embeddings")
    if not original:
        raise ModelLoadError(f"{source}: yarn rope_scaling needs 'original_max_position_embeddings'")
    try:
        original = int(original)
        factor = float(rs.get("factor") or max_pos / original)
        attention = rs.get("attention_factor")
        mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
        if attention is None:
            attention = (_yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(mscale_all))
                         if mscale and mscale_all else _yarn_mscale(factor))
        return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                           attention_factor=float(attention), beta_fast=float(rs.get("beta_fast") or 32),
                           beta_slow=float(rs.get("beta_slow") or 1), truncate=bool(rs.get("truncate", True)))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{source}: bad yarn rope_scaling field ({e})") from None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(inv: np.ndarray, dim: int, base: float, rs: RopeScaling) -> np.ndarray:
    """YaRN's blend of the extrapolated frequencies `inv` and the interpolated inv / factor."""
    def correction_dim(rotations: float) -> float:
        return dim * math.log(rs.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = correction_dim(rs.beta_fast), correction_dim(rs.beta_slow)
    if rs.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp
    return inv / rs.factor * (1 - extrapolate) + inv * extrapolate
