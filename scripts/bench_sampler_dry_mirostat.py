"""Cost of DRY and mirostat in the sampler: the compiled `sample` step on random logits of SmolLM2's
vocabulary (49152) at 1 and 32 rows, without DRY vs with every row holding DRY_SLOTS penalties (greedy
rows, the default skips of this backend), the host's per-row penalty computation (runtime/decoding/dry.py: the
full scan, and the engine's DryState fed one token a step) over a history of --history tokens, the scan
of 16 fresh breakers over SmolLM2's vocabulary, and sampled rows (temperature 0.8, top_p 0.95) vs
mirostat v1 / v2 rows. Medians of --repeats runs after a warm-up run.

    PYTHONPATH=. python scripts/bench_sampler_dry_mirostat.py --repeats 50 --history 1024
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import numpy as np

from imp_jax.runtime.decoding.dry import DRY_SLOTS, BreakerTable, DryParams, DryState, repeat_penalties, top_slots
from imp_jax.runtime.execution.sampling import RowSpec, build_sampling_tensors, sample

VOCAB = 49152   # SmolLM2


def time_sample(rows: int, dry: bool, repeats: int, mirostat: int | None = None) -> float:
    """Median seconds of one `sample` call (outputs waited for). `mirostat` None: greedy rows (with DRY
    or not); 0: sampled rows with top_p; 1 / 2: mirostat rows of that version."""
    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(size=(rows, VOCAB)).astype(np.float32) * 3)
    slots = [(int(i), 0.5) for i in rng.choice(VOCAB, DRY_SLOTS, replace=False)] if dry else []
    if mirostat is None:
        specs = [RowSpec(temperature=0.0, dry=slots) for _ in range(rows)]
    else:
        specs = [RowSpec(temperature=0.8, top_p=0.95, mirostat=mirostat, mirostat_mu=10.0, seed=i)
                 for i in range(rows)]
    t = build_sampling_tensors(specs, num_rows_bucket=rows, vocab_size=VOCAB, history_len=256, max_bias=64,
                               with_mask=True)
    t = jax.device_put(t)
    key = jax.random.key(0)
    jax.block_until_ready(sample(logits, t, key, num_top_logprobs=20))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(sample(logits, t, key, num_top_logprobs=20))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_host(history_len: int, repeats: int) -> float:
    """Median seconds of one row's DRY penalties over a repetitive history (breakers: one token id)."""
    rng = np.random.default_rng(1)
    phrase = list(rng.integers(0, VOCAB, 40))
    history = (phrase * (history_len // 40 + 1))[:history_len]
    p = DryParams(multiplier=0.8)
    breakers = {int(phrase[7]): [()]}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        top_slots(repeat_penalties(history, p, breakers, 8192))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_state(history_len: int, repeats: int) -> float:
    """Median seconds of one row's DRY penalties per step from its DryState (fed the step's new token)
    over a repetitive history of `history_len` tokens (the engine's path; `time_host` is the full scan)."""
    rng = np.random.default_rng(1)
    phrase = list(rng.integers(0, VOCAB, 40))
    history = (phrase * ((history_len + repeats) // 40 + 2))[:history_len + repeats]
    p = DryParams(multiplier=0.8)
    state = DryState(p, {int(phrase[7]): [()]}, max(8192, history_len + repeats))
    state.sync([], history[:history_len])
    times = []
    for n in range(history_len, history_len + repeats):
        t0 = time.perf_counter()
        top_slots(state.penalties([], history[:n + 1]))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_breakers(gguf: Path, count: int = 16) -> float | None:
    """Seconds to turn `count` fresh 40-character breakers into token sequences over SmolLM2's vocabulary
    (its texts decoded beforehand, once per tokenizer); None without the file."""
    if not gguf.exists():
        return None
    from imp_jax.model.formats.gguf_loader import _Metadata, _open
    from imp_jax.model.text.gguf_tokenizer import gguf_tokenizer

    tok = gguf_tokenizer(_Metadata(_open(gguf), gguf))[0]
    table = BreakerTable(tok, VOCAB)
    table.breakers(["warm"])
    rng = np.random.default_rng(2)
    strings = ["".join(rng.choice(list(" \n:.e,th"), 40)) for _ in range(count)]
    t0 = time.perf_counter()
    table.breakers(strings)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--history", type=int, default=1024)
    ap.add_argument("--gguf", default="~/.cache/imp_jax/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="SmolLM2's GGUF, for its tokenizer (the breaker scan is skipped without it)")
    args = ap.parse_args()
    print(f"backend {jax.default_backend()}, vocabulary {VOCAB}, DRY_SLOTS {DRY_SLOTS}")
    for rows in (1, 32):
        off, on = time_sample(rows, False, args.repeats), time_sample(rows, True, args.repeats)
        print(f"sample, {rows:2d} rows: DRY off {off * 1e3:7.3f} ms, on {on * 1e3:7.3f} ms ({on / off:.2f}x)")
    print(f"host DRY penalties, one row, history {args.history}: full scan {time_host(args.history, args.repeats) * 1e3:.3f} ms, "
          f"DryState {time_state(args.history, args.repeats) * 1e3:.3f} ms a step")
    took = time_breakers(Path(args.gguf).expanduser())
    if took is not None:
        print(f"16 fresh 40-character breakers over SmolLM2's vocabulary: {took * 1e3:.1f} ms")
    for rows in (1, 32):
        base = time_sample(rows, False, args.repeats, mirostat=0)
        v1, v2 = (time_sample(rows, False, args.repeats, mirostat=m) for m in (1, 2))
        print(f"sample, {rows:2d} sampled rows: top_p {base * 1e3:7.3f} ms, mirostat v1 {v1 * 1e3:7.3f} ms "
              f"({v1 / base:.2f}x), v2 {v2 * 1e3:7.3f} ms ({v2 / base:.2f}x)")


if __name__ == "__main__":
    main()
