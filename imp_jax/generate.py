"""`python -m imp_jax.generate --prompt "..." [--chat] [--max-tokens N] [--temperature T] [--top-p P] ...`: one completion.

The sampling flags are SamplingParams' fields (the engine's one definition, the same names as a
request's fields); a flag left out takes the model's generation_config.json value, as a server
request does, except temperature (0: greedy) and max_tokens (128).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from imp_jax.cli_flags import add_flags
from imp_jax.errors import ImpError
from imp_jax.model.formats.hub import DEFAULT_MODEL
from imp_jax.runtime.request import SamplingParams

DEFAULTS = {"temperature": 0.0, "max_tokens": 128}   # generate's own: greedy, short
SAMPLING_HELP = {
    "temperature": "0 = greedy", "top_p": "nucleus mass kept; 1 = off", "top_k": "most likely tokens kept; <= 0 = off",
    "min_p": "drop tokens below min_p x the top probability; 0 = off", "typical_p": "locally typical mass; 1 = off",
    "presence_penalty": "-2..2, on tokens already in the output", "frequency_penalty": "-2..2, per occurrence in the output",
    "repetition_penalty": "> 0; 1 = off",
    "seed": "the engine's base seed and the request's: the same seed, the same text",
    "max_tokens": "tokens to generate at most", "min_tokens": "tokens before EOS or a stop may end it",
    "stop": "a stop string", "stop_token_ids": "a stop token id", "ignore_eos": "generate past EOS up to max_tokens",
    "logit_bias": "", "mirostat": "0 = off, 1 or 2 = mirostat v1/v2", "mirostat_tau": "mirostat's target surprise",
    "mirostat_eta": "mirostat's learning rate", "dry_multiplier": "DRY penalty strength; 0 = off",
    "dry_base": "DRY's exponential base", "dry_allowed_length": "repeats DRY lets pass",
    "dry_penalty_last_n": "tokens DRY looks back; -1 = the context", "dry_sequence_breakers": "a DRY sequence breaker",
    "banned_strings": "a phrase the output never contains", "banned_regex": "a pattern the output never matches",
    "skip_special_tokens": "leave special tokens out of the text",
}
# the request fields a one-shot command line can take (no n, logprobs or per-token bias: one text is printed)
SAMPLING_FLAGS = tuple(k for k in SAMPLING_HELP if k != "logit_bias")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m imp_jax.generate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 argument_default=argparse.SUPPRESS)   # a flag left out is not sent
    ap.add_argument("--model", default=DEFAULT_MODEL, help="path (HF dir, .gguf, converted) or alias")
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--chat", action="store_true", default=False, help="wrap the prompt in the model's chat template")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--gemm", default="auto", help="the server's --gemm: auto | exact | cpu_q8 | xla (exact: "
                    "transformers' float32 products bit for bit; auto: cpu_q8 for a quantised GGUF on a CPU)")
    fields = [f for f in dataclasses.fields(SamplingParams) if f.name in SAMPLING_FLAGS]
    group = ap.add_argument_group("sampling (a request's fields; docs/API.md)")
    shown = {f.name: "the model's, else off" for f in fields if f.default is None}
    add_flags(group, SamplingParams, fields, SAMPLING_HELP, {**shown, "seed": "random", **DEFAULTS})
    ap.set_defaults(**DEFAULTS)
    return ap


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags given (plus DEFAULTS) as SamplingParams; the rest keep SamplingParams' defaults."""
    given = {k: v for k, v in vars(args).items() if k in SAMPLING_FLAGS and v is not None}
    return SamplingParams(**given)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    from imp_jax.llm import LLM

    try:
        params = sampling_params(args)
        llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, gemm=args.gemm,
                  max_num_seqs=1, max_num_batched_tokens=256, seed=args.seed if "seed" in vars(args) else None)
        out = llm.generate(args.prompt, params, chat=args.chat)
    except ImpError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    print(out[0].outputs[0].text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
