"""How much the int8-activation GEMM (`--gemm cpu_q8`) changes a GGUF model's outputs against the
exact kernel (`--gemm exact`, the dequantised model's float32 products).

    python scripts/compare_gemm.py [--model smollm2-135m-instruct] [--max-tokens 32] [--out FILE]

- greedy continuations of 20 chat prompts: how many are identical, and where the others first differ;
- a text of ~700 tokens read teacher-forced: the largest logit difference (and relative to the
  logits' range), how often the two agree on the next token's argmax, and the mean log-likelihood
  of the text's tokens (perplexity) under each.
Both models run the same forward on one sequence at a time (prefill, then one token per step).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

PROMPTS = [
    "What is the capital of France?", "Name three colors of the rainbow.", "What is 2 + 2?",
    "How many legs does a spider have?", "Write a haiku about the sea.", "What is photosynthesis?",
    "Translate 'good morning' into Spanish.", "Who wrote Romeo and Juliet?", "Give me a synonym for happy.",
    "What is the boiling point of water in Celsius?", "Explain what a prime number is.",
    "List three fruits that are red.", "What does a compiler do?", "Why is the sky blue?",
    "Suggest a name for a pet cat.", "What is the largest planet in the solar system?",
    "How do I make a cup of tea?", "What is the opposite of cold?", "Write one sentence about autumn.",
    "What language is spoken in Brazil?",
]

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him. Below, the harbour filled with fishing boats returning from the grey northern "
    "sea, their decks heavy with nets and their crews singing old songs. In the village, the baker was "
    "already preparing the dough for the morning bread, while the schoolteacher graded essays about the "
    "history of the railway that had reached the coast a century ago.\n\n"
    "Nobody remembered exactly when the first lamp was lit, but everyone agreed that the light had never "
    "failed, not even during the great storm that flooded the lower streets and carried away the old "
    "wooden pier. Scientists who visited the island measured the tides, collected samples of seaweed, and "
    "wrote long reports about the migrating birds that rested on the cliffs each autumn before crossing "
    "the ocean to warmer lands.\n\n"
    "A computer program is a sequence of instructions that a machine can follow. Early computers were "
    "programmed by hand, with switches and punched cards, and a single mistake could cost a day of work. "
    "Today, programmers write code in languages that are translated into machine instructions by "
    "compilers and interpreters. Good programs are easy to read, easy to test and easy to change; the "
    "best programmers spend more time thinking about the problem than typing.\n\n"
    "Water covers about seventy percent of the surface of the Earth. Most of it is salt water in the "
    "oceans; only a small fraction is fresh water, and much of that is frozen in glaciers and ice caps. "
    "Rivers carry rain from the mountains to the sea, shaping valleys and depositing fertile soil on "
    "their banks, which is why so many of the first cities were built beside them.\n\n"
    "When you cook pasta, bring a large pot of salted water to a rolling boil before adding the noodles. "
    "Stir them during the first minute so that they do not stick together, and taste a piece a minute "
    "or two before the time written on the package. Save a cup of the cooking water: its starch helps "
    "the sauce cling to the pasta.\n\n"
    "The history of science is long and full of surprising turns. Ideas that seemed obvious were proved "
    "wrong, and ideas that seemed absurd turned out to be right. Careful measurement, honest reporting "
    "and the willingness to change one's mind are what allow knowledge to grow from one generation to "
    "the next."
)


class Runner:
    """One model's forward over a paged KV cache, one sequence at a time (jitted per token count)."""

    def __init__(self, model, max_len: int, block_size: int = 16):
        import jax
        import jax.numpy as jnp
        from flax import nnx

        self.block_size, self.max_blocks = block_size, max_len // block_size + 1
        shape = model.kv_cache_shape(self.max_blocks + 1, block_size)
        self.kv = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
        graphdef, self.state = nnx.split(model)

        def forward(state, kv, input_ids, positions, meta):
            m = nnx.merge(graphdef, state)
            hidden, kv = m(input_ids, positions, kv, meta)
            return m.logits(hidden), kv

        self._forward = jax.jit(forward, donate_argnums=1)

    def run(self, ids: list[int], start: int, num_tokens: int) -> np.ndarray:
        """Logits [len(ids), vocab] of tokens ids at positions start.. of the one sequence."""
        import jax.numpy as jnp

        from imp_jax.kernels_pallas import AttentionMetadata
        from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch

        table = list(range(1, self.max_blocks + 1))
        b = build_step_batch([SeqChunk(ids, start, table)], num_tokens=num_tokens, num_seqs=1,
                             max_blocks=self.max_blocks, block_size=self.block_size)
        meta = AttentionMetadata(*(jnp.asarray(a) for a in (b.query_start_loc, b.seq_lens, b.block_tables,
                                                              b.slot_mapping, b.num_seqs)))
        logits, self.kv = self._forward(self.state, self.kv, jnp.asarray(b.input_ids), jnp.asarray(b.positions), meta)
        return np.asarray(logits)[:len(ids)]

    def greedy(self, prompt: list[int], steps: int, stop: frozenset[int], prompt_tokens: int) -> list[int]:
        last, out = self.run(prompt, 0, prompt_tokens)[-1], []
        for _ in range(steps):
            out.append(int(np.argmax(last)))
            if out[-1] in stop:
                break
            last = self.run([out[-1]], len(prompt) + len(out) - 1, 1)[0]
        return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default="bench_results/compare_gemm.json")
    args = ap.parse_args()

    from imp_jax.kernels_pallas import Kernels
    from imp_jax.kernels_pallas.cpu import attention as cpu_attention
    from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
    from imp_jax.model.formats.loader import load_model

    if not (cpu_gemm.available() and cpu_attention.available()):
        print("the CPU kernels are not available here")
        return 1
    modes = {"exact": None, "cpu_q8": None}
    for gemm in modes:
        loaded = load_model(args.model, dtype="float32", kernels=Kernels(attention="cpu", gemm=gemm))
        modes[gemm] = (loaded, Runner(loaded.model, 1024))
    tok = modes["exact"][0].tokenizer
    stop = frozenset(tok.eos_ids)

    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
               for p in PROMPTS]
    outs = {g: [r.greedy(p, args.max_tokens, stop, 64) for p in prompts] for g, (_, r) in modes.items()}
    same, diverge = 0, []
    for i, (a, b) in enumerate(zip(outs["exact"], outs["cpu_q8"])):
        if a == b:
            same += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        diverge.append(dict(prompt=PROMPTS[i], first_difference=k, exact=tok.decode(a), q8=tok.decode(b)))

    text = tok.encode(TEXT)
    logits = {g: r.run(text, 0, 1024) for g, (_, r) in modes.items()}
    diff = np.abs(logits["exact"] - logits["cpu_q8"])
    span = np.ptp(logits["exact"], axis=-1)
    nll = {g: -float(np.mean(log_softmax(lg[:-1])[np.arange(len(text) - 1), text[1:]])) for g, lg in logits.items()}
    agree = float(np.mean(np.argmax(logits["exact"], -1) == np.argmax(logits["cpu_q8"], -1)))

    result = dict(model=args.model, prompts=len(PROMPTS), max_tokens=args.max_tokens, identical_greedy=same,
                  diverging=diverge, text_tokens=len(text), max_abs_logit_diff=float(diff.max()),
                  mean_abs_logit_diff=float(diff.mean()), max_logit_diff_over_range=float((diff.max(-1) / span).max()),
                  next_token_argmax_agreement=agree, mean_nll=nll, perplexity={g: float(np.exp(v)) for g, v in nll.items()})
    print(f"greedy, {args.max_tokens} tokens: {same}/{len(PROMPTS)} prompts identical")
    for d in diverge:
        print(f"  {d['prompt']!r} differs at token {d['first_difference']}:\n    exact: {d['exact']!r}\n    q8:    {d['q8']!r}")
    print(f"text of {len(text)} tokens, teacher-forced: max |logit difference| {diff.max():.4f} (mean {diff.mean():.4f}; "
          f"at most {result['max_logit_diff_over_range']:.2%} of a row's logit range); next-token argmax agrees at "
          f"{agree:.1%} of positions")
    print("mean log-likelihood per token: " + ", ".join(f"{g} {-v:.4f} (perplexity {np.exp(v):.3f})" for g, v in nll.items()))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
