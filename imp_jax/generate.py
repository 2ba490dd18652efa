"""`python -m imp_jax.generate --model M --prompt "..." [--chat] [--max-tokens N] [--temperature T]`."""
from __future__ import annotations

import argparse
import logging
import sys

from imp_jax.errors import ImpError
from imp_jax.model.hub import DEFAULT_MODEL


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m imp_jax.generate", description=__doc__)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="path (HF dir, .gguf, converted) or alias")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None,
                    help="the engine's base seed and the request's: the same seed, the same text (default random)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from imp_jax.llm import LLM
    from imp_jax.runtime.request import SamplingParams

    try:
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=1, max_num_batched_tokens=256, seed=args.seed)
        out = llm.generate(args.prompt, SamplingParams(temperature=args.temperature, seed=args.seed,
                                                       max_tokens=args.max_tokens), chat=args.chat)
    except ImpError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
