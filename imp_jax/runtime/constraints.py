"""Grammar-constrained decoding: each constrained sequence's llguidance matcher gives the
allowed-token bitmask of its next token (the sampler's `allowed_mask`) and follows every token
sampled, so the output always parses. EOS is allowed exactly where the grammar accepts.

The engine knows grammars only as llguidance's grammar strings (`GenerationRequest.constraint`,
built and validated by the server from a JSON schema, a regex, Lark, GBNF or choices).
"""
from __future__ import annotations

import threading

import numpy as np

from imp_jax.errors import InvalidRequestError
from imp_jax.model.tokenizer import Tokenizer


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: "object"):
        self._m = matcher

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the next token's allowed bitmask into `row` (int32 or uint32 [ceil(V/32)], contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> None:
        """Advance past a sampled token (one the last mask allowed)."""
        self._m.consume_token(token)

    @property
    def failed(self) -> str | None:
        """Why the matcher stopped following the output (None while it follows)."""
        return self._m.get_error() if self._m.is_error() else None


class GrammarConstraints:
    """The model's tokenizer as llguidance sees it (built on first use, ~1 s), and matchers from it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._llt = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> object:
        import llguidance

        with self._lock:
            if self._llt is None:
                self._llt = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                                                   eos_token=sorted(self._tokenizer.eos_ids)[0])
            return self._llt

    def matcher(self, grammar: str) -> GrammarMatcher:
        """A fresh matcher at the start of `grammar`; a 400 if llguidance cannot compile it."""
        import llguidance

        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar)
        if m.is_error():
            raise InvalidRequestError(f"the output constraint does not compile: {m.get_error()}",
                                      param="response_format")
        return GrammarMatcher(m)
