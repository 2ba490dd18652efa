"""Driving an EngineCore step by step in the tests: requests (req), running them to completion with the
pool's invariants checked (run, gathering each request's events in a Result), and an engine built on an
already loaded model (make_engine) with the sizes tests/test_engine.py's engines share."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax.numpy as jnp
import pytest

from imp_jax.kernels_pallas import kv_storage_dtype
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.request import EngineEvent, GenerationRequest, SamplingParams, TokenLogprob, Usage
from imp_jax.runtime.parallel.sharding import default_mesh


MAX_MODEL_LEN = 256


TOKEN_BUDGET = 16


BIG_POOL_BLOCKS = 96


_ids = itertools.count()


# ----------------------------------------------------------------------------- helpers
@dataclasses.dataclass
class Choice:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Result:
    """Everything a request emitted, gathered per choice."""

    choices: dict[int, Choice] = dataclasses.field(default_factory=dict)
    usage: Usage | None = None
    events: list[EngineEvent] = dataclasses.field(default_factory=list)

    def on_event(self, ev: EngineEvent) -> None:
        assert self.usage is None, "an event arrived after the request was done"
        self.events.append(ev)
        c = self.choices.setdefault(ev.index, Choice())
        assert c.finish_reason is None, "an event arrived after its choice finished"
        c.token_ids += ev.token_ids
        c.text += ev.text
        c.logprobs += ev.logprobs or []
        c.finish_reason, c.stop_reason = ev.finish_reason, ev.stop_reason
        if ev.done:
            self.usage = ev.usage

    @property
    def ids(self) -> list[int]:
        return self.choices.get(0, Choice()).token_ids

    @property
    def first(self) -> Choice:
        return self.choices[0]


def req(prompt: list[int], cache_prompt: bool = False, **params: Any) -> GenerationRequest:
    params.setdefault("temperature", 0.0)
    return GenerationRequest(f"req-{next(_ids)}", list(prompt), SamplingParams(**params),
                             cache_prompt=cache_prompt)


def run(core: EngineCore, *reqs: GenerationRequest, max_steps: int = 400) -> list[Result]:
    """Run the requests together to completion; the pool must be back at its baseline after."""
    results = [Result() for _ in reqs]
    for r, res in zip(reqs, results):
        core.add_request(r, res.on_event)
    for _ in range(max_steps):
        if not core.has_work():
            break
        core.step()
    else:
        pytest.fail(f"engine still busy after {max_steps} steps: {core.stats()}")
    assert not core.requests and not core.scheduler.running and not core.scheduler.waiting
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    for res in results:
        assert res.usage is not None and res.events[-1].done
        assert all(c.finish_reason for c in res.choices.values())
    return results



def make_engine(loaded, config: EngineConfig, num_blocks: int, kv_dtype=None) -> EngineCore:
    """build_engine on a loaded model; the KV cache always has BIG_POOL_BLOCKS (same programs for any
    pool), of the model's dtype unless kv_dtype is given (stored as kv_storage_dtype, like build_engine)."""
    shape = loaded.model.kv_cache_shape(BIG_POOL_BLOCKS, config.block_size)
    kv = tuple(jnp.zeros(shape, kv_storage_dtype(kv_dtype or loaded.dtype, "cpu")) for _ in range(2))
    engine = EngineCore(loaded, config, kv, num_blocks, default_mesh())
    engine.step_fn.warm_up()
    return engine
