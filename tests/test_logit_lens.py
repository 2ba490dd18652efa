"""logit_lens: per layer, the final norm + LM head on the residual after that layer, at the row that
sampled each token. On the tiny random Llama, checked against transformers' output_hidden_states;
the last layer against the step's own raw logprobs; the KV cache left untouched. Then the chat
route with the openai client on SmolLM2 (streamed and not), and its 400s."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from support.servers import fake_server, live_server, openai_client  # noqa: F401

NEUTRAL = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny(_tiny_hf_template: Path):
    """(EngineCore, transformers model, tokenizer) on the tiny random Llama."""
    import jax.numpy as jnp
    import transformers

    from imp_jax.model.formats.loader import load_model
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.parallel.sharding import default_mesh

    loaded = load_model(_tiny_hf_template, dtype="float32")
    config = EngineConfig(model=str(_tiny_hf_template), max_model_len=128, max_num_seqs=4,
                          max_num_batched_tokens=16, block_size=16, num_kv_blocks=32)
    shape = loaded.model.kv_cache_shape(32, 16)
    core = EngineCore(loaded, config, (jnp.zeros(shape), jnp.zeros(shape)), 32, default_mesh())
    core.step_fn.warm_up()
    hf = transformers.AutoModelForCausalLM.from_pretrained(_tiny_hf_template, torch_dtype="float32").eval()
    return core, hf, loaded.tokenizer


def run(core, prompt: list[int], **params) -> list:
    """Every event of one request, stepped to the end."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    events: list = []
    core.add_request(GenerationRequest(f"lens-{next(_ids)}", prompt, SamplingParams(**params)), events.append)
    while core.has_work():
        core.step()
    return events


def entries(events) -> list:
    return [lp for e in events for lp in (e.logprobs or [])]


PROMPT = [5, 17, 42, 99, 3, 77, 120, 8, 61, 200, 14, 33, 150, 9, 71, 240, 2, 57, 88, 130]   # 20: a chunked prefill


def test_last_layer_is_the_steps_raw_logprob(tiny):
    core, hf, _ = tiny
    events = run(core, PROMPT, max_tokens=8, seed=7, logit_lens=5, logprobs=3, ignore_eos=True, **NEUTRAL)
    got = entries(events)
    assert len(got) == 8
    for e in got:
        assert len(e.lens) == hf.config.num_hidden_layers
        last = e.lens[-1]
        assert last.logprob == pytest.approx(e.logprob, abs=1e-5)
        assert [t for t, _ in last.top[:3]] == [t for t, _ in e.top]   # the raw distribution's top, in order
        for layer in e.lens:
            assert len(layer.top) == 5 and layer.rank >= 1 and layer.entropy >= 0
            lps = [lp for _, lp in layer.top]
            assert lps == sorted(lps, reverse=True)
            if layer.rank <= 5:
                assert layer.top[layer.rank - 1][0] == e.token_id
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    assert core.stats()["compilations_after_warmup"] == 0


def test_layers_match_transformers_hidden_states(tiny):
    """Rank, logprob, entropy and top ids per layer vs a NumPy readout of HF's per-layer hidden states."""
    import torch

    core, hf, _ = tiny
    events = run(core, PROMPT, max_tokens=5, seed=3, logit_lens=20, ignore_eos=True, **NEUTRAL)
    got = entries(events)
    out = [e.token_id for e in got]
    with torch.no_grad():
        hs = hf(torch.tensor([PROMPT + out]), output_hidden_states=True).hidden_states
        L = hf.config.num_hidden_layers
        # HF's last entry is already normed; the others are the raw residual after each layer
        per_layer = [hf.model.norm(hs[i + 1]) if i < L - 1 else hs[L] for i in range(L)]
        logits = [hf.lm_head(h)[0].double().numpy() for h in per_layer]
    for k, e in enumerate(got):
        row = len(PROMPT) + k - 1
        for i, layer in enumerate(e.lens):
            x = logits[i][row]
            lp = x - x.max() - np.log(np.exp(x - x.max()).sum())
            assert layer.logprob == pytest.approx(lp[e.token_id], abs=2e-4)
            assert layer.rank == 1 + int((lp > lp[e.token_id]).sum())
            assert layer.entropy == pytest.approx(float(-(np.exp(lp) * lp).sum()), abs=2e-4)
            assert [t for t, _ in layer.top[:5]] == list(np.argsort(-lp, kind="stable")[:5])


def test_the_lens_leaves_the_kv_cache_alone(tiny):
    """Greedy output and logprobs are the same with the lens on as off (its re-run writes no live KV)."""
    core, _, _ = tiny
    plain = entries(run(core, PROMPT, max_tokens=10, temperature=0.0, logprobs=2, ignore_eos=True))
    lens = entries(run(core, PROMPT, max_tokens=10, temperature=0.0, logprobs=2, logit_lens=1, ignore_eos=True))
    assert [(e.token_id, e.logprob, e.top) for e in plain] == [(e.token_id, e.logprob, e.top) for e in lens]
    assert all(len(e.lens[0].top) == 1 for e in lens)


def test_lens_implies_logprobs_and_checks_its_range(tiny):
    from imp_jax.errors import InvalidRequestError

    core, _, _ = tiny
    got = entries(run(core, PROMPT, max_tokens=2, temperature=0.0, logit_lens=2, ignore_eos=True))
    assert len(got) == 2 and got[0].top == [] and len(got[0].lens[0].top) == 2
    for bad in (0, 21):
        with pytest.raises(InvalidRequestError) as e:
            run(core, PROMPT, max_tokens=2, logit_lens=bad)
        assert e.value.param == "logit_lens"


# ------------------------------------------------------------------------------------------ the chat route
from support.servers import MODEL  # noqa: E402

QUESTION = [{"role": "user", "content": "Name a colour."}]
RAW = dict(temperature=1.0, top_p=1.0, seed=4)
RAW_EXTRA = dict(top_k=0, min_p=0.0, typical_p=1.0, repetition_penalty=1.0)


def lens_of(entry) -> list[dict]:
    return entry.model_dump()["logit_lens"]


@pytest.mark.real_model
def test_chat_logit_lens_with_the_openai_client(openai_client, live_server):  # noqa: F811
    from support.servers import wait_idle

    r = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, **RAW,
                                              extra_body={"logit_lens": 3, **RAW_EXTRA})
    content = r.choices[0].logprobs.content   # logit_lens implies logprobs
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        layers = lens_of(entry)
        assert len(layers) == 30 and all(set(x) == {"rank", "logprob", "entropy", "top"} for x in layers)
        last = layers[-1]
        assert last["logprob"] == pytest.approx(entry.logprob, abs=1e-4)   # knobs neutral: raw == processed
        assert all(len(x["top"]) == 3 for x in layers)
        if last["rank"] <= 3:
            assert last["top"][last["rank"] - 1]["token"] == entry.token   # the same token rendering
    streamed = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, stream=True,
                                                     **RAW, extra_body={"logit_lens": True, **RAW_EXTRA})
    entries = [e for chunk in streamed for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [e.token for e in entries] == [e.token for e in content]   # seeded: the same tokens
    for got, want in zip(entries, content):
        assert len(lens_of(got)[0]["top"]) == 5   # true = top 5
        assert [x["rank"] for x in lens_of(got)] == [x["rank"] for x in lens_of(want)]
    stats = wait_idle(live_server.url)
    assert stats["compilations_after_warmup"] == 0


@pytest.mark.parametrize("value", [21, -1, 2.5, "yes", [1]])
def test_chat_logit_lens_bad_values_are_400s(fake_server, value):  # noqa: F811
    import httpx

    url, _ = fake_server
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"model": "fake-model", "messages": QUESTION, "max_tokens": 2, "logit_lens": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_lens"


def test_families_without_per_layer_residuals_refuse_the_lens(tiny):
    from imp_jax.errors import InvalidRequestError
    from imp_jax.model.architectures.gemma import GemmaLM
    from imp_jax.model.architectures.llama import DecoderLM
    from imp_jax.model.architectures.moe import MoELM
    from imp_jax.model.architectures.phi3 import Phi3LM
    from imp_jax.runtime.decoding.logit_lens import supports_lens

    assert [supports_lens(c) for c in (DecoderLM, MoELM, Phi3LM, GemmaLM)] == [True, True, True, False]
    core, _, _ = tiny
    core.step_fn.supports_lens = False   # as a Gemma engine's
    try:
        with pytest.raises(InvalidRequestError) as e:
            run(core, PROMPT, max_tokens=2, logit_lens=3)
    finally:
        core.step_fn.supports_lens = True
    assert (e.value.param, e.value.code) == ("logit_lens", "not_supported")
    assert not core.has_work()
