"""Start-up: few programs, serving once the largest and smallest buckets are compiled, the rest in
the background; a step that fits a bucket not compiled yet runs in a larger one."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from imp_jax.runtime.core.async_engine import AsyncEngine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.runtime.execution.step import CompiledStep, step_buckets


def test_one_program_per_token_count_plus_the_decode_diagonal():
    assert step_buckets(512, 32) == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 16), (32, 32), (64, 32), (128, 32),
                                     (256, 32), (512, 32)]
    assert step_buckets(16, 8) == [(1, 1), (2, 2), (4, 4), (8, 8), (16, 8)]
    assert step_buckets(8, 4) == [(1, 1), (2, 2), (4, 4), (8, 4)]


def greedy(prompt: list[int]) -> GenerationRequest:
    return GenerationRequest(uuid.uuid4().hex, prompt, SamplingParams(
        temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.0))


async def collect(engine: AsyncEngine, req: GenerationRequest) -> list[int]:
    return [t async for ev in engine.generate(req) for t in ev.token_ids]


def test_serving_starts_before_the_background_compiles_finish(tiny_hf_dir, monkeypatch: pytest.MonkeyPatch):
    """Ready with two of the programs; requests meanwhile run in the largest bucket, with the same
    tokens as once every program is there; then warm-up ends and nothing more compiles."""
    release = threading.Event()
    rest = CompiledStep.compile_rest

    def held(self, progress=None):
        release.wait(120)
        rest(self, progress)

    monkeypatch.setattr(CompiledStep, "compile_rest", held)
    config = EngineConfig(model=str(tiny_hf_dir), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                          num_kv_blocks=32)
    engine = AsyncEngine(config)
    engine.start()

    async def main() -> None:
        await engine.wait_ready()
        stats = engine.stats()
        assert (stats["programs_compiled"], stats["programs_total"]) == (2, len(step_buckets(64, 4)))
        step = engine.core.step_fn
        assert step.bucket_for(1, 1) == (1, 1) and step.bucket_for(3, 2) == (64, 4)   # only those two yet
        early = [await collect(engine, greedy([5, 17, 33, 2, 9])), await collect(engine, greedy([7, 7, 1]))]
        release.set()
        deadline = time.monotonic() + 120
        while not step.warm or step.has_unrun():
            assert time.monotonic() < deadline, "background compiles did not finish"
            await asyncio.sleep(0.05)
        assert step.bucket_for(3, 2) == (4, 4)
        late = [await collect(engine, greedy([5, 17, 33, 2, 9])), await collect(engine, greedy([7, 7, 1]))]
        assert early == late and all(len(t) == 5 for t in late)
        stats = engine.stats()
        assert stats["programs_compiled"] == stats["programs_total"]
        assert stats["compilations_after_warmup"] == 0
        assert stats["num_free_blocks"] == stats["baseline_free_blocks"]

    try:
        asyncio.run(main())
    finally:
        release.set()
        engine.shutdown()


def test_each_process_draws_from_its_own_base_seed_and_seeded_requests_do_not(tiny_hf_dir):
    """Two fresh engines sample differently for a request without a seed and alike for one with a
    seed; an engine given the first one's base seed (`--seed`) repeats its unseeded draws."""
    from imp_jax.llm import LLM

    args = dict(max_model_len=64, max_num_seqs=1, max_num_batched_tokens=16, num_kv_blocks=16)
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=1234)

    def draws(llm: LLM) -> tuple[list[int], list[int]]:
        out = llm.generate([[5, 17, 33, 2], [5, 17, 33, 2]], [unseeded, seeded])
        return out[0].outputs[0].token_ids, out[1].outputs[0].token_ids

    first, second = LLM(str(tiny_hf_dir), **args), LLM(str(tiny_hf_dir), **args)
    assert first.core.config.seed != second.core.config.seed
    (a_free, a_seeded), (b_free, b_seeded) = draws(first), draws(second)
    assert a_free != b_free
    assert a_seeded == b_seeded
    again = LLM(str(tiny_hf_dir), seed=first.core.config.seed, **args)
    assert draws(again) == (a_free, a_seeded)


def test_a_seed_outside_64_bits_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--seed"):
        EngineConfig(seed=2**64)
    assert EngineConfig(seed=-1).seed == -1 and EngineConfig(seed=7).seed == 7
