"""No client can stall the others: the TPOT of 8 plain greedy streams alone, then next to one hostile
client of each kind that keeps one request in flight (a new one as soon as the last ends):

- dry: DRY on a long repetitive prompt with 16 fresh 40-character breakers per request;
- dry_reference: the same requests without DRY (what a long-context row costs the streams' attention);
- regex: 16 distinct polynomially backtracking banned_regex patterns (shapes that pass admission);
- grammar: 64 distinct large JSON schemas, one request after another (each a fresh grammar);
- prompt_logprobs: a long prompt (7k tokens; --quick 1.5k) with prompt_logprobs;
- long_prompt: the same prompt without them (what any long prompt's chunked prefill costs the streams).

Everything goes through AsyncEngine.generate, as the server's requests do, on a tiny random Llama
(scripts/tiny_models.py, written to a temporary directory, with a 1k byte-level vocabulary), or with
--model on a real model by its registry name or path (e.g. smollm2-135m-instruct: its real step and its
49k vocabulary, which makes the breaker scan and grammar masks dearer). TPOT of a stream: (last token's
time - first token's) / (tokens - 1); an arm's number is the median over the 8 streams, and over
--rounds interleaved rounds (its ratio: the median of each round's ratio to that round's alone arm).

    PYTHONPATH=. python scripts/bench_isolation.py [--model NAME] [--quick] [--tokens 64] [--rounds 3] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

STREAMS = 8
VOCAB = 1024   # the tiny model's rows; the tokenizer's ids fit under it
KINDS = ("dry", "dry_reference", "regex", "grammar", "prompt_logprobs", "long_prompt")


def tiny_model(path: Path, max_len: int) -> Path:
    """The tests' tiny random Llama (scripts/tiny_models.py) with a byte-level BPE of VOCAB ids that can write
    any text (JSON included), positions for `max_len` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tiny_models import write_tiny_hf

    write_tiny_hf("LlamaForCausalLM", path, max_position_embeddings=max_len, vocab_size=VOCAB)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [__doc__, json.dumps(schema(0, 16)), "the quick brown fox jumps over the lazy dog 0123456789"]
    tok.train_from_iterator(text * 4, trainers.BpeTrainer(vocab_size=VOCAB - 8, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         special_tokens=["<s>", "</s>"]))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def schema(i: int, width: int) -> dict[str, Any]:
    """A large JSON schema, distinct per `i`: `width` properties of mixed types, some nested."""
    props: dict[str, Any] = {}
    for k in range(width):
        kind = k % 4
        props[f"f{i}_{k}"] = ({"type": "string", "maxLength": 12} if kind == 0 else
                              {"type": "integer"} if kind == 1 else
                              {"type": "array", "items": {"type": "number"}, "maxItems": 4} if kind == 2 else
                              {"type": "object", "properties": {f"n{i}_{k}": {"enum": ["a", "b", f"c{i}"]}},
                               "required": [f"n{i}_{k}"]})
    return {"type": "object", "properties": props, "required": list(props)[: width // 2]}


class Hostile:
    """Makes the next request of one hostile kind (fresh breakers, patterns or grammar each time)."""

    def __init__(self, kind: str, quick: bool, vocab: int):
        self.kind, self.quick, self.vocab, self.n = kind, quick, vocab, 0
        rng = np.random.default_rng(1)
        phrase = [int(t) for t in rng.integers(10, vocab, 24)]
        self.dry_prompt = (phrase * 400)[: 512 if quick else 4000]
        self.long_prompt = [int(t) for t in rng.integers(10, vocab, 1500 if quick else 7000)]
        if kind == "grammar":
            import llguidance
            width = 24 if quick else 64
            self.grammars = [llguidance.LLMatcher.grammar_from_json_schema(schema(i, width)) for i in range(64)]

    def next(self, make: Callable[..., Any]) -> Any:
        self.n += 1
        n = self.n
        if self.kind == "dry_reference":   # the reference for dry: the same long rows, no DRY
            return make(self.dry_prompt, max_tokens=512)
        if self.kind == "dry":
            breakers = [f"{n:04d}-{k:02d}:" + "xyz \n" * 7 for k in range(16)]
            return make(self.dry_prompt, max_tokens=512, dry_multiplier=0.8, dry_allowed_length=2,
                        dry_sequence_breakers=[b[:40] for b in breakers])
        if self.kind == "regex":
            patterns = [r"\D*" * 8 + f"[\\x00\\x{k + 1:02x}]" for k in range(16)]
            return make([5, 6, 7, 8], max_tokens=512, banned_regex=patterns)
        if self.kind == "grammar":
            return make([5, 6, 7, 8], max_tokens=4, ignore_eos=False,
                        constraint=self.grammars[(n - 1) % len(self.grammars)])
        prompt = self.long_prompt[n % 97:] + self.long_prompt[:n % 97]   # a new prompt each time: no prefix hits
        if self.kind == "long_prompt":   # the reference for prompt_logprobs: a prompt as long, not scored
            return make(prompt, max_tokens=1)
        return make(prompt, max_tokens=1, prompt_logprobs=5)


async def run_arm(engine: Any, kind: str | None, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The plain streams' TPOTs with `kind`'s hostile client beside them (None: alone)."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    ids = iter(range(10**9))

    def make(prompt: list[int], constraint: str | None = None, **params: Any) -> GenerationRequest:
        params.setdefault("temperature", 0.0)
        params.setdefault("ignore_eos", True)
        return GenerationRequest(f"{kind}-{next(ids)}", list(prompt), SamplingParams(**params),
                                 constraint=constraint)

    stop = asyncio.Event()
    hostile_done = {"requests": 0, "errors": 0}

    async def hostile() -> None:
        maker = Hostile(kind, args.quick, vocab)
        while not stop.is_set():
            try:
                async for ev in engine.generate(maker.next(make)):
                    if ev.finish_reason == "error":
                        hostile_done["errors"] += 1
                    if stop.is_set():
                        break
            except Exception as e:   # noqa: BLE001 - a refused request counts, the client sends the next
                hostile_done["errors"] += 1
                if hostile_done["errors"] == 1:
                    print(f"  {kind}: {type(e).__name__}: {e}"[:200])
            hostile_done["requests"] += 1

    async def plain(i: int) -> float:
        times: list[float] = []
        prompt = [10 + (i * 7 + k) % (vocab - 10) for k in range(32)]
        async for ev in engine.generate(make(prompt, max_tokens=args.tokens)):
            times += [time.perf_counter()] * len(ev.token_ids)
        return (times[-1] - times[0]) / (len(times) - 1)

    task = asyncio.create_task(hostile()) if kind else None
    if task is not None:
        await asyncio.sleep(args.lead_s)   # the hostile client is busy before the plain streams start
    t0 = time.perf_counter()
    tpots = await asyncio.gather(*(plain(i) for i in range(STREAMS)))
    wall = time.perf_counter() - t0
    stop.set()
    if task is not None:
        await task
    return {"tpot_ms": 1e3 * statistics.median(tpots), "tpot_ms_max": 1e3 * max(tpots), "wall_s": wall,
            **({"hostile_requests": hostile_done["requests"], "hostile_errors": hostile_done["errors"]}
               if kind else {})}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: shorter prompts and streams")
    ap.add_argument("--tokens", type=int, default=None, help="tokens per plain stream (default 64; quick 16)")
    ap.add_argument("--kinds", nargs="*", default=list(KINDS), choices=KINDS)
    ap.add_argument("--lead-s", type=float, default=0.5, help="how long the hostile client runs before the streams")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds, medians reported (default 3; quick 1)")
    ap.add_argument("--model", default=None,
                    help="a real model (registry name or path) instead of the tiny random one")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    args.tokens = args.tokens or (16 if args.quick else 64)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.quick:
        args.lead_s = min(args.lead_s, 0.2)

    from imp_jax.runtime.core.async_engine import AsyncEngine
    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    max_len = 2048 if args.quick else 8192
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tiny_model(Path(tmp), max_len)
        config = EngineConfig(model=str(path), max_model_len=max_len, max_num_seqs=16,
                              max_num_batched_tokens=128 if args.quick else 512, num_kv_blocks=1024)
        t0 = time.perf_counter()
        core = build_engine(config)
        print(f"engine built and warmed up in {time.perf_counter() - t0:.1f} s")
        engine = AsyncEngine(config, build=lambda config, progress: core)
        engine.start()
        vocab = core.loaded.tokenizer.vocab_size
        results: dict[str, Any] = {}

        rounds: list[dict[str, Any]] = []

        async def all_arms() -> None:
            await engine.wait_ready()
            await run_arm(engine, None, args, vocab)   # warms the first runs
            for _ in range(args.rounds):   # each round: alone, then every kind (a shared machine drifts)
                got = {"alone": await run_arm(engine, None, args, vocab)}
                for kind in args.kinds:
                    got[kind] = await run_arm(engine, kind, args, vocab)
                rounds.append(got)

        try:
            asyncio.run(all_arms())
        finally:
            engine.shutdown()
        for name in rounds[0]:
            runs = [r[name] for r in rounds]
            results[name] = {**runs[-1], "tpot_ms": statistics.median(r["tpot_ms"] for r in runs),
                             "vs_alone": statistics.median(r[name]["tpot_ms"] / r["alone"]["tpot_ms"] for r in rounds),
                             "rounds_tpot_ms": [r["tpot_ms"] for r in runs]}
            r = results[name]
            extra = (f"  hostile requests {r['hostile_requests']} (errors {r['hostile_errors']}) in the last round"
                     if "hostile_requests" in r else "")
            print(f"{name:16s} TPOT {r['tpot_ms']:7.2f} ms  {r['vs_alone']:.2f}x alone  "
                  f"(rounds: {', '.join(f'{t:.2f}' for t in r['rounds_tpot_ms'])}){extra}")
        out = {"model": args.model or "tiny random Llama", "quick": args.quick, "tokens": args.tokens, "streams": STREAMS, "rounds": args.rounds,
               "arms": results, "compilations_after_warmup": core.step_fn.compilations_after_warmup}
        print("compilations after warm-up:", out["compilations_after_warmup"])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
