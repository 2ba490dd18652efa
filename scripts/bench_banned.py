"""Batch-1 decode cost of banned_strings / banned_regex on the engine core: tokens per second of one greedy
request, plain vs 64 banned strings that never complete (the matcher and hold-back on every token, no rewind)
vs 16 banned patterns vs a banned word the model keeps reaching for (rewinds, each resampling a position),
interleaved repeats, medians.

    PYTHONPATH=. python scripts/bench_banned.py --model smollm2-135m-instruct --tokens 32 --repeats 5
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
NEVER = [f"zq{i:02d} never said" for i in range(64)]           # 64 strings, none completes
PATTERNS = [rf"\bqx{i:02d}\w+" for i in range(16)]              # 16 patterns, none matches


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
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    ids = itertools.count()
    arms = {"plain": {}, "64 strings": {"banned_strings": NEVER}, "16 regex": {"banned_regex": PATTERNS},
            "' the' banned": {"banned_strings": [" the"]}}
    times: dict[str, list[float]] = {name: [] for name in arms}
    rewinds: dict[str, int] = dict.fromkeys(arms, 0)
    for _ in range(args.repeats + 1):   # the first round warms the programs' first runs
        for name, params in arms.items():
            req = GenerationRequest(f"b{next(ids)}", prompt, SamplingParams(
                temperature=0.0, max_tokens=args.tokens, ignore_eos=True, **params))
            before = core.stats()["banned_rewinds_total"]
            t0 = time.perf_counter()
            core.add_request(req, lambda ev: None)
            while core.has_work():
                core.step()
            times[name].append(time.perf_counter() - t0)
            rewinds[name] = core.stats()["banned_rewinds_total"] - before
    base = statistics.median(times["plain"][1:])
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        print(f"{name:14s} {args.tokens / med:7.1f} tok/s  ({med / base:.2f}x the plain request's time, "
              f"{rewinds[name]} rewinds)")
    print("compilations after warm-up:", core.step_fn.compilations_after_warmup)


if __name__ == "__main__":
    main()
