"""GGUF checkpoints: llama.cpp metadata -> HF config dict, lazily dequantised HF-named tensors, tokenizer.

Matches transformers' own GGUF loading (config keys, Q/K un-permutation, tokenizer conversion) so a
GGUF and the HF checkpoint it came from load to the same model.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from imp_jax.kernels_pallas import quant
from imp_jax.errors import ModelLoadError
from imp_jax.model.tokenizer import Tokenizer, detect_fim_tokens

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
        """A matrix's GGML blocks as stored, uint8 [rows, K / 32, block bytes] (kernels_pallas/quant.py),
        when its type is one the CPU GEMM kernel reads; else None. Q/K rows are un-permuted as in
        `__getitem__`."""
        tensor, heads = self._entries[name]
        fmt, shape = tensor.tensor_type.name, self.shape(name)
        if fmt not in quant.FORMATS or len(shape) != 2 or shape[1] % quant.BLOCK:
            return None
        b = np.asarray(tensor.data).reshape(shape[0], shape[1] // quant.BLOCK, quant.FORMATS[fmt])
        if heads is not None:
            b = unpermute_rotary(b, heads)
        return np.ascontiguousarray(b)   # a copy out of the mmap

    def shape(self, name: str) -> tuple[int, ...]:
        """numpy shape of a tensor without reading it (GGUF stores dims innermost-first)."""
        return tuple(int(d) for d in reversed(self._entries[name][0].shape))

    def qtype(self, name: str) -> str:
        """The GGML storage type of a tensor, e.g. 'Q4_1' or 'F32'."""
        return self._entries[name][0].tensor_type.name

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
    return GGUFCheckpoint(hf_config, _hf_tensors(arch, raw, hf_config, path), *_tokenizer(meta))


def _open(path: Path) -> Any:
    import gguf

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (bad magic {magic!r})")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on a bad file
        raise ModelLoadError(f"{path}: unreadable GGUF file ({type(e).__name__}: {e})") from None


class _Metadata:
    """The file's key/value metadata as Python values."""

    def __init__(self, reader: Any, path: Path):
        self.path = path
        self.values: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}

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


# --- tokenizer: transformers' GGUF conversion (integrations/gguf/gguf_tokenizer_mapping.py) ---

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` -> split regex; any other value keeps GPT-2's ByteLevel regex (as transformers does)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}
# control tokens llama.cpp also treats as end-of-generation, beyond the file's eos/eot/eom ids
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
              "<|end_of_text|>", "<｜end▁of▁sentence｜>"}
_CONTROL, _USER_DEFINED = 3, 4


def _tokenizer(meta: _Metadata) -> tuple[Tokenizer, dict[str, Any]]:
    """The vocabulary's tokenizer (byte-level BPE or SentencePiece BPE) and generation defaults."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{meta.path}: GGUF has no tokenizer vocabulary")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, meta.need("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.pre"))
    elif kind == "llama":
        tok = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores"), meta.get("tokenizer.ggml.merges"))
    else:
        raise ModelLoadError(f"{meta.path}: GGUF tokenizer model '{kind}' is not supported (supported: gpt2, llama)")
    _add_special_tokens(tok, tokens, types, byte_level=kind == "gpt2")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    named = {k: token(f"{k}_token_id") for k in ("bos", "eos", "unknown", "padding")}
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    extra = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    extra += [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _CONTROL and t in _EOG_TEXTS]
    extra_eos = tuple(dict.fromkeys(i for i in extra if i is not None and i != eos_id))
    fim = {k: token(f"fim_{k[:3]}_token_id") or token(f"{k}_token_id") for k in ("prefix", "suffix", "middle")}
    wrapped = Tokenizer(
        tok,
        bos_token=named["bos"],
        eos_token=named["eos"],
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=_chat_templates(meta),
        pad_token=named["padding"],
        unk_token=named["unknown"],
        extra_eos_ids=extra_eos,
        fim_tokens=fim if all(fim.values()) else detect_fim_tokens(tok),
    )
    eos_ids = [i for i in (eos_id, *extra_eos) if i is not None]
    gen = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
           "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    return wrapped, {k: v for k, v in gen.items() if v is not None}


def _chat_templates(meta: _Metadata) -> str | dict[str, str] | None:
    """`tokenizer.chat_template`, plus named ones (`tokenizer.chat_template.<name>`, e.g. tool_use)."""
    prefix = "tokenizer.chat_template."
    named = {k[len(prefix):]: v for k, v in meta.values.items() if k.startswith(prefix) and isinstance(v, str)}
    default = meta.get("tokenizer.chat_template")
    return {"default": default, **named} if named and default else named or default


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str | None) -> Any:
    """GPT-2 style byte-level BPE; tokens spelled outside the byte alphabet are re-spelled into it."""
    from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    tok = HFTokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float] | None, merges: list[str] | None) -> Any:
    """SentencePiece-BPE (Llama 1/2, Mistral): Metaspace, byte fallback, merges from the file or scores."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [tuple(m.split(" ")) for m in merges]
    else:
        pairs = _merges_from_scores(vocab, dict(zip(tokens, scores or [0.0] * len(tokens))))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(content=" ", left=1)])
    return tok


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary pieces, best score first (transformers' generate_merges)."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _add_special_tokens(tok: Any, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (kept whole).

    A control token spelled outside the byte alphabet of a byte-level vocabulary is a llama.cpp mislabel
    and is skipped, as transformers does.
    """
    from tokenizers import AddedToken

    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == _CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
            if ty == _USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in bs]
    cs = bs + [256 + n for n in range(len(extra))]
    return {b: chr(c) for b, c in zip(bs + extra, cs)}
