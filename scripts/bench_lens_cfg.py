"""Batch-1 decode cost of logit_lens and classifier-free guidance on the engine core: tokens per
second of one greedy request, plain vs `logit_lens` vs `cfg_scale` (a shadow prompt of the same
length), interleaved repeats, medians.

    PYTHONPATH=. python scripts/bench_lens_cfg.py --model smollm2-135m-instruct --tokens 32 --repeats 5
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

from imp_jax.runtime.builder import build_engine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import GenerationRequest, SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
NEGATIVE = "Write a short story about a baker who finds a recipe in an old cookbook, told plainly."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    config = EngineConfig(model=args.model, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=64,
                          num_kv_blocks=256)
    core = build_engine(config)
    core.step_fn.warm_up()
    tok = core.tokenizer
    main_ids, shadow_ids = (tok.encode(t, add_special_tokens=False) for t in (PROMPT, NEGATIVE))
    ids = itertools.count()
    arms = {"plain": ({}, {}), "logit_lens=5": ({"logit_lens": 5}, {}),
            "cfg_scale=2": ({}, {"cfg_scale": 2.0, "cfg_prompt_ids": shadow_ids})}
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.repeats + 1):   # the first round warms the programs' first runs
        for name, (params, extra) in arms.items():
            req = GenerationRequest(f"b{next(ids)}", main_ids, SamplingParams(
                temperature=0.0, max_tokens=args.tokens, ignore_eos=True, **params), **extra)
            t0 = time.perf_counter()
            core.add_request(req, lambda ev: None)
            while core.has_work():
                core.step()
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["plain"][1:])
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"{name:14s} {args.tokens / med:7.1f} tok/s  ({med / base:.2f}x the plain request's time)")
    print("compilations after warm-up:", core.step_fn.compilations_after_warmup)


if __name__ == "__main__":
    main()
