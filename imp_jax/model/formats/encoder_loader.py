"""Load an encoder (model/architectures/bert.py) from an HF directory, with its tokenizer and sentence-transformers settings.

Pooling and normalisation come from the checkpoint's sentence-transformers files: modules.json
lists the modules (a `Pooling` module's config names the mode; a `Normalize` module means unit
vectors) and sentence_bert_config.json may cap the input length (`max_seq_length`). Without them,
an embedding model pools by mean and does not normalise. A `.gguf` file is read by gguf_encoder.py
(llama.cpp's `bert` architecture: its settings come from the file's metadata).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import tokenizers

from imp_jax.errors import ModelLoadError
from imp_jax.model.architectures.bert import Encoder, EncoderConfig
from imp_jax.model.config import read_json
from imp_jax.model.formats.hub import resolve_model
from imp_jax.model.formats.loader import SafetensorsDir
from imp_jax.model.weights import WeightSource

log = logging.getLogger("imp_jax.loader")
_POOLING_KEYS = (("pooling_mode_cls_token", "cls"), ("pooling_mode_mean_tokens", "mean"),
                 ("pooling_mode_lasttoken", "last"), ("pooling_mode_max_tokens", "max"))


@dataclasses.dataclass(frozen=True)
class EncoderSettings:
    """What the checkpoint says about serving it: the task, pooling, normalisation, the input cap."""

    task: str              # "embed" | "score" (a cross-encoder)
    pooling: str = "mean"
    normalize: bool = False
    max_len: int = 512


class EncoderTokenizer:
    """The HF tokenizer of an encoder with its own padding and truncation off (the engine pads to
    buckets); `encode` adds [CLS] / [SEP] (or <s> / </s>) and gives segment (token type) ids."""

    def __init__(self, tok: tokenizers.Tokenizer):
        tok.no_padding()
        tok.no_truncation()
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: Path) -> "EncoderTokenizer":
        f = path / "tokenizer.json"
        if not f.is_file():
            raise ModelLoadError(f"tokenizer file not found: {f}")
        try:
            return cls(tokenizers.Tokenizer.from_file(str(f)))
        except Exception as e:
            raise ModelLoadError(f"{f}: unreadable tokenizer ({e})") from None

    def encode(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        """(ids, type ids) of `text`, or of the pair (`text`, `pair`) as a cross-encoder reads it."""
        enc = self._tok.encode(text, pair) if pair is not None else self._tok.encode(text)
        return enc.ids, enc.type_ids

    def encode_batch(self, texts: list[str]) -> list[tuple[list[int], list[int]]]:
        return [(e.ids, e.type_ids) for e in self._tok.encode_batch(texts)]

    def encode_pairs(self, query: str, docs: list[str]) -> list[tuple[list[int], list[int]]]:
        return [(e.ids, e.type_ids) for e in self._tok.encode_batch([(query, d) for d in docs])]


@dataclasses.dataclass
class LoadedEncoder:
    model: Encoder
    config: EncoderConfig
    settings: EncoderSettings
    tokenizer: EncoderTokenizer
    served_name: str
    path: Path
    dtype: Any


def read_settings(path: Path, config: EncoderConfig) -> EncoderSettings:
    """The task from the architecture; pooling, normalisation and the input cap from sentence-transformers."""
    task = "score" if config.num_labels else "embed"
    if config.num_labels > 1:
        raise ModelLoadError(f"{path}: a cross-encoder with {config.num_labels} labels cannot rank (only a "
                             "1-label relevance head can)")
    max_len = config.max_len
    st = path / "sentence_bert_config.json"
    if st.is_file():
        cap = (read_json(st) or {}).get("max_seq_length")
        if isinstance(cap, int) and 0 < cap < max_len:
            max_len = cap
    pooling, normalize = "mean", False
    modules_file = path / "modules.json"
    if task == "embed" and modules_file.is_file():
        modules = read_json(modules_file)
        if not isinstance(modules, list):
            raise ModelLoadError(f"{modules_file}: expected a list of modules")
        for m in modules:
            kind = str(m.get("type", "")) if isinstance(m, dict) else ""
            if kind.endswith(".Normalize"):
                normalize = True
            elif kind.endswith(".Pooling"):
                pooling = _pooling_mode(path / str(m.get("path", "")) / "config.json")
    return EncoderSettings(task, pooling, normalize, max_len)


def _pooling_mode(f: Path) -> str:
    try:
        cfg = read_json(f)
    except FileNotFoundError:
        raise ModelLoadError(f"{f}: the Pooling module's config is missing") from None
    if isinstance(cfg.get("pooling_mode"), str):   # newer sentence-transformers spell it out
        mode = {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max"}.get(cfg["pooling_mode"])
        if mode:
            return mode
    modes = [name for key, name in _POOLING_KEYS if cfg.get(key)]
    if len(modes) != 1:
        raise ModelLoadError(f"{f}: pooling must be exactly one of cls, mean, lasttoken, max "
                             f"(found {modes or 'none'}; mean_sqrt_len is not supported)")
    return modes[0]


def load_encoder(name_or_path: str | Path, dtype: Any = jnp.float32) -> LoadedEncoder:
    """Resolve (path or alias), read and build an encoder; a ModelLoadError says what is wrong."""
    t0 = time.perf_counter()
    resolved = resolve_model(str(name_or_path))
    path = resolved.path
    if resolved.kind == "gguf":
        config, settings, tokenizer, weights = _read_gguf(path)
    elif resolved.kind == "hf_dir":
        config = EncoderConfig.from_hf(read_json(path / "config.json"), str(path / "config.json"))
        settings = read_settings(path, config)
        tokenizer = EncoderTokenizer.from_dir(path)
        weights = WeightSource(SafetensorsDir(path), source=str(path))
    else:
        raise ModelLoadError(f"{path}: an embedding or rerank model must be an HF directory (config.json, "
                             "*.safetensors, tokenizer.json) or a BERT GGUF file; converted encoders are not "
                             "supported")
    model = Encoder.from_hf_tensors(config, weights, dtype)
    log.info("loaded encoder %s (%s, %s, %d layers, hidden %d, %s pooling%s, max %d tokens) in %.1fs",
             resolved.served_name, config.architecture, settings.task, config.num_layers, config.hidden_size,
             settings.pooling, ", normalized" if settings.normalize else "", settings.max_len,
             time.perf_counter() - t0)
    return LoadedEncoder(model, config, settings, tokenizer, resolved.served_name, path, dtype)


def _read_gguf(path: Path) -> tuple[EncoderConfig, EncoderSettings, EncoderTokenizer, WeightSource]:
    """A llama.cpp `bert` GGUF: config, settings (always normalised), WordPiece tokenizer, float32 tensors."""
    from imp_jax.model.formats.gguf_encoder import gguf_encoder_tensors, gguf_wordpiece, read_gguf_encoder

    reader, config, pooling, max_len = read_gguf_encoder(path)
    tokenizer = EncoderTokenizer(gguf_wordpiece(reader.fields, path))
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(f"{path}: {tokenizer.vocab_size} tokens for a {config.vocab_size}-row token_embd")
    weights = WeightSource(gguf_encoder_tensors(reader, config, path), source=str(path))
    return config, EncoderSettings("embed", pooling, True, max_len), tokenizer, weights
