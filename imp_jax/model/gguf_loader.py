"""GGUF checkpoints: llama.cpp metadata -> HF config dict, lazily dequantised HF-named tensors, tokenizer.

Matches transformers' own GGUF loading (config keys, Q/K un-permutation, tokenizer conversion) so a
GGUF and the HF checkpoint it came from load to the same model. The tokenizer conversion lives in
gguf_tokenizer.py.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from imp_jax.kernels_pallas import ggml_blocks
from imp_jax.errors import ModelLoadError
from imp_jax.model.gguf_file import GGUFFile
from imp_jax.model.gguf_tokenizer import gguf_tokenizer
from imp_jax.model.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.gguf")

# GGUF `general.architecture` -> HF `architectures[0]`
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
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

    def __init__(self, entries: dict[str, tuple[Any, int | None]]):
        self._entries = entries  # hf name -> (gguf ReaderTensor, heads to un-permute rows by, or None)

    def __getitem__(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        tensor, heads = self._entries[name]
        w = dequantize(tensor.data, tensor.tensor_type).reshape(self.shape(name))
        if heads is not None:
            w = unpermute_rotary(w, heads)
        return np.require(w, np.float32, ["C", "W", "O"])  # an F32 tensor is copied out of the mmap

    def blocks(self, name: str) -> np.ndarray | None:
        """A matrix's GGML blocks as stored, uint8 [rows, K / 32 (256 for K-quants), block bytes]
        (kernels_pallas/ggml_blocks.py), when its type is one the CPU GEMM kernel reads; else None.
        Q/K rows are un-permuted as in `__getitem__`."""
        tensor, heads = self._entries[name]
        fmt, shape = tensor.tensor_type.name, self.shape(name)
        if fmt not in ggml_blocks.FORMATS or len(shape) != 2 or shape[1] % ggml_blocks.WEIGHTS[fmt]:
            return None
        b = np.asarray(tensor.data).reshape(shape[0], shape[1] // ggml_blocks.WEIGHTS[fmt], ggml_blocks.FORMATS[fmt])
        if heads is not None:
            b = unpermute_rotary(b, heads)
        return np.require(b, requirements=["C", "W", "O"])   # a copy out of the mmap

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape of a tensor without reading it (GGUF stores dims innermost-first)."""
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
    meta = _Metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture '{arch}' is not supported "
                             f"(supported: {', '.join(ARCHITECTURES)})", code="unknown_architecture")
    raw = {t.name: t for t in reader.tensors}
    hf_config = _hf_config(arch, meta, raw)
    return GGUFCheckpoint(hf_config, _hf_tensors(arch, raw, hf_config, path), *gguf_tokenizer(meta))


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
    if head_dim is None and "blk.0.attn_q.weight" in raw:
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
        "attention_bias": "blk.0.attn_q.bias" in raw,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",  # what the dequantised tensors are; the loader picks the compute dtype
    }
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    return cfg


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(x)))


def _rope_scaling(arch: str, meta: _Metadata, raw: dict[str, Any]) -> dict[str, Any] | None:
    """HF rope_scaling from `rope.scaling.*`, or llama3 parameters recognised in a `rope_freqs` tensor."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
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
    """Map GGUF tensor names to HF ones; llama Q/K rows get un-permuted (heads for q, kv heads for k)."""
    entries: dict[str, tuple[Any, int | None]] = {}
    unknown = []
    for name, tensor in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into rope_scaling
        stem, _, suffix = name.rpartition(".")
        if stem in _TOP_NAMES:
            entries[f"{_TOP_NAMES[stem]}.{suffix}"] = (tensor, None)
            continue
        m = _LAYER_RE.fullmatch(name)
        if not m or m[2] not in _LAYER_NAMES:
            unknown.append(name)
            continue
        heads = None
        if arch == "llama" and m[2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if m[2] == "attn_q" else cfg["num_key_value_heads"]
        entries[f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"] = (tensor, heads)
    if unknown:
        raise ModelLoadError(f"{path}: tensors this loader cannot map for '{arch}' "
                             f"(mixture-of-experts or another variant?): {', '.join(unknown[:8])}")
    return GGUFTensors(entries)
