"""What the batch-1 knob benchmarks (bench_banned.py, bench_lens_cfg.py) share: the command line, a
warmed-up engine core, and one greedy request per arm timed in interleaved rounds, medians printed
against the plain arm and written as JSON (--out)."""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from imp_jax.runtime.core.builder import build_engine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.core.engine import EngineCore
from imp_jax.runtime.request import GenerationRequest

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def engine(description: str) -> tuple[argparse.Namespace, EngineCore]:
    """The parsed --model / --tokens / --repeats / --out and a warmed-up engine core for batch-1 runs."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the medians as JSON here")
    args = ap.parse_args()
    core = build_engine(EngineConfig(model=args.model, max_model_len=1024, max_num_seqs=8,
                                     max_num_batched_tokens=64, num_kv_blocks=256))
    core.step_fn.warm_up()
    return args, core


def time_arms(core: EngineCore, args: argparse.Namespace, arms: dict[str, Callable[[str], GenerationRequest]],
              counter: str | None = None) -> None:
    """Run each arm's request (made from a fresh request id) to its end, arm after arm, for a warming round
    and --repeats timed ones; print tokens/s and the time against the "plain" arm (and, with `counter`,
    how much that engine stat grew in the arm's last run); write them to --out."""
    times: dict[str, list[float]] = {name: [] for name in arms}
    grew: dict[str, int] = dict.fromkeys(arms, 0)
    n = 0
    for _ in range(args.repeats + 1):   # the first round warms the programs' first runs
        for name, make in arms.items():
            n += 1
            before = core.stats()[counter] if counter else 0
            t0 = time.perf_counter()
            core.add_request(make(f"b{n}"), lambda ev: None)
            while core.has_work():
                core.step()
            times[name].append(time.perf_counter() - t0)
            grew[name] = core.stats()[counter] - before if counter else 0
    base = statistics.median(times["plain"][1:])
    results: dict[str, Any] = {}
    for name, ts in times.items():
        med = statistics.median(ts[1:])
        extra = f", {grew[name]} {counter}" if counter else ""
        print(f"{name:14s} {args.tokens / med:7.1f} tok/s  ({med / base:.2f}x the plain request's time{extra})")
        results[name] = {"tok_s": args.tokens / med, "median_s": med, "vs_plain": med / base,
                         **({counter: grew[name]} if counter else {})}
    print("compilations after warm-up:", core.step_fn.compilations_after_warmup)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "tokens": args.tokens, "repeats": args.repeats, "arms": results,
                       "compilations_after_warmup": core.step_fn.compilations_after_warmup}, f, indent=2)
