"""Batch-1 decode cost of logit_lens and classifier-free guidance on the engine core: tokens per
second of one greedy request, plain vs `logit_lens` vs `cfg_scale` (a shadow prompt of the same
length), interleaved repeats, medians.

    PYTHONPATH=. python scripts/bench_lens_cfg.py --model smollm2-135m-instruct --tokens 32 --repeats 5
"""
from __future__ import annotations

from knob_bench import PROMPT, engine, time_arms

from imp_jax.runtime.request import GenerationRequest, SamplingParams

NEGATIVE = "Write a short story about a baker who finds a recipe in an old cookbook, told plainly."


def main() -> None:
    args, core = engine(__doc__.split("\n\n")[0])
    tok = core.tokenizer
    main_ids, shadow_ids = (tok.encode(t, add_special_tokens=False) for t in (PROMPT, NEGATIVE))
    arms = {"plain": ({}, {}), "logit_lens=5": ({"logit_lens": 5}, {}),
            "cfg_scale=2": ({}, {"cfg_scale": 2.0, "cfg_prompt_ids": shadow_ids})}
    time_arms(core, args, {name: (lambda rid, params=params, extra=extra: GenerationRequest(
        rid, main_ids, SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True, **params), **extra))
        for name, (params, extra) in arms.items()})


if __name__ == "__main__":
    main()
