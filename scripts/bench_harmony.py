"""Host cost of reading harmony replies (gpt-oss): the engine's HarmonyTracker per sampled token (beside the
<think> tracker on the same ids), and the harmony tool-call parser per character of answer text (beside
the Hermes parser on the same call): with tools offered the engine runs it on its own answer text, so a
harmony reply's calls leave as values (runtime/core/output.py); the server runs the others. Medians of interleaved repeats; prints and writes JSON.

    PYTHONPATH=. python scripts/bench_harmony.py [--tokenizer DIR] [--tokens 4000] [--out bench_harmony.json]

DIR: a HF tokenizer directory with the harmony special tokens (a gpt-oss checkpoint); without it the tiny
test vocabulary (scripts/tiny_models.write_harmony_tokenizer) is written to a temporary directory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from imp_jax.model.text.tokenizer import Tokenizer
from imp_jax.runtime.replies.harmony import HarmonyMarkers
from imp_jax.runtime.replies.reasoning import ThinkMarkers, ThinkTracker
from imp_jax.runtime.replies.tool_calls import HarmonyParser, HermesParser

PROMPT = "<|start|>user<|message|>What is the weather in Paris?<|end|><|start|>assistant"
SENTENCE = " Hmm so the user wants the weather in Paris, let me check it."
ARGS = json.dumps({"city": "Paris", "days": list(range(40)), "units": "metric", "note": "x" * 200})


def tokenizer(path: str | None) -> Tokenizer:
    if path:
        return Tokenizer.from_hf_dir(path)
    from tiny_models import write_harmony_tokenizer

    tmp = Path(tempfile.mkdtemp())
    write_harmony_tokenizer(tmp)
    return Tokenizer.from_hf_dir(tmp)


def per_token(make, reply: list[int], repeats: int) -> float:
    """Median seconds per token of a fresh tracker observing `reply` (answer tokens through answer_text)."""
    times = []
    for _ in range(repeats):
        tracker = make()
        t0 = time.perf_counter()
        for t in reply:
            if tracker.observe(t) == "answer":
                tracker.answer_text("x")
        times.append((time.perf_counter() - t0) / len(reply))
    return statistics.median(times)


def per_char(parser_cls, text: str, chunk: int, repeats: int) -> float:
    """Median seconds per character of parsing `text` fed in `chunk`-character pieces."""
    times = []
    for _ in range(repeats):
        parser = parser_cls()
        t0 = time.perf_counter()
        for i in range(0, len(text), chunk):
            parser.feed(text[i:i + chunk])
        parser.finish()
        times.append((time.perf_counter() - t0) / len(text))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tokens", type=int, default=4000, help="reply length (about half analysis, half final)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default="bench_harmony.json")
    args = ap.parse_args()
    tok = tokenizer(args.tokenizer)
    markers = HarmonyMarkers.from_tokenizer(tok)
    assert markers is not None, "the tokenizer has no harmony special tokens"
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    body = enc(SENTENCE * max(1, args.tokens // (2 * len(enc(SENTENCE)))))
    reply = (enc("<|channel|>analysis<|message|>") + body + enc("<|end|><|start|>assistant<|channel|>final<|message|>")
             + body + enc("<|return|>"))
    prompt = enc(PROMPT)
    think = ThinkMarkers(markers.start_id, markers.end_id, (markers.end_id,))   # same ids, the <think> tracker's rules
    harmony_s = per_token(lambda: markers.tracker(prompt), reply, args.repeats)
    think_s = per_token(lambda: ThinkTracker(think, prompt), reply, args.repeats)
    call = f"I will check.<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}"
    hermes = "I will check.\n<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": json.loads(ARGS)}) + \
        "\n</tool_call>"
    result = {
        "reply_tokens": len(reply),
        "harmony_tracker_us_per_token": harmony_s * 1e6,
        "think_tracker_us_per_token": think_s * 1e6,
        "harmony_parser_us_per_char": per_char(HarmonyParser, call, 4, args.repeats) * 1e6,
        "hermes_parser_us_per_char": per_char(HermesParser, hermes, 4, args.repeats) * 1e6,
        "call_chars": len(call),
    }
    for k, v in result.items():
        print(f"{k:32s} {v:.3f}" if isinstance(v, float) else f"{k:32s} {v}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
