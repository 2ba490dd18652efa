"""Incremental detokenization: token ids in, text deltas out, always complete UTF-8, O(1) work per token."""
from __future__ import annotations

from collections.abc import Sequence

from imp_jax.model.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
# Prompt tokens decoded before the first output token, so it is spelled as a continuation would be.
_PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Decodes a growing token sequence by re-decoding only a short window of recent tokens.

    Invariants: a delta never ends in a character still being assembled from byte tokens
    (U+FFFD at the end of a decode, and an unfinished run of SentencePiece "<0xNN>" tokens, are
    held back until more tokens arrive or `flush()`), emitted text is never revised, and with
    prompt_ids=None, "".join(deltas) + flush() == tokenizer.decode(all ids added).
    With prompt_ids the text is the continuation of the prompt: a SentencePiece first token
    keeps its leading space (what a plain completion wants; leave it None for chat replies).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._silent = tokenizer.special_ids if skip_special_tokens else frozenset()
        self._byte_tokens = tokenizer.byte_fallback_ids
        self._ids = [] if prompt_ids is None else [int(i) for i in prompt_ids[-_PROMPT_CONTEXT:]]
        self._first_output = len(self._ids)
        # The window ids[prefix:] is what gets decoded. `prefix` sits on a character boundary and on a
        # token that produces text, so the window decodes as the tail of the whole sequence would
        # (SentencePiece drops the leading space of a decode's first token: both decodes lose the same one).
        self._prefix = self._first_text_token(0, len(self._ids))
        self._read = len(self._ids)  # text of ids[:read] is all emitted (or is prompt)
        self._prefix_len = len(self._decode(self._ids[self._prefix:]).rstrip(_REPLACEMENT))
        self._held_emitted = 0  # chars emitted past prefix_len from ids[read:] while their tail is held back

    @property
    def token_ids(self) -> list[int]:
        """The output token ids added so far."""
        return self._ids[self._first_output:]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (possibly "")."""
        if len(token_ids) == 0:
            return ""
        self._ids.extend(int(i) for i in token_ids)
        if self._in_byte_run():
            return ""  # ByteFallback decodes a byte run as a whole: its text is final only when the run ends
        text = self._decode(self._ids[self._prefix:])
        stable = text.rstrip(_REPLACEMENT)  # a trailing U+FFFD may be a character still missing bytes
        delta = stable[self._prefix_len + self._held_emitted:]
        if len(stable) == len(text):
            self._advance()
        else:
            self._held_emitted += len(delta)
        return delta

    def flush(self) -> str:
        """At the end of the stream: the text held back (incomplete bytes, which decode() shows as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        text = self._decode(self._ids[self._prefix:])
        delta = text[self._prefix_len + self._held_emitted:]
        self._advance()
        return delta

    def snapshot(self) -> tuple:
        """The state before the next `add`, for `restore` (a banned phrase rewinds the output: runtime/decoding/banned.py)."""
        return len(self._ids), self._prefix, self._read, self._prefix_len, self._held_emitted

    def restore(self, state: tuple) -> None:
        """Back to a `snapshot`: the tokens added since are forgotten, as is their text."""
        n, self._prefix, self._read, self._prefix_len, self._held_emitted = state
        del self._ids[n:]

    def _advance(self) -> None:
        """Everything so far is emitted: slide the window up to the tokens just read."""
        start = self._first_text_token(self._read, len(self._ids))
        if start < len(self._ids):
            self._prefix = start
        self._read = len(self._ids)
        self._held_emitted = 0
        self._prefix_len = len(self._decode(self._ids[self._prefix:]))

    def _in_byte_run(self) -> bool:
        """Whether the last token decode sees is a ByteFallback byte token (its run may still grow)."""
        if not self._byte_tokens:
            return False
        for i in range(len(self._ids) - 1, self._read - 1, -1):
            if self._ids[i] not in self._silent:
                return self._ids[i] in self._byte_tokens
        return False

    def _first_text_token(self, start: int, stop: int) -> int:
        """The first index in [start, stop) whose token is not dropped by decode; `stop` if none."""
        for i in range(start, stop):
            if self._ids[i] not in self._silent:
                return i
        return stop

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)
