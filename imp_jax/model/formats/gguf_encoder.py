"""BERT embedding models from GGUF: llama.cpp's `bert` architecture, as convert_hf_to_gguf.py writes a
BertModel / sentence-transformers MiniLM.

The names are gguf-py's (gguf.constants, gguf.tensor_mapping): `token_embd`, `position_embd`,
`token_types`, `token_embd_norm`, `blk.N.attn_q|attn_k|attn_v` (or a fused `attn_qkv`), `attn_output`,
`attn_output_norm`, `ffn_up`, `ffn_down`, `layer_output_norm`; each maps back to its HF name, so
`Encoder.from_hf_tensors` builds the model, every tensor dequantised to float32 (F32, F16, BF16 and
whatever `gguf.quants.dequantize` reads: Q8_0, Q4_0, Q4_1, K-quants...).

Settings: pooling from `bert.pooling_type` (llama.cpp's enum: 1 mean, 2 cls, 3 last; absent: mean;
0 none and 4 rank are refused), always normalised to unit length (llama.cpp's embedding default;
GGUF keeps no trace of a sentence-transformers Normalize module), inputs capped at
`bert.context_length`. GGUF cross-encoders are refused: llama.cpp's converter drops a
BertForSequenceClassification's pooler, so the file cannot give HF's scores.

The vocabulary: `tokenizer.ggml.model = "bert"` (WordPiece) in llama.cpp's "phantom space" spelling
(a word-initial token carries a leading U+2581, a continuation has lost its `##`, control tokens
are as they were); it is turned back into a WordPiece vocabulary for the `tokenizers` package.
llama.cpp always lowercases; here the input is lowercased (and accents stripped) only when the
vocabulary has no upper-case ASCII letters (an uncased model), so a cased BERT keeps its case.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np
import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors

from imp_jax.errors import ModelLoadError
from imp_jax.model.architectures.bert import GGUF_LAYER_NAMES, GGUF_TOP_NAMES, EncoderConfig
from imp_jax.model.formats.gguf_loader import metadata_errors, open_gguf
from imp_jax.model.formats.gguf_metadata import Metadata, f32
from imp_jax.model.formats.gguf_file import GGUFFile

ARCH = "bert"
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}   # llama.cpp's enum llama_pooling_type (gguf.PoolingType)
_PHANTOM = "\u2581"
_CONTROL, _UNKNOWN = 3, 2   # gguf.TokenType
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def read_gguf_encoder(path: Path) -> tuple[GGUFFile, EncoderConfig, str, int]:
    """The opened file, its EncoderConfig, pooling and input cap; a ModelLoadError naming what is wrong."""
    reader = open_gguf(path)
    with metadata_errors(path):
        return _encoder_config(path, reader)


def _encoder_config(path: Path, reader: GGUFFile) -> tuple[GGUFFile, EncoderConfig, str, int]:
    meta = reader.fields
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise ModelLoadError(f"{path}: GGUF architecture '{arch}' is not an encoder this server runs (a GGUF "
                             f"embedding model must be llama.cpp's '{ARCH}': BertModel / MiniLM)",
                             code="unknown_architecture")
    need = lambda key: Metadata(reader, path).need(f"{ARCH}.{key}")  # noqa: E731
    if meta.get(f"{ARCH}.attention.causal", False):
        raise ModelLoadError(f"{path}: {ARCH}.attention.causal is true; an encoder attends both ways")
    pooling_type = meta.get(f"{ARCH}.pooling_type", 1)
    if pooling_type not in POOLING_TYPES:
        what = {0: "none (per-token embeddings)", 4: "rank (a cross-encoder: converted GGUF rerankers lose "
                "BERT's pooler, so they are not served; use the HF directory)"}.get(pooling_type, "unknown")
        raise ModelLoadError(f"{path}: {ARCH}.pooling_type {pooling_type} is {what}; supported: 1 mean, 2 cls, "
                             "3 last")
    tensors = {t.name: t for t in reader.tensors}
    if "cls.weight" in tensors or "cls.output.weight" in tensors:
        raise ModelLoadError(f"{path}: a classification head (cls.*): GGUF cross-encoders are not served")
    for name in ("token_embd.weight", "position_embd.weight"):
        if name not in tensors:
            raise ModelLoadError(f"{path}: GGUF lacks the tensor '{name}'")
    rows = lambda name: int(tensors[name].shape[1]) if len(tensors[name].shape) == 2 else 0  # noqa: E731
    types = rows("token_types.weight") if "token_types.weight" in tensors else 0
    try:
        config = EncoderConfig(
            "BertModel", rows("token_embd.weight"), int(need("embedding_length")), int(need("feed_forward_length")),
            int(need("block_count")), int(need("attention.head_count")), rows("position_embd.weight"),
            types or int(meta.get("tokenizer.ggml.token_type_count", 2)),
            f32(meta.get(f"{ARCH}.attention.layer_norm_epsilon", 1e-12)),
            int(meta.get("tokenizer.ggml.padding_token_id") or 0))
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{path}: bad metadata value ({e})") from None
    if config.hidden_size % config.num_heads:
        raise ModelLoadError(f"{path}: embedding_length {config.hidden_size} is not a multiple of "
                             f"attention.head_count {config.num_heads}")
    max_len = min(int(meta.get(f"{ARCH}.context_length") or config.max_position_embeddings),
                  config.max_position_embeddings)
    return reader, config, POOLING_TYPES[pooling_type], max_len


def gguf_encoder_tensors(reader: GGUFFile, config: EncoderConfig, path: Path) -> "GGUFEncoderTensors":
    """HF-named float32 tensors (as `Encoder.from_hf_tensors` reads them) of a `bert` GGUF file."""
    entries: dict[str, Callable[[], np.ndarray]] = {}
    unknown = []
    E = config.hidden_size
    for t in reader.tensors:
        stem, _, suffix = t.name.rpartition(".")
        if stem in GGUF_TOP_NAMES:
            entries[f"{GGUF_TOP_NAMES[stem]}.{suffix}"] = _reader(t)
            continue
        m = _LAYER_RE.fullmatch(t.name)
        if m and m[2] == "attn_qkv":   # fused q|k|v rows: split back into the three HF projections
            for k, part in enumerate(("query", "key", "value")):
                entries[f"encoder.layer.{m[1]}.attention.self.{part}.{m[3]}"] = _reader(t, slice(k * E, (k + 1) * E))
        elif m and m[2] in GGUF_LAYER_NAMES:
            entries[f"encoder.layer.{m[1]}.{GGUF_LAYER_NAMES[m[2]]}.{m[3]}"] = _reader(t)
        else:
            unknown.append(t.name)
    if unknown:
        raise ModelLoadError(f"{path}: tensors this loader cannot map for '{ARCH}' (another BERT variant?): "
                             f"{', '.join(unknown[:8])}")
    return GGUFEncoderTensors(entries)


class GGUFEncoderTensors(Mapping[str, np.ndarray]):
    """HF name -> float32 array, dequantised from the memory-mapped file on each access."""

    def __init__(self, entries: dict[str, Callable[[], np.ndarray]]):
        self._entries = entries

    def __getitem__(self, name: str) -> np.ndarray:
        return self._entries[name]()

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


def _reader(t: Any, rows: slice | None = None) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        from gguf.quants import dequantize

        w = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))
        if rows is not None:
            w = w[rows]
        return np.require(w, np.float32, ["C", "W", "O"])   # an F32 tensor is copied out of the mmap
    return read


def gguf_wordpiece(meta: dict[str, Any], path: Path) -> tokenizers.Tokenizer:
    """The WordPiece tokenizer of a `tokenizer.ggml.model = "bert"` vocabulary: BERT's normaliser and
    pre-tokenizer, [CLS] A [SEP] (B [SEP]) with segment ids 0 / 1, control tokens kept whole."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "bert":
        raise ModelLoadError(f"{path}: tokenizer.ggml.model '{kind}' is not supported for an encoder (only "
                             "'bert', WordPiece)")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF has no tokenizer vocabulary")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{path}: {len(types)} token types for {len(tokens)} tokens")
    phantom = any(t.startswith(_PHANTOM) for t in tokens)   # else an old file with the plain WordPiece spelling
    words = [_wordpiece(t, ty) if phantom else t for t, ty in zip(tokens, types)]
    vocab: dict[str, int] = {}
    for i, w in enumerate(words):
        vocab.setdefault(w, i)
    special = {key: meta.get(f"tokenizer.ggml.{key}_token_id") for key in
               ("cls", "bos", "seperator", "eos", "unknown")}
    cls_id = _special(special["cls"], special["bos"], vocab.get("[CLS]"), len(words))
    sep_id = _special(special["seperator"], special["eos"], vocab.get("[SEP]"), len(words))
    unk_id = _special(special["unknown"], None, vocab.get("[UNK]"), len(words))
    if cls_id is None or sep_id is None or unk_id is None:
        raise ModelLoadError(f"{path}: the vocabulary names no [CLS], [SEP] or [UNK] token")
    cls, sep, unk = words[cls_id], words[sep_id], words[unk_id]
    control = [i for i, ty in enumerate(types) if ty in (_CONTROL, _UNKNOWN)] or [cls_id, sep_id, unk_id]
    cased = any(re.search("[A-Z]", w) for i, w in enumerate(words)
                if types[i] not in (_CONTROL, _UNKNOWN) and not (w.startswith("[") and w.endswith("]")))
    tok = tokenizers.Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=not cased)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0", pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, cls_id), (sep, sep_id)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)
    tok.add_special_tokens([AddedToken(words[i], special=True, normalized=False) for i in control
                            if vocab.get(words[i]) == i])
    return tok


def _wordpiece(token: str, kind: int) -> str:
    """Undo convert_hf_to_gguf's phantom spelling: '\u2581word' -> 'word', 'piece' -> '##piece'."""
    if token.startswith(_PHANTOM):
        return token[1:]
    if kind in (_CONTROL, _UNKNOWN) or (len(token) > 2 and token[0] == "[" and token[-1] == "]"):
        return token   # control tokens are written as they are (older converters: any [BRACKETED] one)
    return "##" + token


def _special(*candidates: Any) -> int | None:
    *ids, n = candidates
    return next((int(i) for i in ids if isinstance(i, int) and 0 <= i < n), None)
