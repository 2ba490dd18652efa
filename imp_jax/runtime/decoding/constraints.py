"""Grammar-constrained decoding: each constrained sequence's llguidance matcher gives the
allowed-token bitmask of its next token (the sampler's `allowed_mask`) and follows every token
sampled, so the output always parses. EOS is allowed exactly where the grammar accepts.

The engine knows grammars as llguidance's grammar strings (`GenerationRequest.constraint`, built
and validated by the server from a JSON schema, a regex, Lark, GBNF or choices: see
server/structured.py). Compiling one takes up to ~1 s, so it never happens on the engine thread:
`prepare` compiles (or finds in the LRU of COMPILED_CACHE) on a worker thread before admission
(AsyncEngine.generate) and returns a CompiledGrammar the request carries
(`GenerationRequest.compiled_constraint`); the engine thread only copies it (microseconds), however
many other grammars went through the cache since.

One GrammarConstraints per tokenizer (`for_tokenizer`), shared by the server and the engine.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any

import numpy as np

from imp_jax.errors import InvalidRequestError
from imp_jax.model.text.tokenizer import Tokenizer

COMPILED_CACHE = 64  # compiled grammars kept for reuse (agents send the same schema with every request)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any):
        self._m = matcher

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the next token's allowed bitmask into `row` (int32 or uint32 [ceil(V/32)], contiguous)."""
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the matcher then stops
        following: only a request whose logit_bias bans every token the grammar allows gets here)."""
        return bool(self._m.consume_token(token))

    @property
    def failed(self) -> str | None:
        """Why the matcher stopped following the output (None while it follows)."""
        return self._m.get_error() if self._m.is_error() else None


@dataclasses.dataclass(frozen=True)
class CompiledGrammar:
    """A grammar compiled against the tokenizer: a matcher at its start, copied for each sequence."""

    grammar: str
    compiled: Any


class GrammarConstraints:
    """The model's tokenizer as llguidance sees it (built on first use, ~0.3 s), compiled grammars,
    matchers from them, and the batched mask fill."""

    _shared: dict[int, GrammarConstraints] = {}
    _shared_lock = threading.Lock()

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._llt = None
        self._executor = None
        self._lock = threading.Lock()
        self._compiled: collections.OrderedDict[str, Any] = collections.OrderedDict()

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarConstraints:
        """The one instance for `tokenizer` (the server validates with it, the engine decodes with it)."""
        with cls._shared_lock:
            found = cls._shared.get(id(tokenizer))
            if found is None or found._tokenizer is not tokenizer or found._vocab_size != vocab_size:
                found = cls._shared[id(tokenizer)] = cls(tokenizer, vocab_size)
            return found

    @property
    def mask_words(self) -> int:
        """32-bit words in one row's bitmask."""
        return -(-self._vocab_size // 32)

    def _ll_tokenizer(self) -> Any:
        import llguidance

        with self._lock:
            if self._llt is None:
                # a complete grammar allows every id that ends a sequence (end of turn, end of text), the
                # tokenizer's own EOS first
                first = self._tokenizer.eos_id
                eos = sorted(self._tokenizer.eos_ids, key=lambda t: (t != first, t))
                self._llt = llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                                                   eos_token=eos or None)
            return self._llt

    def compile(self, grammar: str) -> str | None:
        """Compile `grammar` against the tokenizer and keep it; returns llguidance's error, or None.

        Blocking (up to ~1 s for a huge grammar; llguidance drops the GIL meanwhile): the server
        calls it on a worker thread while parsing the request."""
        import llguidance

        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return None
        m = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if m.is_error():
            return m.get_error()
        with self._lock:
            self._compiled[grammar] = m
            while len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        return None

    def prepare(self, grammar: str) -> CompiledGrammar:
        """`grammar` compiled (blocking: call it off the engine thread); a 400 if it does not compile."""
        import llguidance

        with self._lock:
            compiled = self._compiled.get(grammar)
        if compiled is None:
            error = self.compile(grammar)
            if error is not None:
                raise InvalidRequestError(f"the output constraint does not compile: {error}",
                                          param="response_format")
            with self._lock:
                compiled = self._compiled.get(grammar)
            if compiled is None:  # evicted meanwhile by other grammars: compile a private one
                compiled = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        return CompiledGrammar(grammar, compiled)

    def matcher(self, grammar: str, prepared: CompiledGrammar | None = None) -> GrammarMatcher:
        """A fresh matcher at the start of `grammar`: a copy of `prepared` (never a compile, for the engine
        thread); without one, `prepare` runs here (synchronous callers: the offline API, tests)."""
        if prepared is None or prepared.grammar != grammar:
            prepared = self.prepare(grammar)
        return GrammarMatcher(prepared.compiled.deep_copy())

    def fill_masks(self, matchers: list[GrammarMatcher], out: np.ndarray) -> None:
        """Every matcher's next-token bitmask into `out` (int32 [len(matchers), mask_words], C-contiguous),
        in one call that drops the GIL and spreads the rows over llguidance's thread pool (one row: directly)."""
        import llguidance
        import llguidance.numpy as llnp

        if len(matchers) == 1:
            matchers[0].fill_mask(out[0])
            return
        if self._executor is None:  # every core: the step's own threads are idle while masks are computed
            self._executor = llguidance.LLExecutor(num_threads=min(32, _cores()))
        llnp.fill_next_token_bitmask_par(self._executor, [(m._m, i) for i, m in enumerate(matchers)], out)


def _cores() -> int:
    """CPUs this process may run on (llguidance's own default takes 80% of them: 1 of 2)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
