"""GGUF checkpoints: llama.cpp metadata -> HF config dict, lazily dequantised HF-named tensors, tokenizer.

Matches transformers' own GGUF loading (config keys, Q/K un-permutation, tokenizer conversion) so a
GGUF and the HF checkpoint it came from load to the same model. The tokenizer conversion lives in
gguf_tokenizer.py.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.errors import ModelLoadError
from imp_jax.model.formats.gguf_file import GGUFFile
from imp_jax.model.text.gguf_tokenizer import gguf_tokenizer
from imp_jax.model.text.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.gguf")

# GGUF `general.architecture` -> HF `architectures[0]`
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "phi3": "Phi3ForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "gpt-oss": "GptOssForCausalLM",
                 # Qwen2-VL / Qwen2.5-VL's text model: a Qwen2 with M-RoPE (`rope.dimension_sections`); its
                 # image side comes from a --mmproj file (model/vision/mmproj.py)
                 "qwen2vl": "Qwen2_5_VLForConditionalGeneration"}
GEMMA = ("gemma2", "gemma3")
# a `llama` GGUF with expert tensors is a Mixtral (llama.cpp's converter writes Mixtral so)
MIXTRAL = "MixtralForCausalLM"

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",   # phi3: q|k|v fused, as HF's Phi3 stores it
}
# phi3: longrope's per-frequency divisors, folded into rope_scaling (not model weights)
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
# Gemma's four norms per layer (llama's `ffn_norm` is Gemma's pre-feed-forward norm)
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# mixture-of-experts tensors: stacked experts keep their [E, out, in] stack (model/architectures/moe.py reads it
# whole; quantised ones are dequantised at load); `{moe}` is Mixtral's `block_sparse_moe` or the
# Qwen MoEs' `mlp`, and the experts' names are Mixtral's w1/w3/w2 or gate/up/down_proj
_MOE_NAMES = {
    "ffn_gate_inp": "{moe}.gate", "ffn_gate_exps": "{moe}.experts.{gate}", "ffn_up_exps": "{moe}.experts.{up}",
    "ffn_down_exps": "{moe}.experts.{down}", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
# gpt-oss (model/architectures/gpt_oss.py): its own norm, sink and router names; llama.cpp's converter splits HF's
# interleaved gate_up into stacked [E, out, in] gate and up tensors (biases [E, out] likewise), which
# keep HF's Qwen-MoE-style names here and GptOssLM reads as they are
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
# llama.cpp's default gpt-oss values: every other layer slides (the first does), YaRN's betas; the
# clamped SwiGLU's alpha and limit are fixed there (GptOssConfig's defaults, which ModelConfig applies)
_GPT_OSS_SWA_PERIOD = 2
_GPT_OSS_YARN_BETAS = (32.0, 1.0)
_MOE_LEAVES = {MIXTRAL: dict(moe="block_sparse_moe", gate="w1", up="w3", down="w2"),
               "other": dict(moe="mlp", gate="gate_proj", up="up_proj", down="down_proj")}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclasses.dataclass
class GGUFCheckpoint:
    """Everything a GGUF file holds, in the shapes the HF-directory loader produces."""

    hf_config: dict[str, Any]
    tensors: Mapping[str, np.ndarray]
    tokenizer: Tokenizer
    generation_config: dict[str, Any]


class GGUFTensors(Mapping[str, np.ndarray]):
    """HF-named float32 tensors, dequantised from the memory-mapped file on each access."""

    def __init__(self, entries: dict[str, tuple[Any, int | None]], minus_one: frozenset[str] = frozenset(),
                 rows: Mapping[str, tuple[int, int]] | None = None):
        self._entries = entries  # hf name -> (gguf ReaderTensor, heads to un-permute rows by, or None)
        self._minus_one = minus_one   # Gemma norms: llama.cpp stored HF's weight + 1
        self._rows = dict(rows or {})   # hf name -> [start, stop) of the stored tensor's rows (a fused q|k|v)

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        tensor, heads = self._entries[name]
        w = dequantize(tensor.data, tensor.tensor_type).reshape(self._stored_shape(name))
        if name in self._rows:
            w = w[slice(*self._rows[name])]
        if heads is not None:
            w = unpermute_rotary(w, heads)
        if name in self._minus_one:
            w = w.astype(np.float32) - np.float32(1.0)
        return np.require(w, np.float32, ["C", "W", "O"])  # an F32 tensor is copied out of the mmap

    def blocks(self, name: str) -> np.ndarray | None:
        """A matrix's GGML blocks as stored, uint8 [rows, K / 32 (256 for K-quants), block bytes] (an
        expert stack's [E, rows, K / 32, block bytes])
        (kernels_pallas/ggml_blocks.py), when its type is one the CPU GEMM kernel reads (IQ4_NL as pairs
        of blocks, or where K is not a multiple of 64 as the Q8_0 blocks that hold its weights exactly);
        else None.
        Q/K rows are un-permuted as in `__getitem__`."""
        tensor, heads = self._entries[name]
        fmt, shape = tensor.tensor_type.name, self._stored_shape(name)
        if len(shape) not in (2, 3):   # a matrix, or a stack of experts' [E, out, in]
            return None
        *rows, k = shape
        if fmt == "IQ4_NL":   # the file's 32-weight blocks: kept in pairs, else as Q8_0
            if k % ggml_blocks.BLOCK:
                return None
            b = np.asarray(tensor.data).reshape(*rows, k // ggml_blocks.BLOCK, ggml_blocks.IQ4_NL_BYTES)
            b = ggml_blocks.iq4_nl_pairs(b) if k % ggml_blocks.IQ4_NL_PAIR == 0 else ggml_blocks.iq4_nl_to_q8_0(b)
        else:
            if fmt not in ggml_blocks.FORMATS or k % ggml_blocks.WEIGHTS[fmt]:
                return None
            b = np.asarray(tensor.data).reshape(*rows, k // ggml_blocks.WEIGHTS[fmt], ggml_blocks.FORMATS[fmt])
        if name in self._rows:
            b = b[slice(*self._rows[name])]
        if heads is not None:
            b = unpermute_rotary(b, heads)
        return np.require(b, requirements=["C", "W", "O"])   # a copy out of the mmap

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape of a tensor without reading it (GGUF stores dims innermost-first)."""
        shape = self._stored_shape(name)
        if name in self._rows:
            start, stop = self._rows[name]
            return (stop - start, *shape[1:])
        return shape

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._entries[name][0].shape))

    def qtype(self, name: str) -> str:
        """The GGML storage type of a tensor, e.g. 'Q4_1' or 'F32'."""
        return self._entries[name][0].tensor_type.name

    def __contains__(self, name: object) -> bool:
        return name in self._entries   # Mapping's default would dequantise the tensor to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def permute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K row permutation (HF half-split rotary -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute_rotary` (transformers' `_reverse_permute_weights`)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    """Open a GGUF file: config, lazy tensors, tokenizer and generation defaults."""
    path = Path(path)
    reader = _open(path)
    with metadata_errors(path):
        meta = _Metadata(reader, path)
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF architecture '{arch}' is not supported "
                                 f"(supported: {', '.join(ARCHITECTURES)})", code="unknown_architecture")
        raw = {t.name: t for t in reader.tensors}
        hf_config = _hf_config(arch, meta, raw)
        return GGUFCheckpoint(hf_config, _hf_tensors(arch, raw, hf_config, path), *gguf_tokenizer(meta))


@contextlib.contextmanager
def metadata_errors(path: Path) -> Iterator[None]:
    """What reading a file's metadata into a config raises on values no writer makes (a head count of
    0, a string where a number goes, a list too short, nesting too deep) as a ModelLoadError naming
    the file, not a traceback."""
    try:
        yield
    except ModelLoadError:
        raise
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError, MemoryError,
            struct.error) as e:
        raise ModelLoadError(f"{path}: unusable GGUF metadata ({type(e).__name__}: {e})") from None


def _open(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        return GGUFFile(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on a bad file
        raise ModelLoadError(f"{path}: unreadable GGUF file ({type(e).__name__}: {e})") from None


class _Metadata:
    """The file's key/value metadata as Python values."""

    def __init__(self, reader: GGUFFile, path: Path):
        self.path = path
        self.values: dict[str, Any] = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def need(self, key: str) -> Any:
        if key not in self.values:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks '{key}'")
        return self.values[key]


def _hf_config(arch: str, meta: _Metadata, raw: dict[str, Any]) -> dict[str, Any]:
    """A HF config.json-style dict from `{arch}.*` metadata (transformers' GGUF_CONFIG_MAPPING)."""
    a = lambda key: f"{arch}.{key}"  # noqa: E731
    heads = int(meta.need(a("attention.head_count")))
    kv_heads = meta.get(a("attention.head_count_kv"), heads)
    if not isinstance(kv_heads, int):
        raise ModelLoadError(f"{meta.path}: per-layer KV head counts are not supported")
    hidden = int(meta.need(a("embedding_length")))
    head_dim = meta.get(a("attention.key_length"))
    if head_dim is None and "blk.0.attn_q.weight" in raw and "blk.0.attn_qkv.weight" not in raw:
        head_dim = int(raw["blk.0.attn_q.weight"].shape[1]) // heads  # ne[1] = output rows
    embed = raw.get("token_embd.weight")  # its rows are the logits width, whatever the metadata says
    vocab = int(embed.shape[1]) if embed is not None else meta.get(a("vocab_size")) or len(meta.need(
        "tokenizer.ggml.tokens"))
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(a("feed_forward_length"))),
        "num_hidden_layers": int(meta.need(a("block_count"))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": _f32(meta.get(a("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": _f32(meta.get(a("rope.freq_base"), 10000.0)),
        "rope_scaling": _rope_scaling(arch, meta, raw),
        "max_position_embeddings": int(meta.get(a("context_length"), 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in raw,
        "attention_bias": "blk.0.attn_q.bias" in raw or "blk.0.attn_qkv.bias" in raw,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",  # what the dequantised tensors are; the loader picks the compute dtype
    }
    if arch in ("qwen2", "qwen2moe", "qwen3moe", "qwen2vl"):
        cfg["use_sliding_window"] = False
    if arch == "qwen2vl":   # the text fields of a Qwen2.5-VL config.json, flat as the hub has them
        sections = list(meta.need(a("rope.dimension_sections")))
        cfg.update(model_type="qwen2_5_vl", rope_scaling={"type": "mrope", "mrope_section": sections[:3]})
    if arch == "phi3":   # issue 24: partial rotary (Phi-4-mini) and a sliding window (Phi-3-mini-4k)
        rope_dims = meta.get(a("rope.dimension_count"))
        if rope_dims:
            cfg["partial_rotary_factor"] = int(rope_dims) / cfg["head_dim"]
        window = meta.get(a("attention.sliding_window"))
        if window:
            cfg["sliding_window"] = int(window)
        original = meta.get(a("rope.scaling.original_context_length"))
        if original:
            cfg["original_max_position_embeddings"] = int(original)
    if arch in GEMMA:
        cfg.update(_gemma_config(arch, meta, cfg))
    if arch == "gpt-oss":
        cfg.update(_gpt_oss_config(meta, cfg))
        return cfg
    experts = meta.get(a("expert_count"))
    if experts:   # mixture of experts (model/architectures/moe.py)
        if arch == "llama":
            cfg["architectures"] = [MIXTRAL]
        cfg["num_local_experts" if arch == "llama" else "num_experts"] = int(experts)
        cfg["num_experts_per_tok"] = int(meta.need(a("expert_used_count")))
        if meta.get(a("expert_feed_forward_length")):
            cfg["moe_intermediate_size"] = int(meta.get(a("expert_feed_forward_length")))
        if meta.get(a("expert_shared_feed_forward_length")):
            cfg["shared_expert_intermediate_size"] = int(meta.get(a("expert_shared_feed_forward_length")))
        # llama.cpp renormalises the top-k weights of qwen3moe, not of qwen2moe, unless the file says
        cfg["norm_topk_prob"] = bool(meta.get(a("expert_weights_norm"), arch == "qwen3moe"))
        cfg["mlp_only_layers"] = [i for i in range(cfg["num_hidden_layers"])   # dense layers: no router
                                  if f"blk.{i}.ffn_gate_inp.weight" not in raw]
    return cfg


def _gpt_oss_config(meta: _Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss keys as llama.cpp's converter writes them (conversion/gpt_oss.py) and its loader reads
    them (src/models/openai-moe.cpp): the experts' width is `expert_feed_forward_length` (HF's
    `intermediate_size`; `feed_forward_length` holds the same), the window `attention.sliding_window`
    (required), the sliding layers `attention.sliding_window_pattern` (never written: llama.cpp's
    default period 2, the first layer sliding), YaRN as `rope.scaling.*` (betas from
    `rope.scaling.yarn_beta_fast/slow`, else llama.cpp's 32 and 1). HF's gpt-oss YaRN does not
    round the ramp's ends (`truncate: false`); llama.cpp does, which moves a few frequencies
    slightly: we follow HF, so a GGUF and the checkpoint it came from load to the same model.
    A `rope.freq_base_swa` other than `rope.freq_base` (llama.cpp reads one; HF's gpt-oss has no such
    field) is refused."""
    a = lambda key: f"gpt-oss.{key}"  # noqa: E731
    layers = cfg["num_hidden_layers"]
    window = meta.get(a("attention.sliding_window"))
    if not window:
        raise ModelLoadError(f"{meta.path}: GGUF metadata lacks '{a('attention.sliding_window')}'")
    swa_base = meta.get(a("rope.freq_base_swa"))
    if swa_base is not None and _f32(swa_base) != cfg["rope_theta"]:
        raise ModelLoadError(f"{meta.path}: {a('rope.freq_base_swa')} = {_f32(swa_base)} differs from "
                             f"{a('rope.freq_base')} = {cfg['rope_theta']}; gpt-oss has one RoPE base")
    expert_width = meta.get(a("expert_feed_forward_length"))
    if isinstance(expert_width, list):   # llama.cpp accepts one per layer; gpt-oss has one width
        if len(set(expert_width)) != 1:
            raise ModelLoadError(f"{meta.path}: per-layer {a('expert_feed_forward_length')} is not supported")
        expert_width = expert_width[0]
    out: dict[str, Any] = {
        "intermediate_size": int(expert_width or cfg["intermediate_size"]),
        "num_local_experts": int(meta.need(a("expert_count"))),
        "num_experts_per_tok": int(meta.need(a("expert_used_count"))),
        "sliding_window": int(window),
        "layer_types": _layer_types(meta, "gpt-oss", layers, _GPT_OSS_SWA_PERIOD),
    }
    rope = cfg["rope_scaling"]
    if rope is not None:
        if rope["rope_type"] != "yarn":
            raise ModelLoadError(f"{meta.path}: gpt-oss rope scaling '{rope['rope_type']}' is not supported "
                                 f"(llama.cpp writes yarn)")
        fast = meta.get(a("rope.scaling.yarn_beta_fast")) or _GPT_OSS_YARN_BETAS[0]
        slow = meta.get(a("rope.scaling.yarn_beta_slow")) or _GPT_OSS_YARN_BETAS[1]
        out["rope_scaling"] = {**rope, "beta_fast": _f32(fast), "beta_slow": _f32(slow), "truncate": False}
    return out


def _gemma_config(arch: str, meta: _Metadata, cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2 / 3 keys as llama.cpp reads them: the attention scale is `attention.scale` when
    written, else 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 27B models (46 or 62
    layers), which is HF's `query_pre_attn_scalar`; the sliding-window pattern is
    `attention.sliding_window_pattern` (a period, or a per-layer bool array, true = sliding) else
    llama.cpp's fixed 2 (Gemma 2) or 6 (Gemma 3); the sliding layers' RoPE base is
    `rope.freq_base_swa`, else 10000."""
    a = lambda key: f"{arch}.{key}"  # noqa: E731
    layers, g3 = cfg["num_hidden_layers"], arch == "gemma3"
    scale = meta.get(a("attention.scale"))
    if scale:
        scalar = round(1.0 / float(scale) ** 2, 4)   # a float32 scale: 24 comes back as 23.999998
    elif layers == (62 if g3 else 46):
        scalar = cfg["hidden_size"] / cfg["num_attention_heads"]
    else:
        scalar = cfg["head_dim"]
    types = _layer_types(meta, arch, layers, 6 if g3 else 2)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": _f32(scalar),
        "attn_logit_softcapping": _opt_f32(meta.get(a("attn_logit_softcapping"))),
        "final_logit_softcapping": _opt_f32(meta.get(a("final_logit_softcapping"))),
        "sliding_window": meta.get(a("attention.sliding_window"), 4096),
        "layer_types": types,
    }
    if g3:
        out["rope_theta"] = _f32(meta.get(a("rope.freq_base"), 1e6))
        out["rope_local_base_freq"] = _f32(meta.get(a("rope.freq_base_swa"), 10000.0))
    return out


def _layer_types(meta: _Metadata, arch: str, layers: int, period: int) -> list[str]:
    """Which layers slide, as llama.cpp's `load_swa_pattern` reads `attention.sliding_window_pattern`:
    a per-layer bool array (true = sliding), or a period n (default `period`) where layer i slides
    unless i % n == n - 1 (n = 0: every layer slides)."""
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = meta.get(key, period)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise ModelLoadError(f"{meta.path}: {key} has {len(pattern)} entries for {layers} layers")
        return ["sliding_attention" if p else "full_attention" for p in pattern]
    n = int(pattern)
    return ["sliding_attention" if n == 0 or i % n < n - 1 else "full_attention" for i in range(layers)]


def _opt_f32(x: float | None) -> float | None:
    return None if x is None else _f32(x)


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _rope_scaling(arch: str, meta: _Metadata, raw: dict[str, Any]) -> dict[str, Any] | None:
    """HF rope_scaling from `rope.scaling.*`, or llama3 parameters recognised in a `rope_freqs` tensor,
    or phi3's longrope from its `rope_factors_long/short` tensors."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if all(name in raw for name in _ROPE_FACTOR_TENSORS):
        return _longrope(arch, meta, raw, original)
    if kind and kind != "none":
        out: dict[str, Any] = {"rope_type": kind, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        if original:
            out["original_max_position_embeddings"] = int(original)
        return out
    if "rope_freqs.weight" not in raw:
        return None
    from gguf.quants import dequantize

    rt = raw["rope_freqs.weight"]
    factors = dequantize(rt.data, rt.tensor_type).astype(np.float64).reshape(-1)
    theta, dim, f = float(meta.get(f"{arch}.rope.freq_base", 10000.0)), 2 * factors.size, float(factors.max())
    old, lo, hi = int(original or 8192), 1.0, 4.0  # only old/lo and old/hi matter: fix old, fit lo and hi
    mid = (factors > 1 + 1e-6) & (factors < f - 1e-6)
    if mid.sum() >= 2 and f > 1:  # smooth = old / (hi - lo) / wavelen - lo / (hi - lo) between the bands
        inv_wavelen = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim) / (2 * np.pi)
        a, b = np.polyfit(inv_wavelen[mid], (1 / factors[mid] - 1 / f) / (1 - 1 / f), 1)
        lo = round(-b * old / a, 4)
        hi = round(lo + old / a, 4)
    fit = {"rope_type": "llama3", "factor": f, "low_freq_factor": lo, "high_freq_factor": hi,
           "original_max_position_embeddings": old}
    if np.allclose(_llama3_factors(fit, theta, dim), factors, rtol=1e-4):
        return fit
    log.warning("rope_freqs tensor does not match llama3 rope scaling; ignoring it")
    return None


def _longrope(arch: str, meta: _Metadata, raw: dict[str, Any], original: int | None) -> dict[str, Any]:
    """phi3's longrope: the factor tensors, the original context and llama.cpp's attention factor."""
    from gguf.quants import dequantize

    if not original:
        raise ModelLoadError(f"{meta.path}: rope_factors tensors without "
                             f"'{arch}.rope.scaling.original_context_length'")
    out: dict[str, Any] = {"rope_type": "longrope", "original_max_position_embeddings": int(original)}
    for name, key in zip(_ROPE_FACTOR_TENSORS, ("long_factor", "short_factor")):
        t = raw[name]
        out[key] = [float(f) for f in dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)]
    attn = meta.get(f"{arch}.rope.scaling.attn_factor")
    if attn is not None:
        out["attention_factor"] = _f32(attn)
    return out


def _llama3_factors(rs: dict[str, Any], theta: float, dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp writes to `rope_freqs` for HF llama3 rope_scaling."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * np.pi / freqs
    old, lo, hi, f = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                      rs["high_freq_factor"], rs["factor"])
    smooth = (old / wavelen - lo) / (hi - lo)
    mid = 1.0 / ((1 - smooth) / f + smooth)
    return np.where(wavelen < old / hi, 1.0, np.where(wavelen > old / lo, f, mid))


def _hf_tensors(arch: str, raw: dict[str, Any], cfg: dict[str, Any], path: Path) -> GGUFTensors:
    """Map GGUF tensor names to HF ones; llama Q/K rows get un-permuted (heads for q, kv heads for k).
    A gpt-oss `attn_qkv` (convert_hf_to_gguf.py --fuse-qkv) is read as HF's q, k and v: row ranges of it."""
    entries: dict[str, tuple[Any, int | None]] = {}
    rows: dict[str, tuple[int, int]] = {}
    layer_names = _GEMMA_LAYER_NAMES if arch in GEMMA else _GPT_OSS_LAYER_NAMES if arch == "gpt-oss" else _LAYER_NAMES
    unknown = []
    fused_gate_up = arch == "phi3" and "blk.0.ffn_gate.weight" not in raw   # ffn_up holds gate|up
    for name, tensor in raw.items():
        if name == "rope_freqs.weight" or name in _ROPE_FACTOR_TENSORS:
            continue  # folded into rope_scaling
        stem, _, suffix = name.rpartition(".")
        if stem in _TOP_NAMES:
            entries[f"{_TOP_NAMES[stem]}.{suffix}"] = (tensor, None)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m and m[2] in _MOE_NAMES and cfg.get("num_experts_per_tok") and arch != "gpt-oss":
            leaves = _MOE_LEAVES.get(cfg["architectures"][0], _MOE_LEAVES["other"])
            entries[f"model.layers.{m[1]}.{_MOE_NAMES[m[2]].format(**leaves)}.{m[3]}"] = (tensor, None)
            continue
        if not m or m[2] not in layer_names or (m[2] == "attn_qkv" and arch not in ("phi3", "gpt-oss")):
            unknown.append(name)
            continue
        heads = None
        if arch == "llama" and m[2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if m[2] == "attn_q" else cfg["num_key_value_heads"]
        hf_leaf = "mlp.gate_up_proj" if fused_gate_up and m[2] == "ffn_up" else layer_names[m[2]]
        if m[2] == "attn_sinks":   # HF's sinks are a bare parameter, llama.cpp's a `.weight`
            entries[f"model.layers.{m[1]}.{hf_leaf}"] = (tensor, None)
            continue
        if m[2] == "attn_qkv" and arch == "gpt-oss":
            q, kv = (cfg[k] * cfg["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
            if int(tensor.shape[-1]) != q + 2 * kv:
                raise ModelLoadError(f"{path}: {name} has {int(tensor.shape[-1])} rows where q|k|v has {q + 2 * kv}")
            for proj, span in zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
                hf_name = f"model.layers.{m[1]}.self_attn.{proj}_proj.{m[3]}"
                entries[hf_name], rows[hf_name] = (tensor, None), span
            continue
        entries[f"model.layers.{m[1]}.{hf_leaf}.{m[3]}"] = (tensor, heads)
    if unknown:
        raise ModelLoadError(f"{path}: tensors this loader cannot map for '{arch}' "
                             f"(mixture-of-experts or another variant?): {', '.join(unknown[:8])}")
    minus_one = frozenset(n for n in entries if arch in GEMMA and n.endswith("norm.weight"))
    return GGUFTensors(entries, minus_one, rows)
