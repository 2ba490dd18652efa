"""Swap or recompute: the two costs behind --kv-swap-min-tokens (docs/ARCHITECTURE.md, KV tiers).

    python scripts/bench_kv_swap.py [--model smollm2-135m-instruct] [--prompt-lens 64 256] [--repeats 3]

Measures, on this machine's backend: the host tier's block copies (gather N blocks + read them to the host;
scatter N blocks back) in the tier's host memory and, where that is pinned_host, in pageable numpy arrays too
(kv_copy.host_memory_kind), and prefill time per prompt token (a fresh prompt, max_tokens 1). A preempted sequence
of n computed tokens costs, swapped, out + in = 2 * fixed + n * 2 * copy_per_token; recomputed,
n * prefill_per_token. The break-even n* = 2 * fixed / (prefill_per_token - 2 * copy_per_token).
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import jax

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.kv.kv_copy import BlockCopier
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    top = max(args.prompt_lens)
    config = EngineConfig(model=args.model, max_model_len=max(1024, 2 * top), max_num_seqs=4,
                          max_num_batched_tokens=max(256, top), kv_host_gib=0.25, speculative="off")
    core = build_engine(config)
    tiers, bs = core.tiers, config.block_size
    per_block = tiers.copier.block_bytes
    def measure(copier: BlockCopier) -> dict[int, tuple[float, float]]:
        copies = {}
        for n in (1, 16, 64):
            ids = list(range(1, n + 1))
            out = best_of(lambda: copier.payloads(copier.gather(core.step_fn.kv, ids)), args.repeats)
            payload = copier.payloads(copier.gather(core.step_fn.kv, ids))

            def back():
                core.step_fn.kv = copier.scatter(core.step_fn.kv, ids, payload)
                jax.block_until_ready(core.step_fn.kv)
            copies[n] = (out, best_of(back, args.repeats))
        return copies

    # the tier's own host memory (pinned_host where the backend has it), and pageable numpy to compare
    by_memory = {tiers.copier.host_kind or "pageable": measure(tiers.copier)}
    if tiers.copier.host_kind is not None:
        by_memory["pageable"] = measure(BlockCopier(core.step_fn.kv_spec, core.step_fn.mesh, None))
    copies = next(iter(by_memory.values()))
    fixed = (copies[1][0] + copies[1][1]) / 2
    copy_per_token = (copies[64][0] + copies[64][1]) / 2 / (64 * bs)
    rng = np.random.default_rng(0)
    prefill = {}
    for n in args.prompt_lens:
        def one():
            prompt = [int(t) for t in rng.integers(100, 20000, n)]   # fresh: no prefix hit
            core.add_request(GenerationRequest(f"p{time.perf_counter_ns()}", prompt,
                                               SamplingParams(temperature=0.0, max_tokens=1)), lambda ev: None)
            while core.has_work():
                core.step()
        one()
        prefill[n] = best_of(one, args.repeats)
    prefill_per_token = min(prefill[n] / n for n in prefill)
    margin = prefill_per_token - 2 * copy_per_token
    result = dict(
        backend=jax.default_backend(), model=args.model, block_bytes=per_block, block_size=bs,
        host_memory=tiers.copier.host_kind or "pageable",
        gather_ms={kind: {n: round(1e3 * c[0], 3) for n, c in cs.items()} for kind, cs in by_memory.items()},
        scatter_ms={kind: {n: round(1e3 * c[1], 3) for n, c in cs.items()} for kind, cs in by_memory.items()},
        copy_gb_per_s=round(64 * per_block / ((copies[64][0] + copies[64][1]) / 2) / 1e9, 2),
        prefill_ms={n: round(1e3 * t, 1) for n, t in prefill.items()},
        prefill_us_per_token=round(1e6 * prefill_per_token, 1), copy_us_per_token=round(1e6 * copy_per_token, 2),
        fixed_ms=round(1e3 * fixed, 3),
        break_even_tokens=round(2 * fixed / margin, 1) if margin > 0 else None)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
