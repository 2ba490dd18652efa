"""A GGUF file's tokenizer, converted as transformers does (integrations/gguf/gguf_tokenizer_mapping.py):
byte-level BPE (`gpt2`) or SentencePiece BPE (`llama`) vocabularies, special and user-defined
tokens, end-of-generation ids, FIM tokens and chat templates from the file's metadata."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from imp_jax.errors import ModelLoadError
from imp_jax.model.text.tokenizer import Tokenizer, detect_fim_tokens


class Metadata(Protocol):
    """What the conversion reads of a GGUF file's key/value metadata (model/formats/gguf_metadata.py: Metadata)."""

    path: Path
    values: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any: ...

    def need(self, key: str) -> Any: ...


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
              "<|end_of_text|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>"}
# harmony (gpt-oss): <|return|> and <|call|> end a reply; its <|end|> only ends one message of it
_HARMONY_ENDS = {"<|return|>", "<|call|>"}
_CONTROL, _USER_DEFINED = 3, 4


def gguf_tokenizer(meta: Metadata) -> tuple[Tokenizer, dict[str, Any]]:
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
    if _HARMONY_ENDS <= {t for t, ty in zip(tokens, types) if ty == _CONTROL}:   # as llama.cpp does
        extra = [i for i in extra if i is None or not 0 <= i < len(tokens) or tokens[i] != "<|end|>"]
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


def _chat_templates(meta: Metadata) -> str | dict[str, str] | None:
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
