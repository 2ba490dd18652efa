"""Which small model answers everyday questions well: 20 fixed questions, each checked automatically.

    PYTHONPATH=. python scripts/eval_default_model.py --model smollm2-135m-instruct --model PATH.gguf ... \
        [--seeds 3] [--out bench_results/default_model.json]

Each question is asked through the offline API (`imp_jax.LLM`, chat template) under the spec preset
(temperature 0.6, top_p 0.95, top_k 50, repetition_penalty 1.05) with --seeds seeds. An answer passes
when every `must` regex matches it (case-insensitive unless the question says otherwise). Then one stream's
speed: 128 tokens (ignore_eos), --speed-runs times, the best reported (the CPU may be shared), and the same
tokens over this process's CPU time spread on its cores ("cpu tok/s": what the run would reach with the
cores to itself, a little low where spinning threads burn time while descheduled). --seeds 0: speed only.
A model without a chat template is asked with a plain "Question: ... Answer:" completion prompt.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
from pathlib import Path

from imp_jax import LLM, SamplingParams

SPEC = dict(temperature=0.6, top_p=0.95, top_k=50, min_p=0.0, typical_p=1.0, repetition_penalty=1.05)


@dataclasses.dataclass(frozen=True)
class Question:
    """One everyday question and the regexes every passing answer matches."""

    kind: str
    text: str
    must: tuple[str, ...]
    flags: int = re.IGNORECASE

    def passes(self, answer: str) -> bool:
        return all(re.search(p, answer, self.flags) for p in self.must)


QUESTIONS: tuple[Question, ...] = (
    Question("fact", "What is the capital of France?", (r"\bParis\b",)),
    Question("fact", "What is the largest planet in our solar system?", (r"\bJupiter\b",)),
    Question("fact", "Who wrote the play Romeo and Juliet?", (r"\bShakespeare\b",)),
    Question("fact", "What is the chemical symbol for gold?", (r"\bAu\b",), 0),
    Question("fact", "How many continents are there on Earth?", (r"\b(7|seven)\b",)),
    Question("fact", "At what temperature in degrees Celsius does water boil at sea level?", (r"\b100\b",)),
    Question("fact", "In which country are the pyramids of Giza?", (r"\bEgypt\b",)),
    Question("fact", "What is the capital of Japan?", (r"\bTokyo\b",)),
    Question("fact", "How many days are there in a leap year?", (r"\b366\b",)),
    Question("arithmetic", "What is 12 + 30?", (r"\b42\b",)),
    Question("arithmetic", "What is 7 times 8?", (r"\b56\b",)),
    Question("arithmetic", "What is 100 minus 37?", (r"\b63\b",)),
    Question("arithmetic", "What is half of 90?", (r"\b45\b",)),
    Question("arithmetic", "I have 3 apples and buy 5 more. How many apples do I have now?",
             (r"\b(8|eight)\b",)),
    Question("instruction", 'Translate "thank you" into Spanish.', (r"\bgracias\b",)),
    Question("instruction", 'Reply with only the word "yes", in lowercase.', (r"^\W*yes\W*$",), 0),
    Question("instruction", "Name the three primary colors of paint.", (r"\bred\b", r"\bblue\b", r"\byellow\b")),
    Question("instruction", 'What is the opposite of the word "hot"? Answer in one word.', (r"\bcold\b",)),
    Question("code", "Write a Python function named add that returns the sum of two numbers.",
             (r"def\s+add\s*\(\s*\w+\s*,\s*\w+\s*\)", r"return\s+\w+\s*\+\s*\w+")),
    Question("code", "In Python, how do you get the number of elements in a list named items?",
             (r"\blen\(\s*items\s*\)",)),
)


def prompt_ids(llm: LLM, question: str) -> list[int]:
    """The chat-templated prompt, or a plain completion prompt for a model without a template."""
    if llm.tokenizer.chat_template:
        return llm._encode(question, chat=True)
    return llm.tokenizer.encode(f"Question: {question}\nAnswer:")


def ask_all(llm: LLM, seeds: int, max_tokens: int) -> list[dict]:
    """Every question under every seed, batched; one record per answer."""
    jobs = [(q, s) for q in QUESTIONS for s in range(seeds)]
    stop = [] if llm.tokenizer.chat_template else ["\nQuestion:"]
    params = [SamplingParams(**SPEC, seed=1000 + s, max_tokens=max_tokens, stop=stop) for _, s in jobs]
    outs = llm.generate([prompt_ids(llm, q.text) for q, _ in jobs], params)
    records = []
    for (q, seed), out in zip(jobs, outs):
        c = out.outputs[0]
        records.append(dict(kind=q.kind, question=q.text, seed=seed, answer=c.text, passed=q.passes(c.text),
                            finish_reason=c.finish_reason, tokens=len(c.token_ids)))
    return records


def stream_speed(llm: LLM, runs: int, tokens: int = 128) -> tuple[list[float], list[float]]:
    """Wall and CPU-time tok/s of one stream generating `tokens` tokens (prefill of a short prompt
    included), `runs` times each."""
    ids = prompt_ids(llm, "Tell me about the history of Paris.")
    params = SamplingParams(**SPEC, seed=7, max_tokens=tokens, ignore_eos=True)
    llm.generate([ids], params)  # warm-up: any lazily compiled program runs once untimed
    rates, cpu_rates = [], []
    cores = len(os.sched_getaffinity(0))
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        n = len(llm.generate([ids], params)[0].outputs[0].token_ids)
        rates.append(n / (time.perf_counter() - t0))
        cpu_rates.append(n * cores / (time.process_time() - c0))
    return rates, cpu_rates


def evaluate(model: str, seeds: int, max_tokens: int, speed_runs: int, max_model_len: int) -> dict:
    t0 = time.perf_counter()
    llm = LLM(model, max_model_len=max_model_len, max_num_seqs=16)
    load_s = time.perf_counter() - t0
    records = ask_all(llm, seeds, max_tokens) if seeds else []
    rates, cpu_rates = stream_speed(llm, speed_runs)
    passed = sum(r["passed"] for r in records)
    by_kind = {k: [sum(r["passed"] for r in records if r["kind"] == k), sum(r["kind"] == k for r in records)]
               for k in dict.fromkeys(q.kind for q in QUESTIONS)}
    return dict(model=model, chat_template=bool(llm.tokenizer.chat_template), load_and_compile_s=round(load_s, 1),
                passed=passed, asked=len(records), by_kind=by_kind,
                ended=sum(r["finish_reason"] == "stop" for r in records),
                mean_tokens=round(sum(r["tokens"] for r in records) / max(1, len(records)), 1),
                tok_s_runs=[round(r, 1) for r in rates], tok_s_best=round(max(rates), 1),
                cpu_tok_s_best=round(max(cpu_rates), 1), load=os.getloadavg()[0], records=records)


def table(results: list[dict]) -> str:
    kinds = list(results[0]["by_kind"])
    head = ["model", "passed", *kinds, "ended", "mean tokens", "1-stream tok/s (best)", "runs", "cpu tok/s",
            "load"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [Path(r["model"]).name, f"{r['passed']}/{r['asked']}",
                 *(f"{a}/{b}" for a, b in r["by_kind"].values()), f"{r['ended']}/{r['asked']}",
                 str(r["mean_tokens"]), str(r["tok_s_best"]), " ".join(map(str, r["tok_s_runs"])),
                 str(r["cpu_tok_s_best"]), f"{r['load']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/eval_default_model.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", required=True, help="alias or path (repeatable)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--speed-runs", type=int, default=3)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", default="bench_results/default_model.json")
    args = ap.parse_args(argv)
    results = []
    for model in args.model:
        print(f"== {model}", file=sys.stderr, flush=True)
        results.append(evaluate(model, args.seeds, args.max_tokens, args.speed_runs, args.max_model_len))
        for r in results[-1]["records"]:
            if not r["passed"]:
                print(f"  FAIL [{r['seed']}] {r['question']!r}: {r['answer'][:120]!r}", file=sys.stderr)
        print(table(results[-1:]), file=sys.stderr, flush=True)
    print(table(results))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(spec=SPEC, seeds=args.seeds, max_tokens=args.max_tokens, load=os.getloadavg(),
                       results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
