"""Benchmark ragged paged attention: the Pallas kernel vs the XLA backend, with and without its
data-dependent skips (`reference`, `xla_static`), and jax's decode kernel.

The Pallas kernel runs once per `--splits` value: `auto` (its default split-KV rule; the row's
`kv_splits` says what it chose) and fixed counts (`pallas_splits=1` is the unsplit kernel), so a
GPU run shows what split-KV buys at batch 1 and long contexts. A fixed count equal to auto's is
not run twice.

Prints time, achieved HBM bandwidth and FLOP/s (as fractions of the device's peak where known)
per (mode, batch, context) and writes JSON with --out, with the bandwidth a plain x + 1 program
reaches in the same run (`measured_bandwidth`: the attainable ceiling, below the datasheet peak). `--quick` runs small sizes; off a Hopper GPU
the Pallas kernel runs in the Mosaic GPU interpreter, at the smallest size of each mode only (a
correctness smoke test against the reference, not a speed figure).

    python scripts/bench_attention.py --quick --out bench.json
    python scripts/bench_attention.py --modes decode prefill --out h200.json      # on a GPU
    python scripts/bench_attention.py --modes decode --batches 1 --contexts 2048 32768 --splits auto 1 4
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from imp_jax.kernels_pallas import AttentionMetadata, AttentionShape
from imp_jax.kernels_pallas.backends import is_hopper
from imp_jax.kernels_pallas.pallas.ragged_paged_attention import (auto_kv_splits, ragged_paged_attention_pallas,
                                                                  supports)
from imp_jax.kernels_pallas.xla.attention import ragged_paged_attention_xla
from imp_jax.runtime.execution.batch import SeqChunk, StepBatch, build_step_batch

PEAKS = {"H200": (4.8e12, 989e12), "H100": (3.35e12, 989e12)}  # HBM bytes/s, dense bf16 FLOP/s
FIELDS = ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "num_seqs")


@dataclasses.dataclass(frozen=True)
class Shape:
    """Model attention shape: heads, kv heads, head_dim, page size, dtype."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"


def device_peaks() -> tuple[float | None, float | None]:
    """(HBM bytes/s, FLOP/s) of the default device when it is one we know, else (None, None)."""
    kind = jax.devices()[0].device_kind
    for name, peaks in PEAKS.items():
        if name in kind:
            return peaks
    return None, None


def step_chunks(mode: str, batch: int, context: int, block_size: int) -> list[SeqChunk]:
    """`batch` decodes at `context`, `batch` fresh prefills of `context`, or (mixed) one 512-token
    prefill chunk ending at `context` plus batch - 1 decodes; every sequence owns its own pages."""
    pages = -(-context // block_size)
    chunk = {"decode": 1, "prefill": context, "mixed": min(512, context)}[mode]
    return [SeqChunk([0] * (chunk if mode != "mixed" or s == 0 else 1),
                     context - (chunk if mode != "mixed" or s == 0 else 1),
                     list(range(1 + s * pages, 1 + (s + 1) * pages))) for s in range(batch)]


def make_step(chunks: list[SeqChunk], shape: Shape, seed: int = 0) -> tuple[Any, ...]:
    """Random caches covering every page, q, device metadata and the host batch for `chunks`."""
    bs = shape.block_size
    pages = max(len(c.block_table) for c in chunks)
    tokens = sum(len(c.token_ids) for c in chunks)
    b = build_step_batch(chunks, num_tokens=tokens, num_seqs=len(chunks), max_blocks=pages, block_size=bs)
    meta = AttentionMetadata(*(jnp.asarray(getattr(b, f)) for f in FIELDS))
    key = jax.random.key(seed)
    cache_shape = (1, 1 + len(chunks) * pages, bs, shape.kv_heads, shape.head_dim)
    dt = jnp.dtype(shape.dtype)
    k_cache = jax.random.normal(key, cache_shape, dt)
    v_cache = jax.random.normal(jax.random.fold_in(key, 1), cache_shape, dt)
    q = jax.random.normal(jax.random.fold_in(key, 2), (tokens, shape.heads, shape.head_dim), dt)
    return q, k_cache, v_cache, meta, b


def cost(b: StepBatch, shape: Shape) -> tuple[float, float]:
    """(bytes, flops): every attended K/V byte once + q and out; 4*D FLOPs per (head, query, key)."""
    n = int(b.num_seqs)
    q_lens = np.diff(b.query_start_loc)[:n]
    kv_lens = b.seq_lens[:n].astype(np.int64)
    item = jnp.dtype(shape.dtype).itemsize
    kv_bytes = 2 * kv_lens.sum() * shape.kv_heads * shape.head_dim * item
    q_bytes = 2 * q_lens.sum() * shape.heads * shape.head_dim * item
    keys = sum(int(((kv - ql) + np.arange(1, ql + 1)).sum()) for kv, ql in zip(kv_lens, q_lens))
    return float(kv_bytes + q_bytes), 4.0 * shape.heads * shape.head_dim * keys


def time_fn(fn: Callable, args: tuple, iters: int) -> float:
    """Median seconds of `iters` calls of an already compiled and warmed-up `fn`."""
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_hbm_bandwidth(nbytes: int, iters: int = 5) -> float:
    """The device memory bandwidth (bytes/s) a plain program reaches in this run: x + 1 over an
    `nbytes` array reads and writes it once, the ceiling the attention rows are measured against."""
    x = jnp.zeros((nbytes // 4,), jnp.float32)
    add = jax.jit(lambda x: x + 1)
    jax.block_until_ready(add(x))
    return 2 * nbytes / time_fn(add, (x,), iters)


def jax_decode_kernel(interpret: bool) -> Callable | None:
    """jax's shipped decode-only paged attention (Triton; interpreted on a CPU), None if absent. It
    wants its own cache layout [KVH, NB, BS, D]: the transpose happens outside the timed call (see
    bench_one)."""
    try:
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    except Exception:  # noqa: BLE001 - absent or broken on this jax: just skip it
        return None

    def run(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata) -> jax.Array:
        pages = meta.block_tables.shape[1]
        per_block, splits = min(8, pages), 16  # it needs pages % (splits * per_block) == 0
        while splits > 1 and pages % (splits * per_block):
            splits //= 2
        return paged_attention(q, k_pages, v_pages, meta.block_tables, meta.seq_lens,
                               pages_per_compute_block=per_block, k_splits=splits, interpret=interpret)
    return jax.jit(run)


def pallas_variants(splits: list[str], auto: int) -> dict[str, int | None]:
    """Backend name -> kv_splits for each `--splits` value ('auto' or a count); a count equal to
    what auto chose is dropped (the same program)."""
    out: dict[str, int | None] = {}
    for value in splits:
        if value == "auto":
            out["pallas"] = None
        elif int(value) != auto or "auto" not in splits:
            out[f"pallas_splits={int(value)}"] = int(value)
    return out


def bench_one(mode: str, batch: int, context: int, shape: Shape, iters: int, interpret: bool,
              with_pallas: bool = True, max_reference_work: int = 1 << 27,
              splits: tuple[str, ...] = ("auto", "1")) -> list[dict]:
    """All backends on one step; one result row each (errors recorded, not raised)."""
    q, k_cache, v_cache, meta, host = make_step(step_chunks(mode, batch, context, shape.block_size), shape)
    nbytes, flops = cost(host, shape)
    scale = shape.head_dim ** -0.5
    args = (q, k_cache, v_cache, meta)
    backends: dict[str, tuple[Callable, tuple]] = {}
    auto = auto_kv_splits(q, k_cache, meta)
    chosen: dict[str, int] = {}
    if q.shape[0] * context <= max_reference_work:  # its per-step gather is [T, 64 keys, KVH, D]
        backends["reference"] = (jax.jit(lambda q, k, v, meta: ragged_paged_attention_xla(
            q, k, v, meta, 0, sm_scale=scale)), args)
        backends["xla_static"] = (jax.jit(lambda q, k, v, meta: ragged_paged_attention_xla(
            q, k, v, meta, 0, sm_scale=scale, dynamic_skips=False)), args)
    if with_pallas and (interpret or supports(AttentionShape.of(q, k_cache))):
        for name, n in pallas_variants(list(splits), auto).items():
            backends[name] = (jax.jit(functools.partial(_pallas, sm_scale=scale, interpret=interpret,
                                                        kv_splits=n)), args)
            chosen[name] = auto if n is None else n
    jax_kernel = jax_decode_kernel(interpret) if mode == "decode" and with_pallas else None
    if jax_kernel is not None:
        pages = tuple(c[0].transpose(2, 0, 1, 3) for c in (k_cache, v_cache))
        backends["jax_paged_attention"] = (jax_kernel, (q * scale, *pages, meta))   # it takes q pre-scaled
    peak_bw, peak_flops = device_peaks()
    rows, ref_out = [], None
    for name, (fn, fn_args) in backends.items():
        row = dict(mode=mode, batch=batch, context=context, backend=name, tokens=int(q.shape[0]),
                   bytes=nbytes, flops=flops, **dataclasses.asdict(shape))
        if name in chosen:
            row["kv_splits"] = chosen[name]
        try:
            out = jax.block_until_ready(fn(*fn_args))
            if name == "reference":
                ref_out = np.asarray(out, np.float32)
            elif ref_out is not None:
                err = np.abs(np.asarray(out, np.float32) - ref_out).max()
                row["max_abs_err_vs_reference"] = float(err)
            sec = time_fn(fn, fn_args, iters)
        except Exception as e:  # noqa: BLE001 - a failing backend is a result, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            rows.append(row)
            continue
        row.update(seconds=sec, bandwidth=nbytes / sec, flop_rate=flops / sec,
                   hbm_fraction=nbytes / sec / peak_bw if peak_bw else None,
                   flop_fraction=flops / sec / peak_flops if peak_flops else None)
        rows.append(row)
    return rows


def _pallas(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMetadata, *, sm_scale: float,
            interpret: bool, kv_splits: int | None) -> jax.Array:
    return ragged_paged_attention_pallas(q, k, v, meta, 0, sm_scale=sm_scale, interpret=interpret,
                                         kv_splits=kv_splits)


def fmt(row: dict) -> str:
    """One table line."""
    backend = row["backend"] + (f" ({row['kv_splits']})" if row["backend"] == "pallas" else "")
    head = f"{row['mode']:8s} {row['batch']:4d} {row['context']:6d} {backend:20s}"
    if "error" in row:
        return f"{head} ERROR {row['error']}"
    frac = lambda x: f"{100 * x:6.1f}%" if x is not None else "      -"
    err = row.get("max_abs_err_vs_reference")
    return (f"{head} {row['seconds'] * 1e3:10.3f} ms {row['bandwidth'] / 1e9:9.2f} GB/s"
            f" {frac(row['hbm_fraction'])} {row['flop_rate'] / 1e12:8.3f} TFLOP/s"
            f" {frac(row['flop_fraction'])}"
            + (f"  err {err:.2e}" if err is not None else ""))


def main() -> None:
    """Parse arguments, run the sweep, print and optionally save it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes (CPU smoke run)")
    p.add_argument("--modes", nargs="+", default=["decode", "prefill", "mixed"])
    p.add_argument("--batches", type=int, nargs="+", help="default 1 8 32 64 128 256 (--quick: 1 3)")
    p.add_argument("--contexts", type=int, nargs="+", help="default 512 2048 8192 32768 (--quick: 100 200)")
    p.add_argument("--max-kv-tokens", type=int, default=1 << 22, help="skip steps with more cached tokens")
    p.add_argument("--max-prefill-tokens", type=int, default=32768)
    p.add_argument("--max-reference-work", type=int, default=1 << 27,
                   help="skip the XLA reference when query tokens x context exceeds this")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--splits", nargs="+", default=["auto", "1"],
                   help="the Pallas kernel's kv_splits to run: 'auto' (its rule) and/or counts")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--hbm-bytes", type=int, default=2 << 30,
                   help="array size of the device bandwidth measurement the rows are compared with")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    shape = Shape(a.heads, a.kv_heads, a.head_dim, a.block_size, a.dtype)
    if a.quick:
        a.batches, a.contexts, a.iters = a.batches or [1, 3], a.contexts or [100, 200], 1   # 100 keys: 2 kv steps
        a.hbm_bytes = min(a.hbm_bytes, 64 << 20)
        shape = Shape(4, 2, 64, 16, a.dtype)
    a.batches, a.contexts = a.batches or [1, 8, 32, 64, 128, 256], a.contexts or [512, 2048, 8192, 32768]
    interpret = not is_hopper(jax.local_devices()[0])
    mode = "interpreted" if interpret else "compiled"
    print(f"device {jax.devices()[0].device_kind}; pallas {mode}; {shape}")
    hbm = measure_hbm_bandwidth(a.hbm_bytes)
    print(f"measured device bandwidth (x + 1 over {a.hbm_bytes >> 20} MiB): {hbm / 1e9:.1f} GB/s")
    meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__, peaks=device_peaks(),
                interpret=interpret, measured_bandwidth=hbm)
    rows: list[dict] = []
    for mode in a.modes:
        for batch in a.batches:
            for context in a.contexts:
                q_tokens = sum(len(c.token_ids) for c in step_chunks(mode, batch, context, shape.block_size))
                if batch * context > a.max_kv_tokens or q_tokens > max(a.max_prefill_tokens, batch):
                    continue
                # interpreted, the kernel takes seconds per call: smoke-test it at the smallest size only
                smallest = batch == min(a.batches) and context == min(a.contexts)
                for row in bench_one(mode, batch, context, shape, a.iters, interpret,
                                     with_pallas=not interpret or smallest,
                                     max_reference_work=a.max_reference_work, splits=tuple(a.splits)):
                    print(fmt(row), flush=True)
                    rows.append(row)
                if a.out:  # after every step size, so a run stopped part way keeps what it measured
                    with open(a.out, "w") as f:
                        json.dump(dict(meta=meta, results=rows), f, indent=1)
    if a.out:
        print(f"wrote {len(rows)} rows to {a.out}")

if __name__ == "__main__":
    main()
