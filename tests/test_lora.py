"""LoRA adapters: PEFT adapters made here with `peft` on a tiny random Llama, served by imp_jax.

Parity with transformers + peft (logits and greedy tokens), a batch mixing two adapters and the
base model, the prefix cache keyed by adapter, unload waiting for its requests, every bad adapter
refused clearly, and the HTTP routes. One EngineCore serves the core tests; the server tests (last
in this file) wrap that same core in an AsyncEngine, so they must run after the core tests.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import re
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from imp_jax.errors import ImpError
from imp_jax.model.config import ModelConfig
from imp_jax.model.lora import LoraOptions
from imp_jax.model.formats.loader import load_model
from imp_jax.runtime.core.async_engine import AsyncEngine
from imp_jax.runtime.execution.batch import SeqChunk
from imp_jax.runtime.core.builder import build_engine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.scheduling.lora import AdapterSlots
from imp_jax.runtime.request import GenerationRequest, SamplingParams
from imp_jax.server.app import create_app
from imp_jax.server.config import ServerConfig
from paged import PagedRunner, host_kernels
from support.servers import app_in_thread
from tiny_models import make_adapter

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_RANK = 8
PROMPT = [5, 17, 33, 60, 2, 99, 100, 8, 41, 77, 12, 9]
LONG = [(7 * i + 3) % 150 + 4 for i in range(40)]   # spans two full KV blocks of 16
_ids = itertools.count()


@pytest.fixture(scope="module")
def adapters(_tiny_hf_template: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(_tiny_hf_template, root / "a", 1, r=4, lora_alpha=8, target_modules=TARGETS),
            "b": make_adapter(_tiny_hf_template, root / "b", 2, r=MAX_RANK, lora_alpha=16, use_rslora=True,
                              target_modules=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def hf_peft(_tiny_hf_template: Path, adapters):
    """transformers + peft with adapters "a" and "b" loaded (switch with set_adapter)."""
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(_tiny_hf_template, torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(model, adapters["a"], adapter_name="a")
    peft_model.load_adapter(adapters["b"], adapter_name="b")
    return peft_model.eval()


def hf_run(peft_model, adapter: str | None, prompt: list[int], new: int = 6) -> tuple[np.ndarray, list[int]]:
    """Logits of `prompt` and `new` greedy tokens under `adapter` (None: the base model)."""
    def go():
        ids = torch.tensor([prompt])
        logits = peft_model(input_ids=ids).logits[0].numpy()
        out = peft_model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0)
        return logits, out[0, len(prompt):].tolist()
    with torch.no_grad():
        if adapter is None:
            with peft_model.disable_adapter():
                return go()
        peft_model.set_adapter(adapter)
        return go()


@pytest.fixture(scope="module")
def core(_tiny_hf_template: Path, adapters) -> EngineCore:
    config = EngineConfig(model=str(_tiny_hf_template), max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
                          num_kv_blocks=64, lora=[f"a={adapters['a']}"], max_loras=2, max_lora_rank=MAX_RANK)
    return build_engine(config)


def request(prompt: list[int], lora: str | None = None, **params: Any) -> GenerationRequest:
    params = {"temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 6, "ignore_eos": True, **params}
    return GenerationRequest(f"lora-{next(_ids)}", list(prompt), SamplingParams(**params), lora=lora)


def run(core: EngineCore, *reqs: GenerationRequest) -> list[dict[str, Any]]:
    """Run together to completion: each request's tokens and usage; the pool back at its baseline."""
    out = [{"tokens": [], "usage": None} for _ in reqs]
    for r, o in zip(reqs, out):
        def emit(ev, o=o):
            o["tokens"] += ev.token_ids
            if ev.done:
                o["usage"] = ev.usage
        core.add_request(r, emit)
    for _ in range(200):
        if not core.has_work():
            break
        core.step()
    assert not core.requests and core.pool.num_free_blocks == core.baseline_free_blocks
    return out


def load(core: EngineCore, name: str, path: Path) -> dict[str, Any]:
    return core.load_lora(name, core.loras.read(str(path)))


def unload_now(core: EngineCore, name: str) -> Any:
    answers: list[Any] = []
    core.unload_lora(name, answers.append)
    assert answers, "unload of an idle adapter answers at once"
    return answers[0]


# ------------------------------------------------------------------------------------------- model
def test_logits_match_transformers_peft_per_row_in_one_batch(_tiny_hf_template, adapters, hf_peft):
    """Rows under adapter a, adapter b (rsLoRA, three modules) and none, in one ragged call."""
    model = load_model(_tiny_hf_template,
                       kernels=host_kernels(ModelConfig.from_file(_tiny_hf_template / "config.json"))).model
    model.enable_lora(LoraOptions(max_loras=2, max_rank=MAX_RANK))
    slots = AdapterSlots(model, model.lora.options, lambda edit: edit(model))
    slot_a = slots.load("a", slots.read(str(adapters["a"]))).slot
    slot_b = slots.load("b", slots.read(str(adapters["b"]))).slot
    runner = PagedRunner(model)
    got = runner.run([SeqChunk(PROMPT, 0, [1], slot_a), SeqChunk(PROMPT, 0, [2], slot_b),
                      SeqChunk(PROMPT, 0, [3], 0)])
    for logits, adapter in zip(got, ("a", "b", None)):
        ref, _ = hf_run(hf_peft, adapter, PROMPT)
        assert np.max(np.abs(logits - ref)) <= 1e-3 * np.ptp(ref), adapter
    base, _ = hf_run(hf_peft, None, PROMPT)
    assert np.max(np.abs(hf_run(hf_peft, "a", PROMPT)[0] - base)) > 0.1 * np.ptp(base), "adapter a changes nothing"


@pytest.mark.parametrize("tied,xla", [(False, False), (True, True)])
def test_lm_head_and_embed_tokens_adapters_match_transformers_peft(_tiny_hf_template, tmp_path, tied, xla):
    """PEFT's Linear LoRA on lm_head and Embedding LoRA on embed_tokens (beside q_proj), one row under the
    adapter and one without, in one call; also on a model whose LM head is its embedding (tied), where
    PEFT keeps the two adapters apart. `xla`: the portable formulation (masked slabs, float32, the
    skip), as on a GPU, instead of the CPU kernel's float16 slabs."""
    from imp_jax.kernels_pallas import XLA

    import shutil

    import transformers
    from peft import PeftModel

    base = _tiny_hf_template
    if tied:   # a checkpoint saved tied (one table), so both sides read the same head
        base = tmp_path / "tied"
        _write_llama(base, tie_word_embeddings=True)
        for f in _tiny_hf_template.glob("tokenizer*"):
            shutil.copy(f, base / f.name)
    path = make_adapter(base, tmp_path / "e", 7, r=4, lora_alpha=8,
                        target_modules=["q_proj", "embed_tokens", "lm_head"])
    model = load_model(base, kernels=XLA if xla else host_kernels(ModelConfig.from_file(base / "config.json"))).model
    assert (model.lm_head is None) == tied
    model.enable_lora(LoraOptions(max_loras=2, max_rank=MAX_RANK))
    slots = AdapterSlots(model, model.lora.options, lambda edit: edit(model))
    slot = slots.load("e", slots.read(str(path))).slot
    assert slots.by_name["e"].modules == ["embed_tokens", "lm_head", "q_proj"]
    assert slots.slab_dtype == (np.float32 if xla else np.float16)
    got = PagedRunner(model).run([SeqChunk(PROMPT, 0, [1], slot), SeqChunk(PROMPT, 0, [2], 0)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, path).eval()
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
        with peft_model.disable_adapter():
            plain = peft_model(input_ids=torch.tensor([PROMPT])).logits[0].numpy()
    assert np.max(np.abs(ref - plain)) > 0.1 * np.ptp(ref), "the adapter should change the logits"
    assert np.max(np.abs(got[1] - plain)) <= 1e-3 * np.ptp(plain)
    assert np.max(np.abs(got[0] - ref)) <= 1e-3 * np.ptp(ref)


@pytest.mark.parametrize("rank,parts,in_dim,dtype", [(8, (40, 24, 24), 64, "float32"), (3, (13,), 21, "float32"),
                                                     (8, (40, 24, 24), 64, "float16")])
def test_cpu_kernel_matches_the_masked_xla_formulation(rank, parts, in_dim, dtype):
    """Each row under its own slot (0 = none) whatever the mix; odd ranks and widths take the tails.
    The XLA formulation, without dynamic skips and with, is the oracle."""
    import dataclasses

    import jax.numpy as jnp

    from imp_jax.kernels_pallas import XLA
    from imp_jax.kernels_pallas.cpu import lora as cpu_lora
    from imp_jax.model.lora import LoraDelta

    if not cpu_lora.available():
        pytest.skip("no CPU LoRA kernel on this machine")
    rng = np.random.default_rng(0)
    n, rows = 3, 11
    a = jnp.asarray(rng.standard_normal((n, len(parts) * rank, in_dim)), dtype)
    bt = jnp.asarray(rng.standard_normal((n, rank, sum(parts))), dtype)
    x = jnp.asarray(rng.standard_normal((rows, in_dim)), jnp.float32)
    ids = jnp.asarray([0, 1, 2, 3, 1, 0, 3, 3, 2, 0, 1], jnp.int32)
    got = np.asarray(cpu_lora.lora_delta_cpu(x, ids, a, bt, parts))
    delta = LoraDelta(a, bt, ids, parts)
    want = np.asarray(delta(x, XLA))
    assert np.allclose(got, want, rtol=1e-5, atol=1e-4) and np.all(got[[0, 5, 9]] == 0)
    assert np.array_equal(np.asarray(delta(x, dataclasses.replace(XLA, dynamic_skips=False))), want)
    none = LoraDelta(a, bt, jnp.zeros(rows, jnp.int32), parts)
    assert not np.any(np.asarray(none(x, XLA)))
    assert not np.any(np.asarray(cpu_lora.lora_delta_cpu(x, none.ids, a, bt, parts)))


def _poison_slot(model, slot: int) -> None:
    """Slot `slot` of every slab set to NaN, straight into the slabs (past the load check), its model-wide
    modules switched on: what a non-finite adapter that got through would be."""
    slabs = model.lora
    for fused in slabs.projections:
        if fused in slabs.GLOBAL:
            on = getattr(slabs, fused + "_on")
            on.set_value(np.array(on.get_value()))
            on.get_value()[slot] = 1
        for layer in range(len(getattr(slabs, fused + "_a"))):
            for which in ("a", "b"):
                var = slabs.slab(fused, layer, which)
                var.set_value(np.array(var.get_value()))
                var.get_value()[slot - 1] = np.nan


@pytest.mark.parametrize("xla", [False, True])
def test_a_non_finite_adapter_reaches_no_other_row(_tiny_hf_template, adapters, xla):
    """A batch of a row under a NaN adapter, a base row and a row under a clean adapter: the other two
    rows' logits equal those of the run without the NaN adapter. `xla`: the masked formulation without
    skips, as on a GPU (gemm xla, dynamic_skips False); else this host's kernels (the CPU LoRA kernel)."""
    from imp_jax.kernels_pallas import Kernels

    cfg = ModelConfig.from_file(_tiny_hf_template / "config.json")
    kernels = Kernels(gemm="xla", dynamic_skips=False) if xla else host_kernels(cfg)
    model = load_model(_tiny_hf_template, kernels=kernels).model
    model.enable_lora(LoraOptions(max_loras=2, max_rank=MAX_RANK))
    slots = AdapterSlots(model, model.lora.options, lambda edit: edit(model))
    slot_a = slots.load("a", slots.read(str(adapters["a"]))).slot
    runner = PagedRunner(model)
    batch = lambda: runner.run([SeqChunk(PROMPT, 0, [1], 2), SeqChunk(PROMPT, 0, [2], 0),
                                SeqChunk(PROMPT, 0, [3], slot_a)])
    clean = batch()
    _poison_slot(model, 2)
    runner.use_weights(model)
    poisoned = batch()
    assert not np.isfinite(poisoned[0]).any(), "the poisoned row should be NaN (else the test poisons nothing)"
    for row in (1, 2):
        assert np.isfinite(poisoned[row]).all() and np.array_equal(poisoned[row], clean[row]), row


# ------------------------------------------------------------------------------------------ engine
def test_greedy_tokens_match_and_a_mixed_batch_matches_each_row_alone(core, adapters, hf_peft):
    if "b" not in core.loras.by_name:
        load(core, "b", adapters["b"])
    alone = {name: run(core, request(PROMPT, name))[0]["tokens"] for name in ("a", "b", None)}
    for name, tokens in alone.items():
        assert tokens == hf_run(hf_peft, name, PROMPT)[1], name
    assert len({tuple(t) for t in alone.values()}) == 3, "the adapters should change the greedy tokens"
    names = ["a", None, "b", "a"]
    mixed = run(core, *(request(PROMPT, n) for n in names))
    assert [m["tokens"] for m in mixed] == [alone[n] for n in names]
    assert core.step_fn.compilations_after_warmup == 0


def test_prompt_logprobs_are_the_adapters(core):
    """The scoring program takes each token's slot too."""
    def first_logprob(lora):
        got = []
        core.add_request(request(PROMPT, lora, max_tokens=1, prompt_logprobs=0),
                         lambda ev: got.extend(ev.prompt_logprobs or []))
        while core.has_work():
            core.step()
        return [e.logprob for e in got[1:]]
    base, a = first_logprob(None), first_logprob("a")
    assert len(a) == len(PROMPT) - 1 and a != base and first_logprob("a") == a


def test_prefix_cache_is_keyed_by_adapter_name_and_content(core, adapters):
    if "b" not in core.loras.by_name:
        load(core, "b", adapters["b"])
    cached = lambda name: run(core, request(LONG, name, max_tokens=2))[0]["usage"].cached_tokens
    assert cached(None) == 0
    assert cached("a") == 0          # the base model's blocks are not the adapter's
    assert cached("a") == 32         # two full blocks, within the adapter
    assert cached("b") == 0
    assert cached(None) == 32
    unload_now(core, "b")
    load(core, "b", adapters["a"])   # the same name, another adapter: nothing reused
    assert cached("b") == 0          # (nor adapter "a"'s blocks: the name is in the key too)
    unload_now(core, "b")
    load(core, "b", adapters["b"])   # the same name and weights again: the same KV, reused
    assert cached("b") == 32
    unload_now(core, "b")
    assert core.step_fn.compilations_after_warmup == 0


def test_unload_waits_for_its_requests_and_refuses_new_ones(core, adapters):
    load(core, "c", adapters["b"])
    answers: list[Any] = []
    out: dict[str, list[int]] = {"c": [], "base": []}
    core.add_request(request(PROMPT, "c", max_tokens=8), lambda ev: out["c"].extend(ev.token_ids))
    core.add_request(request(PROMPT, None, max_tokens=8), lambda ev: out["base"].extend(ev.token_ids))
    core.step()
    core.unload_lora("c", answers.append)
    assert answers == [] and "c" not in core.loras.by_name
    with pytest.raises(ImpError) as e:
        core.add_request(request(PROMPT, "c"), lambda ev: None)
    assert (e.value.code, e.value.param, e.value.status) == ("lora_not_loaded", "lora", 400)
    while core.has_work():
        core.step()
    assert answers and answers[0]["name"] == "c"
    assert len(out["c"]) == 8 and len(out["base"]) == 8
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    assert unload_now(core, "c") is None   # gone: the server answers 404
    assert core.step_fn.compilations_after_warmup == 0


def test_an_unload_called_off_gives_the_adapter_back(core, adapters):
    """What a timed-out unload does (AsyncEngine.unload_lora): the name serves again, the reply never comes."""
    load(core, "c", adapters["b"])
    out: list[int] = []
    core.add_request(request(PROMPT, "c", max_tokens=8), lambda ev: out.extend(ev.token_ids))
    core.step()
    answers: list[Any] = []
    core.unload_lora("c", answers.append)
    assert "c" not in core.loras.by_name
    assert core.keep_lora("c") == 1 and "c" in core.loras.by_name
    assert len(run(core, request(PROMPT, "c"))[0]["tokens"]) == 6   # also ends the first request
    assert answers == [] and len(out) == 8 and core.keep_lora("c") is None
    assert unload_now(core, "c")["name"] == "c"


def _bad(core: EngineCore, path: Path) -> str:
    with pytest.raises(ImpError) as e:
        core.loras.read(str(path))
    assert (e.value.status, e.value.code, e.value.param) == (400, "lora_load_failed", "path")
    return e.value.message


def test_every_bad_adapter_is_a_clear_400(core, adapters, tmp_path, _tiny_hf_template):
    import shutil

    from safetensors.numpy import save_file

    assert "no such adapter directory" in _bad(core, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "adapter_config.json missing" in _bad(core, tmp_path / "empty")
    no_weights = Path(shutil.copytree(adapters["a"], tmp_path / "no_weights"))
    (no_weights / "adapter_model.safetensors").rename(no_weights / "adapter_model.bin")
    assert "adapter_model.safetensors missing" in _bad(core, no_weights)
    big = make_adapter(_tiny_hf_template, tmp_path / "big", 3, r=16, lora_alpha=16, target_modules=["q_proj"])
    assert "rank 16, above --max-lora-rank 8" in _bad(core, big)
    odd = Path(shutil.copytree(adapters["a"], tmp_path / "odd"))
    zeros = np.zeros((4, 64), np.float32)
    save_file({"base_model.model.model.layers.0.mlp.foo_proj.lora_A.weight": zeros,
               "base_model.model.model.layers.0.mlp.foo_proj.lora_B.weight": zeros.T.copy()},
              str(odd / "adapter_model.safetensors"))
    assert "target module 'foo_proj'" in _bad(core, odd)
    dora = Path(shutil.copytree(adapters["a"], tmp_path / "dora"))
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    assert "DoRA" in _bad(core, dora)
    other = tmp_path / "other_model"   # a Llama of another width: the first module it names is refused
    _write_llama(other, intermediate_size=96)
    msg = _bad(core, make_adapter(other, tmp_path / "other", 4, r=4, target_modules=["gate_proj"]))
    assert "shape mismatch in model.layers.0.mlp.gate_proj" in msg and "64 -> 96" in msg
    with pytest.raises(ImpError) as e:
        load(core, "a", adapters["b"])
    assert (e.value.status, e.value.code) == (409, "lora_already_loaded")
    while core.loras._free:
        load(core, f"fill{len(core.loras.by_name)}", adapters["b"])
    with pytest.raises(ImpError) as e:
        load(core, "one_too_many", adapters["b"])
    assert (e.value.status, e.value.code) == (409, "lora_slots_full")
    for name in [n for n in core.loras.by_name if n != "a"]:
        unload_now(core, name)


@pytest.mark.parametrize("value,why", [(np.nan, "NaN or infinite"), (-np.inf, "NaN or infinite"),
                                       (2e4, "magnitude 2e+04, past the bound 10000")])
def test_an_adapter_with_non_finite_or_absurd_weights_is_refused(_tiny_hf_template, adapters, tmp_path, value, why):
    """Checked at read, before any slot is touched; the error names the tensor (alpha / r = 2 scales B)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    from imp_jax.model.formats.peft import AdapterError, read_adapter

    bad = Path(shutil.copytree(adapters["a"], tmp_path / "bad"))
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    tensors[name][3, 1] = value / 2
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    model = load_model(_tiny_hf_template).model
    with pytest.raises(AdapterError, match=re.escape(why)) as e:
        read_adapter(bad, model.lora_targets(), model.config.num_layers, MAX_RANK)
    assert "model.layers.1.self_attn.v_proj.lora_B holds" in str(e.value)


def _write_llama(path: Path, **overrides: Any) -> None:
    import transformers

    from tiny_models import TINY

    cfg = transformers.LlamaConfig(**{**TINY, **overrides})
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)


def test_lora_flags():
    """No slots (no slabs, no cost) unless asked for; --lora alone gives four; NAME=PATH is checked."""
    assert EngineConfig(model="x").max_loras == 0
    assert EngineConfig(model="x", lora=["a=/p"]).max_loras == 4
    assert EngineConfig(model="x", lora=[f"a{i}=/p" for i in range(6)]).max_loras == 6
    with pytest.raises(ValueError, match="NAME=PATH"):
        EngineConfig(model="x", lora=["nameless"])
    with pytest.raises(ValueError, match="--max-loras 1"):
        EngineConfig(model="x", lora=["a=/p", "b=/q"], max_loras=1)


# ------------------------------------------------------------------------------------------ server
@pytest.fixture(scope="module")
def server(core: EngineCore, adapters):
    engine = AsyncEngine(core.config, build=lambda config, progress: core)
    engine.start()
    with app_in_thread(create_app(engine, ServerConfig(lora_dir=str(adapters["a"].parent)))) as url:
        yield url, engine
    engine.shutdown()


def test_routes_load_use_list_and_unload(server, adapters):
    url, engine = server
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/admin/lora/load", json={"name": "b", "path": str(adapters["b"])})
        assert r.status_code == 200 and r.json()["loaded"] and r.json()["name"] == "b"
        assert c.post("/admin/lora/load", json={"name": "b", "path": str(adapters["b"])}).json()["error"]["code"] \
            == "lora_already_loaded"
        r = c.post("/admin/lora/load", json={"name": "x", "path": str(adapters["b"])})
        assert (r.status_code, r.json()["error"]["code"]) == (409, "lora_slots_full")
        r = c.post("/admin/lora/load", json={"name": "y", "path": "/nonexistent"})   # outside --lora-dir
        assert (r.status_code, r.json()["error"]["param"]) == (400, "path")
        r = c.post("/admin/lora/load", json={"name": "y", "path": "nonexistent"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "lora_load_failed")
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        base = engine.served_name
        assert models["a"]["parent"] == base and models["b"]["parent"] == base and "parent" not in models[base]
        assert c.get("/v1/models/b").json()["parent"] == base
        body = {"model": base, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8,
                "temperature": 0, "repetition_penalty": 1.0, "ignore_eos": True, "logprobs": True}
        # the tiny tokenizer has no text for most of the model's ids: the logprobs tell the answers apart
        answer = lambda r: [round(t["logprob"], 4) for t in r.json()["choices"][0]["logprobs"]["content"]]
        answers = {}
        for lora in ("a", "b", None):
            r = c.post("/v1/chat/completions", json={**body, "lora": lora})
            assert r.status_code == 200, r.text
            answers[lora] = answer(r)
        assert len({tuple(a) for a in answers.values()}) == 3, answers   # each adapter answers differently
        r = c.post("/v1/chat/completions", json={**body, "model": "b"})   # vLLM's way: the adapter as model
        assert answer(r) == answers["b"]
        r = c.post("/v1/completions", json={"model": base, "prompt": "the quick", "max_tokens": 3, "lora": "nope"})
        assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == \
            (400, "lora_not_loaded", "lora")
        r = c.post("/v1/messages", json={"model": base, "max_tokens": 3, "lora": "nope",
                                         "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = c.post("/v1/responses", json={"model": base, "input": "hi", "max_output_tokens": 3, "lora": 7})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "lora")
        messages = {"model": base, "max_tokens": 2, "messages": [{"role": "user", "content": "the quick brown fox " * 3}]}
        cached = lambda lora: c.post("/v1/messages", json={**messages, "lora": lora}).json()["usage"][
            "cache_read_input_tokens"]
        assert [cached("b"), cached(None), cached("b")] == [0, 0, 16]   # the field reaches the engine's cache key
        r = c.post("/v1/responses", json={"model": base, "input": "the quick brown fox " * 3, "max_output_tokens": 2,
                                          "lora": "b"})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        assert c.post("/admin/lora/unload", json={"name": "b"}).json()["unloaded"]
        r = c.post("/admin/lora/unload", json={"name": "b"})
        assert (r.status_code, r.json()["error"]["code"]) == (404, "lora_not_found")
        assert "b" not in {m["id"] for m in c.get("/v1/models").json()["data"]}


def _models_named(r: httpx.Response) -> set[str]:
    """Every `model` a response names: the JSON body's, or each SSE event's (top level, `message`, `response`)."""
    assert r.status_code == 200, r.text
    if not r.headers["content-type"].startswith("text/event-stream"):
        return {r.json()["model"]}
    found = set()
    for line in r.text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for obj in (event, event.get("message"), event.get("response")):
                if isinstance(obj, dict) and "model" in obj:
                    found.add(obj["model"])
    return found


def test_responses_name_the_adapter_asked_for(server):
    """As vLLM does: `model` (or `lora`) naming an adapter makes every dialect's responses, streamed or not,
    name the adapter; the base model's requests name the base model."""
    url, engine = server
    base = engine.served_name
    bodies = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/completions": {"prompt": "hi", "max_tokens": 2},
              "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
              "/v1/responses": {"input": "hi", "max_output_tokens": 2}}
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, body in bodies.items():
            for stream in (False, True):
                for ask, named in (({"model": "a"}, "a"), ({"model": base, "lora": "a"}, "a"), ({"model": base}, base)):
                    r = c.post(path, json={**body, **ask, "stream": stream})
                    assert _models_named(r) == {named}, (path, stream, ask)


def test_unload_past_its_timeout_is_a_503_and_the_adapter_stays(server):
    url, engine = server
    body = {"model": engine.served_name, "prompt": "the quick brown fox", "max_tokens": 100, "temperature": 0,
            "ignore_eos": True, "lora": "a", "stream": True}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            for bad in (0, -1, "5", True, 1e9):
                r = await c.post("/admin/lora/unload", json={"name": "a", "timeout_s": bad})
                assert (r.status_code, r.json()["error"]["param"]) == (400, "timeout_s"), bad
            async with c.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.aiter_lines()
                while not (await anext(lines)).startswith("data: {"):   # the request is running
                    pass
                r = await c.post("/admin/lora/unload", json={"name": "a", "timeout_s": 0.01})
                assert (r.status_code, r.json()["error"]["code"]) == (503, "lora_unload_timeout"), r.text
                assert "a" in {m["id"] for m in (await c.get("/v1/models")).json()["data"]}
                r = await c.post("/v1/completions", json={**body, "stream": False, "max_tokens": 2})
                assert r.status_code == 200, r.text
                rest = [line async for line in lines]
            assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest

    asyncio.run(main())
    assert "a" in {a["name"] for a in engine.lora_adapters()}
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["baseline_free_blocks"]


def test_load_and_unload_under_traffic_lose_nothing(server, adapters):
    url, engine = server
    body = lambda lora: {"model": engine.served_name, "prompt": "the quick brown fox", "max_tokens": 48,
                         "temperature": 0, "ignore_eos": True, **({"lora": lora} if lora else {})}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=120) as c:
            ref = {lora: (await c.post("/v1/completions", json=body(lora))).json()["choices"][0]["text"]
                   for lora in ("a", None)}
            traffic = [asyncio.create_task(c.post("/v1/completions", json=body(lora)))
                       for lora in ("a", None, "a", None, "a", None)]
            while len(engine.core.requests) < 6:   # all in the engine before the unload (a read of a dict's size)
                await asyncio.sleep(0.005)
            loaded = await c.post("/admin/lora/load", json={"name": "c", "path": str(adapters["b"])})
            unloaded = asyncio.create_task(c.post("/admin/lora/unload", json={"name": "a"}))
            results = await asyncio.gather(*traffic)
            assert loaded.status_code == 200 and (await unloaded).status_code == 200
            for lora, r in zip(("a", None, "a", None, "a", None), results):
                assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref[lora]
            r = await c.post("/v1/completions", json=body("a"))
            assert r.json()["error"]["code"] == "lora_not_loaded"
            assert (await c.post("/admin/lora/load", json={"name": "a", "path": str(adapters["a"])})).status_code == 200
            r = await c.post("/v1/completions", json=body("a"))
            assert r.json()["choices"][0]["text"] == ref["a"]
            await c.post("/admin/lora/unload", json={"name": "c"})

    asyncio.run(main())
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["baseline_free_blocks"]
    assert stats["compilations_after_warmup"] == 0


# ------------------------------------------------------------------------------------------ SmolLM2
@pytest.mark.real_model
def test_smollm2_adapter_matches_transformers_peft(smollm2_gguf_path, hf_smollm2, tmp_path):
    """A PEFT adapter on transformers' SmolLM2 (the GGUF dequantised) gives imp_jax (Q4_1 kept, the delta in
    float32) transformers + peft's logits and greedy tokens."""
    import copy

    from peft import LoraConfig, get_peft_model

    from support.smollm2 import NUM_TOKENS, chat_ids

    torch.manual_seed(5)
    peft_model = get_peft_model(copy.deepcopy(hf_smollm2), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                                      init_lora_weights=False)).eval()
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.02)
    peft_model.save_pretrained(tmp_path / "smol")
    loaded = load_model(smollm2_gguf_path, dtype="float32", gemm="exact")   # its own copy: enable_lora changes it
    model = loaded.model
    model.enable_lora(LoraOptions(max_loras=1, max_rank=8))
    slots = AdapterSlots(model, model.lora.options, lambda edit: edit(model))
    slot = slots.load("smol", slots.read(str(tmp_path / "smol"))).slot
    runner = PagedRunner(model, num_blocks=24, max_blocks=8)
    prompt = chat_ids(loaded, "Name three colors of the rainbow.")
    assert len(prompt) <= NUM_TOKENS
    prefill, tokens = runner.greedy(prompt, 12, [1, 2, 3, 4], lora_slot=slot, num_tokens=NUM_TOKENS, num_seqs=1)
    with torch.no_grad():
        ref = peft_model(input_ids=torch.tensor([prompt])).logits[0].float().numpy()
        hf_tokens = peft_model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        pad_token_id=0)[0, len(prompt):].tolist()
        with peft_model.disable_adapter():
            base = peft_model(input_ids=torch.tensor([prompt])).logits[0].float().numpy()
    assert np.max(np.abs(ref - base)) > 20e-3 * np.ptp(ref), "the adapter should change the logits well past the tolerance"
    assert np.max(np.abs(prefill - ref)) / np.ptp(ref) <= 1e-3
    assert hf_tokens and tokens[:len(hf_tokens)] == hf_tokens
