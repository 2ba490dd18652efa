"""The CPU attention kernel (attention.cc) of two or more git revisions, interleaved in one process, at
decode shapes: one query row per sequence, every layer of a model, through XLA as the engine calls it.

    python scripts/bench_attention_ab.py --revs main . [--batches 8 32] [--contexts 64 256 512 1024]
                                         [--dtypes float32 bfloat16] [--rounds 11]
    taskset -c 0 python scripts/bench_attention_ab.py ...   # one thread: XLA's pool follows the affinity

Each revision's attention.cc (`git show REV:...`; `.` is the working tree) is compiled as build.py
compiles it and its handler registered as a custom-call target of its own. One call of a case is a jitted
program of `--layers` kernel calls, each layer's output the next one's query (so they run one after the
other, as in a decode step), over caches of `--layers` layers whose pages each sequence owns (so the K/V
come from memory, as in a decode step). Each round runs every revision once per case, their order
rotating from round to round; the time is the process's CPU time (all threads, the spinning wait of the
calling thread included), and the wall time beside it. Printed per case: each revision's median ms per
step (all layers) and GB/s of K/V read (every attended key and value once), and the median (min-max) of
the per-round CPU-time ratios to the first revision. The default shape is SmolLM2-135M's (9 query
heads, 3 KV heads, head_dim 64, 30 layers) with the engine's default page of 16 tokens.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))


def build(rev: str, out: Path) -> ctypes.CDLL:
    """attention.cc of revision `rev` ('.': the working tree) with its headers, compiled into `out`, loaded."""
    from bench_gemm_q8_ab import kernel_sources

    from imp_jax.kernels_pallas.cpu import build as kbuild

    src = out / "src"
    kernel_sources(rev, src)
    lib = out / "attention.so"
    subprocess.run(["g++", *kbuild.FLAGS, *kbuild.KERNEL_FLAGS.get("attention", ()), "-fno-gnu-unique", "-w",
                    "-fPIC", "-shared", "-I", kbuild.include_dir(), str(src / "attention.cc"), "-o", str(lib)],
                   check=True)
    return ctypes.CDLL(str(lib))


def step(target: str, layers: int, cache_layers: int, scale: float):
    """A jitted decode step's attention: `layers` calls of kernel `target`, each output the next query,
    call i reading cache layer i % cache_layers."""
    def run(q, k_cache, v_cache, qsl, seq_lens, tables, num_seqs):
        empty_f, empty_i = jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)
        call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        for layer in range(layers):
            q = call(q, k_cache, v_cache, jnp.int32(layer % cache_layers), qsl, seq_lens, tables, num_seqs, empty_f, empty_i,
                     sm_scale=np.float32(scale), sliding_window=np.int64(0), soft_cap=np.float32(0.0))
        return q
    return jax.jit(run)


def make_case(batch: int, context: int, dtype: str, a: argparse.Namespace) -> tuple:
    """Random caches and decode metadata: `batch` sequences at `context` keys (the last one the new token's)."""
    rng = np.random.default_rng(batch * 100003 + context)
    pages = -(-context // a.block_size)
    blocks = 1 + batch * pages
    shape = (a.cache_layers or a.layers, blocks, a.block_size, a.kv_heads, a.head_dim)
    k_cache = rng.standard_normal(shape, np.float32)
    v_cache = rng.standard_normal(shape, np.float32)
    if dtype == "bfloat16":   # the bits, as a CPU engine stores a bfloat16 cache
        k_cache, v_cache = (jnp.asarray(c, jnp.bfloat16).view(jnp.uint16) for c in (k_cache, v_cache))
    else:
        k_cache, v_cache = jnp.asarray(k_cache), jnp.asarray(v_cache)
    tables = 1 + rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32)
    q = jnp.asarray(rng.standard_normal((batch, a.heads, a.head_dim), np.float32))
    meta = (jnp.arange(batch + 1, dtype=jnp.int32), jnp.full((batch,), context, jnp.int32), jnp.asarray(tables),
            jnp.int32(batch))
    return (q, k_cache, v_cache, *meta)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--revs", nargs="+", default=["main", "."], help="git revisions ('.': the working tree)")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 256, 512, 1024])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--cache-layers", type=int, default=0,
                    help="layers the caches hold, read in turn (default --layers; 1: the K/V stay in the CPU's "
                         "caches, the kernel's arithmetic alone)")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(2) as pool:
            libs = list(pool.map(lambda ir: build(ir[1], Path(tmp) / str(ir[0])), enumerate(args.revs)))
        steps = []
        for i, lib in enumerate(libs):
            jax.ffi.register_ffi_target(f"imp_attention_ab_{i}", jax.ffi.pycapsule(lib.ImpRaggedPagedAttentionF32),
                                        platform="cpu")
            steps.append(step(f"imp_attention_ab_{i}", args.layers, args.cache_layers or args.layers,
                              args.head_dim ** -0.5))
        print(f"{len(os.sched_getaffinity(0))} schedulable cores (XLA's intra-op pool follows them); "
              f"{args.layers} layers, {args.heads}/{args.kv_heads} heads, D {args.head_dim}, page {args.block_size}")
        print(f"{'dtype':<9} {'batch':>5} {'ctx':>5} " + " ".join(f"{rev + ' ms (wall) GB/s':>26}" for rev in args.revs)
              + "".join(f" {rev + ' / ' + args.revs[0]:>22}" for rev in args.revs[1:]) + "  max |diff|")
        for dtype in args.dtypes:
            item = 4 if dtype == "float32" else 2
            for batch in args.batches:
                for context in args.contexts:
                    case = make_case(batch, context, dtype, args)
                    outs = [np.asarray(jax.block_until_ready(s(*case))) for s in steps]
                    diff = max(float(np.abs(o - outs[0]).max()) for o in outs)
                    cpu, wall = np.zeros((args.rounds, len(libs))), np.zeros((args.rounds, len(libs)))
                    for r in range(args.rounds):
                        for j in np.roll(np.arange(len(libs)), r):
                            t0, w0 = time.process_time(), time.perf_counter()
                            jax.block_until_ready(steps[j](*case))
                            cpu[r, j], wall[r, j] = time.process_time() - t0, time.perf_counter() - w0
                    kv_bytes = 2 * batch * context * args.kv_heads * args.head_dim * item * args.layers
                    med, wmed = np.median(cpu, 0), np.median(wall, 0)
                    ratios = [cpu[:, j] / cpu[:, 0] for j in range(1, len(libs))]
                    print(f"{dtype:<9} {batch:5d} {context:5d} "
                          + " ".join(f"{t * 1e3:8.2f} ({w * 1e3:6.2f}) {kv_bytes / w / 1e9:6.1f}" for t, w in zip(med, wmed))
                          + "".join(f" {np.median(q):8.3f} ({q.min():.3f}-{q.max():.3f})" for q in ratios)
                          + f"  {diff:.1e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
