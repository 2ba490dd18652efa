"""IncrementalDetokenizer: deltas are complete UTF-8, add up to decode(), and cost O(1) per token."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from imp_jax.model.text.detokenizer import IncrementalDetokenizer
from imp_jax.model.text.tokenizer import Tokenizer

CORPUS = [
    "héllo wörld 你好 🙂 the quick brown fox",
    "naïve café 日本語 🙂🙃 ünïcödé, hello world",
    "over the lazy dog 你好世界 🎉",
] * 10
TEXTS = ["héllo wörld 你好 🙂", "a  b\n\tc 🙃🙃 日本語!", "double  spaces 🎉 and 👩‍👩‍👧 family", "x"]


def byte_level_tokenizer() -> Tokenizer:
    """A small GPT-2 style byte-level BPE: multi-byte characters often span several tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return Tokenizer(tok, bos_token=None, eos_token="<|endoftext|>", add_bos=False, add_eos=False,
                     chat_template=None)


def sentencepiece_tokenizer() -> Tokenizer:
    """A Llama-2 style tokenizer: Metaspace, byte fallback, and a decoder that strips the first space."""
    base = HFTokenizer(models.BPE(unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    base.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog"] * 10,
                             trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"],
                                                 show_progress=False))
    model = json.loads(base.to_str())["model"]
    vocab = dict(model["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = HFTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return Tokenizer(tok, bos_token="<s>", eos_token="</s>", add_bos=True, add_eos=False, chat_template=None)


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return byte_level_tokenizer() if request.param == "byte_level" else sentencepiece_tokenizer()


def stream(tokenizer: Tokenizer, ids: list[int], chunks: list[int] | None = None,
           skip_special_tokens: bool = True) -> list[str]:
    """Feed `ids` in chunks of the given sizes (1 by default); return the deltas, flush() last."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    final = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    deltas, emitted, i = [], "", 0
    for size in chunks or [1] * len(ids):
        piece = ids[i:i + size]
        i += size
        delta = detok.add(piece)
        delta.encode("utf-8")  # no lone surrogates
        emitted += delta
        assert final.startswith(emitted), (ids, emitted, final)  # nothing emitted is ever revised
        assert not delta.endswith("\ufffd"), "a U+FFFD at the end of a delta may be a half character"
        deltas.append(delta)
    deltas.append(detok.flush())
    assert detok.token_ids == ids
    return deltas


def test_text_roundtrip_one_token_at_a_time(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        deltas = stream(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)


def test_byte_fallback_run_is_held_until_it_ends() -> None:
    tok = sentencepiece_tokenizer()
    ids = tok.encode("a🙂b", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁", "a", "<0xF0>", "<0x9F>", "<0x99>", "<0x82>", "b"]
    # ByteFallback turns a whole run into U+FFFDs if a later byte is invalid, so a run is final only when it ends
    assert stream(tok, ids) == ["", "a", "", "", "", "", "🙂b", ""]
    assert stream(tok, ids[:-1]) == ["", "a", "", "", "", "", "🙂"]


def test_byte_fallback_run_made_invalid_by_a_later_byte() -> None:
    tok = sentencepiece_tokenizer()
    byte = {b: tok.token_to_id(f"<0x{b:02X}>") for b in (0x6A, 0xF8)}
    ids = tok.encode("x", add_special_tokens=False) + [byte[0x6A], byte[0xF8]] + tok.encode(
        "y", add_special_tokens=False)
    assert tok.decode(ids) == "x\ufffd\ufffd y"  # the valid "j" became U+FFFD too
    assert "".join(stream(tok, ids)) == tok.decode(ids)


def test_split_cjk_in_byte_level_tokens() -> None:
    tok = byte_level_tokenizer()
    byte_ids = [tok.token_to_id(c) for c in "ä½ł"]  # the byte-level spelling of 你 = E4 BD A0, one byte per token
    assert tok.decode(byte_ids) == "你"
    assert stream(tok, byte_ids) == ["", "", "你", ""]


def test_random_ids_concat_equals_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(1234)
    vocab = tokenizer.vocab_size
    byte_heavy = [i for i in range(vocab) if len(tokenizer.decode([i], skip_special_tokens=False)) <= 1]
    for trial in range(300):
        pool = byte_heavy if trial % 2 else range(vocab)
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        chunks, left = [], len(ids)
        while left:
            chunks.append(min(left, rng.randint(1, 3)))
            left -= chunks[-1]
        for skip in (True, False):
            deltas = stream(tokenizer, ids, chunks, skip_special_tokens=skip)
            assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_special_token_mid_stream_keeps_following_space() -> None:
    tok = sentencepiece_tokenizer()
    ids = tok.encode("hello", add_special_tokens=False) + [tok.eos_id] + tok.encode(
        "world", add_special_tokens=False)
    assert tok.decode(ids) == "hello world"
    assert "".join(stream(tok, ids)) == "hello world"
    assert "".join(stream(tok, ids, skip_special_tokens=False)) == tok.decode(ids, skip_special_tokens=False)


def test_prompt_context_keeps_leading_space_of_first_token() -> None:
    tok = sentencepiece_tokenizer()
    prompt = tok.encode("the quick brown")
    output = tok.encode("fox jumps", add_special_tokens=False)
    assert tok.decode(output) == "fox jumps"
    with_prompt = IncrementalDetokenizer(tok, prompt_ids=prompt)
    assert "".join(with_prompt.add([i]) for i in output) + with_prompt.flush() == " fox jumps"
    assert with_prompt.token_ids == output
    assert "".join(stream(tok, output)) == "fox jumps"


def test_prompt_context_is_invisible_for_byte_level() -> None:
    tok = byte_level_tokenizer()
    prompt = tok.encode("héllo 你")
    output = tok.encode("好 🙂 wörld", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt_ids=np.array(prompt))  # engines may hold ids in arrays
    assert "".join(detok.add(np.array([i])) for i in output) + detok.flush() == tok.decode(output) == "好 🙂 wörld"


class _CountingTokenizer:
    """Wraps a Tokenizer and records the longest id list ever decoded."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.longest = inner, 0
        self.special_ids, self.byte_fallback_ids = inner.special_ids, inner.byte_fallback_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small_over_long_streams(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 40, add_special_tokens=False)
    assert len(ids) > 1000
    counting = _CountingTokenizer(tokenizer)
    prompt = tokenizer.encode(TEXTS[0])
    detok = IncrementalDetokenizer(counting, prompt_ids=prompt)  # type: ignore[arg-type]
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert counting.longest <= 32  # a window: the last emitted piece plus what is held back
    if tokenizer.bos_id is None:  # byte-level: context never changes the text
        assert text == tokenizer.decode(ids)


def test_add_nothing_and_flush_twice() -> None:
    tok = byte_level_tokenizer()
    detok = IncrementalDetokenizer(tok)
    assert detok.add([]) == ""
    assert detok.flush() == ""
    assert detok.add(tok.encode("hi", add_special_tokens=False)) == "hi"
    assert detok.flush() == ""
