"""What attention sinks (gpt-oss) cost each attention backend: decode and a prefill chunk at
gpt-oss-20b's head layout (64 query heads, 8 kv heads, head_dim 64), with and without sinks.

Backends by default: xla everywhere, the C++ kernel on an x86-64 CPU (float32), the Pallas kernel on
a Hopper GPU (bfloat16, its default kv splits). `--backends pallas --interpret` runs the Pallas kernel
in the Mosaic GPU interpreter on a CPU: a plumbing check, its times mean nothing.

    PYTHONPATH=. python scripts/bench_sinks.py --contexts 512 2048 --batches 1 8 --repeats 20
    PYTHONPATH=. python scripts/bench_sinks.py --out bench_results/sinks_h200.json     # on a GPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import Kernels
from imp_jax.kernels_pallas.attention import paged_attention
from imp_jax.kernels_pallas.backends import is_hopper
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.metadata import AttentionMetadata
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch

H, KVH, D, BS = 64, 8, 64, 16
FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_seqs")


def batch(num_seqs: int, context: int, new: int, dtype: jnp.dtype):
    """num_seqs sequences of `context` cached tokens, each adding `new` tokens this step."""
    pages = -(-(context + new) // BS)
    chunks = [SeqChunk([1] * new, context, list(range(1 + s * pages, 1 + (s + 1) * pages))) for s in range(num_seqs)]
    b = build_step_batch(chunks, num_tokens=num_seqs * new, num_seqs=num_seqs, max_blocks=pages, block_size=BS)
    meta = AttentionMetadata(*(jnp.asarray(getattr(b, f)) for f in FIELDS))
    rng = np.random.default_rng(0)
    cache = (1, num_seqs * pages + 1, BS, KVH, D)
    kc, vc = (jnp.asarray(rng.standard_normal(cache), dtype) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((num_seqs * new, H, D)), dtype)
    return q, kc, vc, meta


def time_ms(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def default_backends(device) -> list[str]:
    on_cpu = device.platform == "cpu"
    return ["xla"] + (["cpu"] if on_cpu and cpu_attention.available() else []) + (["pallas"] if is_hopper(device) else [])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prefill", type=int, default=128, help="new tokens of the prefill-chunk row (1 sequence)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backends", nargs="+", choices=["xla", "cpu", "pallas"],
                    help="default: xla, cpu on an x86-64 CPU, pallas on a Hopper GPU")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"],
                    help="queries and caches; default bfloat16 on a GPU (the Pallas kernel's), float32 on a CPU")
    ap.add_argument("--interpret", action="store_true", help="pallas in the Mosaic GPU interpreter (CPU plumbing check)")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    device = jax.local_devices()[0]
    backends = args.backends or default_backends(device)
    dtype = jnp.dtype(args.dtype or ("float32" if device.platform == "cpu" else "bfloat16"))
    sinks = jnp.asarray(np.linspace(-2, 2, H), jnp.float32)
    print(f"device {device.device_kind}; jax {jax.__version__}; {dtype.name}"
          f"{'; pallas interpreted: times mean nothing' if args.interpret and 'pallas' in backends else ''}")
    print("backend | step | context | no sinks ms | sinks ms | ratio")
    print("--- | --- | --- | --- | --- | ---")
    steps = [(f"decode x{b}", b, c, 1) for c in args.contexts for b in args.batches]
    steps += [(f"prefill {args.prefill}", 1, c, args.prefill) for c in args.contexts]
    rows = []
    for backend in backends:
        kernels = Kernels(attention=backend, pallas_interpret=args.interpret and backend == "pallas",
                          dynamic_skips=device.platform == "cpu")
        for label, b, c, new in steps:
            q, kc, vc, meta = batch(b, c, new, dtype)
            ms = []
            for s in (None, sinks):
                fn = jax.jit(lambda q, kc, vc, meta, s=s: paged_attention(
                    q, kc, vc, meta, 0, sm_scale=D ** -0.5, kernels=kernels, sinks=s))
                ms.append(time_ms(fn, (q, kc, vc, meta), args.repeats))
            print(f"{backend} | {label} | {c} | {ms[0]:.3f} | {ms[1]:.3f} | {ms[1] / ms[0]:.2f}", flush=True)
            rows.append({"backend": backend, "step": label, "context": c, "no_sinks_ms": ms[0], "sinks_ms": ms[1]})
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"device": device.device_kind, "jax": jax.__version__, "dtype": dtype.name,
                                              "interpret": args.interpret, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
