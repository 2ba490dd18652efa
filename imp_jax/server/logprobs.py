"""Engine TokenLogprobs in OpenAI's two wire shapes: Chat (`content[]`) and legacy Completions (parallel lists)."""
from __future__ import annotations

import math
from typing import Any

from imp_jax.runtime.request import TokenLogprob

# JSON has no -Infinity: a masked token (probability 0) reads as this, as in vLLM.
_FLOOR = -9999.0


def finite(logprob: float) -> float:
    """A logprob JSON can carry."""
    return logprob if math.isfinite(logprob) else _FLOOR


class TokenText:
    """Token id -> its text, as a logprob entry shows it (special tokens spelled out), memoised per request."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


def _chat_entry(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob], token_text: TokenText) -> list[dict[str, Any]]:
    """`choices[].logprobs.content`: one {token, logprob, bytes, top_logprobs} per sampled token."""
    out = []
    for e in entries:
        item = _chat_entry(token_text(e.token_id), e.logprob)
        item["top_logprobs"] = [_chat_entry(token_text(t), lp) for t, lp in e.top]
        if e.lens is not None:   # logit_lens: one reading per layer, first to last
            item["logit_lens"] = [{"rank": layer.rank, "logprob": finite(layer.logprob), "entropy": layer.entropy,
                                   "top": [{"token": token_text(t), "logprob": finite(lp)} for t, lp in layer.top]}
                                  for layer in e.lens]
        out.append(item)
    return out


class LegacyLogprobs:
    """Completions' `{tokens, token_logprobs, top_logprobs, text_offset}`, built up event by event."""

    def __init__(self, token_text: TokenText, text_offset: int = 0):
        self._token_text = token_text
        self._offset = text_offset

    def prompt(self, token_ids: list[int]) -> dict[str, Any]:
        """Echoed prompt tokens with no logprobs of their own (only the text and offsets)."""
        part = self._empty()
        for t in token_ids:
            self._add(part, self._token_text(t), None, None)
        return part

    def scored_prompt(self, ids: list[int], entries: list[TokenLogprob | None], top_k: int) -> dict[str, Any]:
        """Echoed prompt tokens with their prompt logprobs; the first token has none (nulls)."""
        part = self._empty()
        for tok, e in zip(ids, entries):
            if e is None:
                self._add(part, self._token_text(tok), None, None)
                continue
            top: dict[str, float] = {}
            for t, lp in e.top[:top_k]:
                top.setdefault(self._token_text(t), finite(lp))
            self._add(part, self._token_text(e.token_id), finite(e.logprob), top)
        return part

    def chunk(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        """The legacy lists for `entries`; offsets continue from the previous call."""
        part = self._empty()
        for e in entries:
            top = {}
            for t, lp in e.top:
                top.setdefault(self._token_text(t), finite(lp))
            self._add(part, self._token_text(e.token_id), finite(e.logprob), top)
        return part

    def _add(self, part: dict[str, Any], text: str, logprob: float | None, top: dict[str, float] | None) -> None:
        part["tokens"].append(text)
        part["token_logprobs"].append(logprob)
        part["top_logprobs"].append(top)
        part["text_offset"].append(self._offset)
        self._offset += len(text)

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def merge_legacy(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate legacy logprob parts (prompt echo, then completion) into one."""
    out = LegacyLogprobs._empty()
    for p in parts:
        for k in out:
            out[k].extend(p[k])
    return out


def prompt_logprobs_json(entries: list[TokenLogprob | None], top_k: int, token_text: TokenText
                         ) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token {"<id>": {logprob, rank, decoded_token}}, the token plus the top k."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        row = {str(e.token_id): {"logprob": finite(e.logprob), "rank": e.rank, "decoded_token": token_text(e.token_id)}}
        for rank, (t, lp) in enumerate(e.top[:top_k], start=1):
            row.setdefault(str(t), {"logprob": finite(lp), "rank": rank, "decoded_token": token_text(t)})
        out.append(row)
    return out
