"""Tensor parallelism against one device, on fake CPU devices: run as its own process (the device
count is fixed when jax starts), by tests/test_tensor_parallel.py.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 PYTHONPATH=. python tests/tp_check.py OUT.json MODEL[@1,2]...

For each model and TP size in (1, 2, 4) (or the sizes after its `@`): build the engine as the server does with
`--gemm exact` (int8 activations, the default for a quantised GGUF, round a sum split over devices
differently: SmolLM2's logprobs moved by 0.38 at TP 2), generate greedily,
score the prompt (raw log-softmax rows), and write tokens, scores, per-device KV bytes and the
compilations after warm-up as JSON, keyed "model|n".
"""
from __future__ import annotations

import json
import sys

import numpy as np

PROMPT = [1, 17, 42, 99, 7, 23, 5, 64, 31, 12, 88]
SIZES = (1, 2, 4)


def run(model: str, n: int, cache_dir: str | None) -> dict:
    from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch
    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.kv.kv_blocks import BlockTable
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    config = EngineConfig(model=model, gemm="exact", tensor_parallel_size=n, max_num_seqs=1, max_num_batched_tokens=16,
                          num_kv_blocks=8, max_model_len=64, compilation_cache_dir=cache_dir)
    core = build_engine(config)
    events = []
    core.add_request(GenerationRequest("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)),
                     events.append)
    while core.has_work():
        core.step()
    tokens = [t for e in events for t in e.token_ids]
    step = core.step_fn
    table = BlockTable([1])
    batch = build_step_batch([SeqChunk(PROMPT, 0, table.block_ids)], num_tokens=step.score_tokens, num_seqs=1,
                             max_blocks=step.shapes.max_blocks, block_size=config.block_size, with_tables=False)
    targets = np.zeros(step.score_tokens, np.int32)
    targets[:len(PROMPT) - 1] = PROMPT[1:]
    target_lp, _, top_ids, top_lp = step.score(batch, targets, [table])
    k = step.kv[0]
    return {"tokens": tokens, "target_logprobs": target_lp[:len(PROMPT) - 1].tolist(),
            "top_ids": top_ids[:len(PROMPT)].tolist(), "top_logprobs": top_lp[:len(PROMPT)].tolist(),
            "kv_bytes_total": int(k.nbytes), "kv_bytes_per_device": int(k.addressable_shards[0].data.nbytes),
            "kv_devices": len(k.sharding.device_set), "compilations_after_warmup": step.compilations_after_warmup,
            "free_blocks_back": core.pool.num_free_blocks == core.baseline_free_blocks}


def main(argv: list[str]) -> int:
    out, *models = argv
    cache_dir = None
    results = {}
    for arg in models:
        model, _, sizes = arg.partition("@")
        for n in (tuple(int(x) for x in sizes.split(",")) if sizes else SIZES):
            results[f"{model}|{n}"] = run(model, n, cache_dir)
    with open(out, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
