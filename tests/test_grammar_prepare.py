"""Grammars are compiled before admission, off the engine thread (runtime/decoding/constraints.py `prepare`,
AsyncEngine.generate): a prepared handle survives the compiled-grammar cache evicting its grammar, the
engine thread only copies it, and a grammar that does not compile is a 400 before any event."""
from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import llguidance
import pytest
from paged import tiny_engine

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.core.async_engine import AsyncEngine
from imp_jax.runtime.decoding.constraints import COMPILED_CACHE, GrammarConstraints
from imp_jax.runtime.request import GenerationRequest, SamplingParams


_LLMatcher = llguidance.LLMatcher


def regex_grammar(i: int) -> str:
    return _LLMatcher.grammar_from_regex(f"(ab|ba){{1,3}}x{i}")


@pytest.fixture
def compiles(monkeypatch) -> list[str]:
    """The names of the threads that construct an llguidance matcher (a compile), in order."""
    names: list[str] = []
    def counting(*args, **kwargs):
        names.append(threading.current_thread().name)
        return _LLMatcher(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", counting)
    return names


@pytest.fixture(scope="module")
def core(_tiny_hf_template: Path):
    return tiny_engine(_tiny_hf_template, 32)[0]


def test_a_prepared_handle_survives_eviction_and_is_only_copied(core, compiles) -> None:
    constraints = GrammarConstraints(core.loaded.tokenizer, core.loaded.config.vocab_size)
    first = constraints.prepare(regex_grammar(0))
    for i in range(1, COMPILED_CACHE + 8):   # push grammar 0 out of the cache
        constraints.prepare(regex_grammar(i))
    before = len(compiles)
    m = constraints.matcher(regex_grammar(0), first)
    assert len(compiles) == before            # a copy, not a compile
    assert all(m.accept(t) for t in core.loaded.tokenizer.encode("ab", add_special_tokens=False))
    assert m.failed is None


def test_a_grammar_that_does_not_compile_is_a_400_from_prepare(core) -> None:
    constraints = GrammarConstraints(core.loaded.tokenizer, core.loaded.config.vocab_size)
    with pytest.raises(InvalidRequestError) as e:
        constraints.prepare("start: nosuchrule")
    assert e.value.status == 400 and e.value.param == "response_format"


def test_async_engine_compiles_before_admission_never_on_the_engine_thread(core, compiles) -> None:
    """More distinct grammars than the cache holds, in flight together: every compile ran on a worker
    thread, none on imp-engine; a broken grammar fails generate() before any event."""
    async def one(i: int) -> str:
        req = GenerationRequest(f"g{i}", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0),
                                constraint=regex_grammar(1000 + i))
        text = ""
        async for ev in engine.generate(req):
            text += ev.text
        return text

    async def main() -> None:
        await engine.wait_ready()
        texts = await asyncio.gather(*(one(i) for i in range(COMPILED_CACHE + 6)))
        assert all(t and set(t) <= set("abx0123456789") for t in texts), texts[:3]
        bad = GenerationRequest("bad", [1, 2, 3], SamplingParams(max_tokens=4), constraint="start: nosuchrule")
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate(bad):
                pass

    engine = AsyncEngine(core.config, build=lambda config, progress: core)
    engine.start()
    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
    assert compiles and not [n for n in compiles if n.startswith("imp-engine")], set(compiles)
    assert not core.requests and core.pool.num_free_blocks == core.baseline_free_blocks
