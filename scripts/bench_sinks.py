"""What attention sinks (gpt-oss) cost the CPU attention backends: decode and a prefill chunk at
gpt-oss-20b's head layout (64 query heads, 8 kv heads, head_dim 64), float32, with and without sinks.

    PYTHONPATH=. python scripts/bench_sinks.py --contexts 512 2048 --batches 1 8 --repeats 20
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import Kernels
from imp_jax.kernels_pallas.attention import paged_attention
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.metadata import AttentionMetadata
from imp_jax.runtime.batch import SeqChunk, build_step_batch

H, KVH, D, BS = 64, 8, 64, 16
FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_seqs")


def batch(num_seqs: int, context: int, new: int):
    """num_seqs sequences of `context` cached tokens, each adding `new` tokens this step."""
    pages = -(-(context + new) // BS)
    chunks = [SeqChunk([1] * new, context, list(range(1 + s * pages, 1 + (s + 1) * pages))) for s in range(num_seqs)]
    b = build_step_batch(chunks, num_tokens=num_seqs * new, num_seqs=num_seqs, max_blocks=pages, block_size=BS)
    meta = AttentionMetadata(*(jnp.asarray(getattr(b, f)) for f in FIELDS))
    rng = np.random.default_rng(0)
    cache = (1, num_seqs * pages + 1, BS, KVH, D)
    kc, vc = (jnp.asarray(rng.standard_normal(cache), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_seqs * new, H, D)), jnp.float32)
    return q, kc, vc, meta


def time_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill", type=int, default=128, help="new tokens of the prefill-chunk row (1 sequence)")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    backends = ["xla"] + (["cpu"] if cpu_attention.available() else [])
    sinks = jnp.asarray(np.linspace(-2, 2, H), jnp.float32)
    print("backend | step | context | no sinks ms | sinks ms | ratio")
    print("--- | --- | --- | --- | --- | ---")
    rows = [(f"decode x{b}", b, c, 1) for c in args.contexts for b in args.batches]
    rows += [(f"prefill {args.prefill}", 1, c, args.prefill) for c in args.contexts]
    for backend in backends:
        kernels = Kernels(attention=backend)
        for label, b, c, new in rows:
            q, kc, vc, meta = batch(b, c, new)
            ms = []
            for s in (None, sinks):
                fn = jax.jit(lambda q, kc, vc, meta, s=s: paged_attention(
                    q, kc, vc, meta, 0, sm_scale=D ** -0.5, kernels=kernels, sinks=s))
                ms.append(time_ms(fn, (q, kc, vc, meta), args.repeats))
            print(f"{backend} | {label} | {c} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[1] / ms[0]:.2f}")


if __name__ == "__main__":
    main()
