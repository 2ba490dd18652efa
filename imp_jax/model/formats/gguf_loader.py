"""GGUF checkpoints: llama.cpp metadata -> HF config dict, lazily dequantised HF-named tensors, tokenizer.

Matches transformers' own GGUF loading (config keys, Q/K un-permutation, tokenizer conversion) so a
GGUF and the HF checkpoint it came from load to the same model. The common decoder's metadata keys and
tensor names are here; each family declares its own (its llama.cpp architectures, their keys and tensor
names: model/family.py's GGUFNames) in its own file, collected through the registry. The tokenizer
conversion lives in gguf_tokenizer.py.
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
from imp_jax.model import registry
from imp_jax.model.family import GGUFNames
from imp_jax.model.formats.gguf_file import GGUFFile
from imp_jax.model.formats.gguf_metadata import Metadata, f32
from imp_jax.model.text.gguf_tokenizer import gguf_tokenizer
from imp_jax.model.text.tokenizer import Tokenizer

log = logging.getLogger("imp_jax.gguf")

# every family's llama.cpp architectures (model/family.py), collected through the registry
GGUF_NAMES: tuple[GGUFNames, ...] = tuple(names for family in registry.families() for names in family.gguf)
# the common decoder's tensor names, GGUF -> HF; a family's GGUFNames.layer_names go over LAYER_NAMES
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# phi3: longrope's per-frequency divisors, folded into rope_scaling (not model weights)
_ROPE_FACTOR_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_names(arch: str, experts: bool = False) -> GGUFNames:
    """The declaration of a GGUF `arch` (one of ARCHITECTURES): its experts entry for a file with experts
    (a `llama` one is a Mixtral), where the family has one."""
    entries = [names for names in GGUF_NAMES if names.arch == arch]
    return next((names for names in entries if names.experts == experts), entries[0])


def layer_names(names: GGUFNames) -> dict[str, str]:
    """GGUF layer leaf -> HF leaf in a file of `names`: the common decoder's, under the family's own."""
    return {**LAYER_NAMES, **names.layer_names}


# GGUF `general.architecture` -> HF `architectures[0]` (of a file without experts, where the two differ)
ARCHITECTURES = {arch: gguf_names(arch).architecture for arch in dict.fromkeys(n.arch for n in GGUF_NAMES)}


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
    reader = open_gguf(path)
    with metadata_errors(path):
        meta = Metadata(reader, path)
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"{path}: GGUF architecture '{arch}' is not supported "
                                 f"(supported: {', '.join(ARCHITECTURES)})", code="unknown_architecture")
        raw = {t.name: t for t in reader.tensors}
        names = gguf_names(arch, experts=bool(meta.get(f"{arch}.expert_count")))
        hf_config = _hf_config(names, meta, raw)
        return GGUFCheckpoint(hf_config, _hf_tensors(names, raw, hf_config, path), *gguf_tokenizer(meta))


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


def open_gguf(path: Path) -> GGUFFile:
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


def _hf_config(names: GGUFNames, meta: Metadata, raw: dict[str, Any]) -> dict[str, Any]:
    """A HF config.json-style dict from `{arch}.*` metadata (transformers' GGUF_CONFIG_MAPPING): the common
    decoder's keys, then the family's (`names`)."""
    arch = names.arch
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
        "architectures": [names.architecture],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(meta.need(a("feed_forward_length"))),
        "num_hidden_layers": int(meta.need(a("block_count"))),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim or hidden // heads),
        "rms_norm_eps": f32(meta.get(a("attention.layer_norm_rms_epsilon"), 1e-6)),
        "rope_theta": f32(meta.get(a("rope.freq_base"), 10000.0)),
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
    for key, hf_key in names.metadata.items():   # plain renames, where the file sets them
        if meta.get(a(key)):
            cfg[hf_key] = meta.get(a(key))
    if names.config is not None:
        cfg.update(names.config(arch, meta, cfg, raw))
    return cfg


def _rope_scaling(arch: str, meta: Metadata, raw: dict[str, Any]) -> dict[str, Any] | None:
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


def _longrope(arch: str, meta: Metadata, raw: dict[str, Any], original: int | None) -> dict[str, Any]:
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
        out["attention_factor"] = f32(attn)
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


def _hf_tensors(names: GGUFNames, raw: dict[str, Any], cfg: dict[str, Any], path: Path) -> GGUFTensors:
    """Map GGUF tensor names to HF ones (`layer_names`); Q/K rows that llama.cpp permuted get un-permuted
    (heads for q, kv heads for k). A split `attn_qkv` (gpt-oss, convert_hf_to_gguf.py --fuse-qkv) is read as
    HF's q, k and v: row ranges of it."""
    entries: dict[str, tuple[Any, int | None]] = {}
    rows: dict[str, tuple[int, int]] = {}
    leaves = layer_names(names)
    unknown = []
    fused_gate_up = names.fused_gate_up and "blk.0.ffn_gate.weight" not in raw   # ffn_up holds gate|up
    for name, tensor in raw.items():
        if name == "rope_freqs.weight" or name in _ROPE_FACTOR_TENSORS:
            continue  # folded into rope_scaling
        stem, _, suffix = name.rpartition(".")
        if stem in TOP_NAMES:
            entries[f"{TOP_NAMES[stem]}.{suffix}"] = (tensor, None)
            continue
        m = _LAYER_RE.fullmatch(name)
        if m and m[2] == "attn_qkv" and names.split_qkv:
            q, kv = (cfg[k] * cfg["head_dim"] for k in ("num_attention_heads", "num_key_value_heads"))
            if int(tensor.shape[-1]) != q + 2 * kv:
                raise ModelLoadError(f"{path}: {name} has {int(tensor.shape[-1])} rows where q|k|v has {q + 2 * kv}")
            for proj, span in zip("qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv))):
                hf_name = f"model.layers.{m[1]}.self_attn.{proj}_proj.{m[3]}"
                entries[hf_name], rows[hf_name] = (tensor, None), span
            continue
        if not m or m[2] not in leaves:
            unknown.append(name)
            continue
        if m[2] in names.bare:   # HF's is a bare parameter, llama.cpp's a `.weight`
            entries[f"model.layers.{m[1]}.{leaves[m[2]]}"] = (tensor, None)
            continue
        heads = None
        if names.permuted_qk and m[2] in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if m[2] == "attn_q" else cfg["num_key_value_heads"]
        hf_leaf = "mlp.gate_up_proj" if fused_gate_up and m[2] == "ffn_up" else leaves[m[2]]
        entries[f"model.layers.{m[1]}.{hf_leaf}.{m[3]}"] = (tensor, heads)
    if unknown:
        raise ModelLoadError(f"{path}: tensors this loader cannot map for '{names.arch}' "
                             f"(mixture-of-experts or another variant?): {', '.join(unknown[:8])}")
    minus_one = frozenset(n for n in entries if names.norm_plus_one and n.endswith("norm.weight"))
    return GGUFTensors(entries, minus_one, rows)
