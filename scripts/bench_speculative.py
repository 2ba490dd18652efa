"""Speculative decoding's speed on the engine core: tokens per second with and without n-gram drafting
(the request's `speculative`), greedy, on chat prompts that make the answer repeat its input (copy a
text, rewrite a text, code with repeated identifiers), on free chat, and on 32 streams mixing them.
Batch 1: each workload alone, interleaved repeats, medians. 32 streams: all at once, total tokens over
wall time. Greedy outputs with and without are also checked to be identical.

    PYTHONPATH=. python scripts/bench_speculative.py --model smollm2-135m-instruct --tokens 96 --repeats 3
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time

from imp_jax.runtime.core.builder import build_engine
from imp_jax.runtime.config import EngineConfig
from imp_jax.runtime.request import GenerationRequest, SamplingParams

PASSAGE = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
           "father had taught him. Below, the harbour filled with fishing boats returning from the grey "
           "northern sea, their decks heavy with nets and their crews singing old songs.")
CODE = ("def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
        "        subtotal = subtotal + item.price * item.quantity\n    tax = subtotal * tax_rate\n"
        "    return subtotal + tax\n")
WORKLOADS = {
    "copy": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "rewrite": f"Rewrite the following text in the present tense:\n\n{PASSAGE}",
    "code": f"Rename the variable `subtotal` to `running_total` in this function and show the whole "
            f"function:\n\n{CODE}",
    "free chat": "Tell me a short story about a dragon who learns to cook.",
}
_ids = itertools.count()


def run(core, prompts: list[list[int]], speculative: bool, tokens: int) -> tuple[float, int, list[list[int]]]:
    """All `prompts` together to the end: (seconds, completion tokens, outputs)."""
    outs: list[list[int]] = [[] for _ in prompts]
    t0 = time.perf_counter()
    for p, out in zip(prompts, outs):
        req = GenerationRequest(f"b{next(_ids)}", p, SamplingParams(temperature=0.0, max_tokens=tokens),
                                speculative=speculative)
        core.add_request(req, lambda ev, out=out: out.extend(ev.token_ids))
    while core.has_work():
        core.step()
    return time.perf_counter() - t0, sum(len(o) for o in outs), outs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=32)
    args = ap.parse_args()
    config = EngineConfig(model=args.model, max_model_len=1024, max_num_seqs=32, max_num_batched_tokens=256,
                          num_kv_blocks=1024)
    core = build_engine(config)
    core.step_fn.warm_up()
    tok = core.tokenizer
    prompts = {name: tok.encode_chat(tok.apply_chat_template([{"role": "user", "content": text}],
                                                             add_generation_prompt=True))
               for name, text in WORKLOADS.items()}
    print(f"batch 1, greedy, max_tokens {args.tokens}, median of {args.repeats}")
    for name, ids in prompts.items():
        times = {True: [], False: []}
        counts = {}
        for r in range(args.repeats + 1):   # round 0 warms the programs' first runs
            for spec in (False, True):
                s0 = core.stats()
                secs, n, outs = run(core, [ids], spec, args.tokens)
                if r:
                    times[spec].append(secs / n)
                counts[spec] = (outs[0], core.stats()["spec_accepted_total"] - s0["spec_accepted_total"],
                                core.stats()["spec_drafted_total"] - s0["spec_drafted_total"])
        same = counts[True][0] == counts[False][0]
        off, on = (1 / statistics.median(times[s]) for s in (False, True))
        print(f"  {name:10s} off {off:6.1f} tok/s  on {on:6.1f} tok/s  {on / off:.2f}x  "
              f"accepted {counts[True][1]}/{counts[True][2]} drafts  {len(counts[True][0])} tokens  "
              f"identical={same}")
    mixed = [prompts[name] for name in itertools.islice(itertools.cycle(prompts), args.streams)]
    rates = {True: [], False: []}
    for r in range(args.repeats + 1):
        for spec in (False, True):
            secs, n, _ = run(core, mixed, spec, args.tokens)
            if r:
                rates[spec].append(n / secs)
    off, on = (statistics.median(rates[s]) for s in (False, True))
    print(f"{args.streams} streams (the four workloads mixed): off {off:6.1f} tok/s  on {on:6.1f} tok/s  "
          f"{on / off:.2f}x")
    print("compilations after warm-up:", core.step_fn.compilations_after_warmup)


if __name__ == "__main__":
    main()
