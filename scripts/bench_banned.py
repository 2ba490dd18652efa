"""Batch-1 decode cost of banned_strings / banned_regex on the engine core: tokens per second of one greedy
request, plain vs 64 banned strings that never complete (the matcher and hold-back on every token, no rewind)
vs 16 banned patterns vs a banned word the model keeps reaching for (rewinds, each resampling a position),
interleaved repeats, medians.

    PYTHONPATH=. python scripts/bench_banned.py --model smollm2-135m-instruct --tokens 32 --repeats 5
"""
from __future__ import annotations

from knob_bench import PROMPT, engine, time_arms

from imp_jax.runtime.request import GenerationRequest, SamplingParams

NEVER = [f"zq{i:02d} never said" for i in range(64)]           # 64 strings, none completes
PATTERNS = [rf"\bqx{i:02d}\w+" for i in range(16)]              # 16 patterns, none matches


def main() -> None:
    args, core = engine(__doc__.split("\n\n")[0])
    tok = core.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    arms = {"plain": {}, "64 strings": {"banned_strings": NEVER}, "16 regex": {"banned_regex": PATTERNS},
            "' the' banned": {"banned_strings": [" the"]}}
    time_arms(core, args, {name: (lambda rid, params=params: GenerationRequest(rid, prompt, SamplingParams(
        temperature=0.0, max_tokens=args.tokens, ignore_eos=True, **params))) for name, params in arms.items()},
        counter="banned_rewinds_total")


if __name__ == "__main__":
    main()
