"""A model run on ragged chunks through the paged cache, like the engine runs it (PagedRunner), and the model
tests' checks built on it; shared by the tests and scripts/gpu_check_logits.py."""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.kernels_pallas import AttentionMetadata, Kernels, select_kernels
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.loader import attention_shape
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch
from imp_jax.runtime.execution.step_programs import model_forward


def random_prompts(lengths: Sequence[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token-id prompts of the given lengths."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def paged_greedy(model, ids: Sequence[int], steps: int) -> list[int]:
    """Greedy tokens of `model` (a causal LM of model/base.py's contract) for a text prompt: one paged prefill
    of the whole sequence per step, plain [T] positions."""
    forward = nnx.jit(lambda m, ids, pos, kv, meta: m(ids, pos, kv, meta))
    shape = model.kv_cache_shape(8, 16)
    seq = list(ids)
    for _ in range(steps):
        b = build_step_batch([SeqChunk(seq, 0, list(range(1, 5)))], num_tokens=32, num_seqs=1, max_blocks=4,
                             block_size=16)
        meta = AttentionMetadata(*(jnp.asarray(a) for a in (b.query_start_loc, b.seq_lens, b.block_tables,
                                                             b.slot_mapping, b.num_seqs)))
        hidden, _ = forward(model, jnp.asarray(b.input_ids), jnp.asarray(b.positions),
                            (jnp.zeros(shape), jnp.zeros(shape)), meta)
        seq.append(int(np.argmax(np.asarray(model.logits(hidden[len(seq) - 1:len(seq)]))[0])))
    return seq[len(ids):]


def run_to_end(core, *reqs, prepare: bool = True, max_steps: int = 400) -> list[dict]:
    """Run requests together on an EngineCore to the end: per request its choices' tokens (`tokens`: choice 0),
    choice 0's logprobs, usage and error. The KV pool and the image row pool must be back at their baselines."""
    out = [dict(choices={}, logprobs=[], usage=None, error=None) for _ in reqs]
    for r, o in zip(reqs, out):
        if prepare:
            core.prepare(r)

        def on_event(ev, o=o):
            o["choices"].setdefault(ev.index, []).extend(ev.token_ids)
            o["tokens"] = o["choices"].get(0, [])
            o["logprobs"] += (ev.logprobs or []) if ev.index == 0 else []
            o["usage"] = ev.usage or o["usage"]
            o["error"] = ev.error or o["error"]
        core.add_request(r, on_event)
    for _ in range(max_steps):
        if not core.has_work():
            break
        core.step()
    assert not core.requests
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    assert core.stats()["image_rows_used"] == 0
    return out


def assert_close(a: np.ndarray, b: np.ndarray, tol: float = 1e-4) -> None:
    """|a - b| at most `tol` times b's range, everywhere."""
    scale = max(np.ptp(b), 1e-6)
    assert np.max(np.abs(a - b)) <= tol * scale, np.max(np.abs(a - b)) / scale


def hf_logits(hf_model, ids: Sequence[int]) -> np.ndarray:
    """A transformers model's logits [len(ids), V] for one prompt."""
    import torch

    with torch.no_grad():
        return hf_model(torch.tensor([list(ids)])).logits[0].numpy()


def tiny_engine(path, num_blocks: int):
    """An EngineCore on the tiny float32 model at `path` (max_model_len 128, 8 sequences, 32 tokens a step,
    blocks of 16, asynchronous scheduling on: the default), warmed up,
    and the same model in transformers."""
    import transformers

    from imp_jax.model.formats.loader import load_model
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.core.engine import EngineCore
    from imp_jax.runtime.parallel.sharding import default_mesh

    loaded = load_model(path, dtype="float32")
    config = EngineConfig(model=str(path), max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
                          block_size=16, num_kv_blocks=num_blocks, async_scheduling="on")
    shape = loaded.model.kv_cache_shape(num_blocks, 16)
    core = EngineCore(loaded, config, (jnp.zeros(shape), jnp.zeros(shape)), num_blocks, default_mesh())
    core.step_fn.warm_up()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="float32").eval()
    return core, hf


def check_llm_greedy(path, hf_model):
    """Serve the tiny model at `path` (a tokenizer written beside it) with the offline LLM: three prompts
    batched give the tokens each gives alone, the second's are transformers' greedy tokens, and nothing
    compiles after warm-up. Returns the LLM for further checks."""
    import torch
    from tiny_models import write_tiny_tokenizer

    from imp_jax import LLM, SamplingParams

    write_tiny_tokenizer(path)
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    prompts = ["hello world", "the quick brown fox jumps over the lazy dog", "12345"]
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=8, ignore_eos=True)
    together = llm.generate(prompts, params)
    alone = [llm.generate(p, params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    out = together[1]
    with torch.no_grad():
        ids = torch.tensor([out.prompt_token_ids])
        exact = hf_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[0, ids.shape[1]:]
    assert out.outputs[0].token_ids == exact.tolist()
    assert llm.core.step_fn.compilations_after_warmup == 0
    return llm


def check_ragged_steps(runner: "PagedRunner", hf_model, vocab: int) -> None:
    """Three steps of one ragged batch against transformers' logits: a 30-token prompt in two prefill
    chunks then decoding, a 21-token one at once then decoding, a 3-token one decoding beside them."""
    a, b, c = random_prompts([30, 21, 3], vocab, seed=1)
    ta, tb, tc = [10, 11], [12, 13], [14]
    first = runner.run([SeqChunk(a[:13], 0, ta), SeqChunk(b[:18], 0, tb), SeqChunk(c[:2], 0, tc)])
    second = runner.run([SeqChunk(a[13:28], 13, ta), SeqChunk([b[18]], 18, tb), SeqChunk([c[2]], 2, tc)])
    third = runner.run([SeqChunk(a[28:], 28, ta), SeqChunk(b[19:], 19, tb)])
    assert_close(np.concatenate([first[0], second[0], third[0]]), hf_logits(hf_model, a))
    assert_close(np.concatenate([first[1], second[1], third[1]]), hf_logits(hf_model, b))
    assert_close(np.concatenate([first[2], second[2]]), hf_logits(hf_model, c))


def host_kernels(cfg: ModelConfig, dtype=jnp.float32) -> Kernels:
    """The kernels an engine on this host picks for `cfg` (the C++ ones on an x86-64 CPU)."""
    device = jax.local_devices()[0]
    return select_kernels(device, attention_shape(cfg, dtype, dtype, 16, device.platform))


class PagedRunner:
    """Owns a KV cache and the engine's own forward pass (runtime/execution/step_programs.py model_forward, which every
    compiled program runs), jitted alone; `run(chunks)` returns logits of every real token."""

    def __init__(self, model, *, num_blocks: int = 64, block_size: int = 16, max_blocks: int = 32):
        self.block_size, self.max_blocks = block_size, max_blocks
        shape = model.kv_cache_shape(num_blocks, block_size)
        self.kv = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
        graphdef, state = nnx.split(model)
        self.state, treedef = jax.tree.flatten(state)
        forward = model_forward(model, graphdef, treedef)
        self._forward = jax.jit(lambda leaves, kv, ids, pos, meta, lora_ids: forward(leaves, kv, ids, pos, meta,
                                                                                   lora_ids, None), donate_argnums=1)

    def use_weights(self, model) -> None:
        """Run the same program on `model`'s weights (the same architecture and config)."""
        self.state = jax.tree.leaves(nnx.split(model)[1])

    def greedy(self, prompt: Sequence[int], steps: int, table: list[int], *, lora_slot: int = 0,
               stop: frozenset[int] | set[int] = frozenset(), num_tokens: int = 64, num_seqs: int = 8
               ) -> tuple[np.ndarray, list[int]]:
        """The model tests' one greedy loop: the prompt's logits [len(prompt), V] from one prefill, then up to
        `steps` argmax tokens, each decoded through the cache (a token in `stop` is kept and ends it)."""
        prefill = self.run([SeqChunk(list(prompt), 0, table, lora_slot)], num_tokens, num_seqs)[0]
        tokens, last = [], prefill[-1]
        while len(tokens) < steps:
            tokens.append(int(np.argmax(last)))
            if tokens[-1] in stop or len(tokens) == steps:
                break
            pos = len(prompt) + len(tokens) - 1
            last = self.run([SeqChunk([tokens[-1]], pos, table, lora_slot)], num_tokens, num_seqs)[0][-1]
        return prefill, tokens

    def run(self, chunks: Sequence[SeqChunk], num_tokens: int = 64, num_seqs: int = 8) -> list[np.ndarray]:
        """Logits [len(chunk.token_ids), vocab] for each chunk, from one ragged model call."""
        b = build_step_batch(chunks, num_tokens=num_tokens, num_seqs=num_seqs,
                             max_blocks=self.max_blocks, block_size=self.block_size)
        meta = AttentionMetadata(jnp.asarray(b.query_start_loc), jnp.asarray(b.seq_lens),
                                 jnp.asarray(b.block_tables), jnp.asarray(b.slot_mapping),
                                 jnp.asarray(b.num_seqs))
        logits, self.kv = self._forward(self.state, self.kv, jnp.asarray(b.input_ids),
                                        jnp.asarray(b.positions), meta, jnp.asarray(b.lora_ids))
        logits = np.asarray(logits)
        return [logits[b.query_start_loc[i]:b.query_start_loc[i + 1]] for i in range(len(chunks))]
