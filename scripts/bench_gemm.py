"""The CPU GEMM kernel on a real model's matrices: the exact path (`--gemm exact`) against int8
activations (`--gemm cpu_q8`), per matrix kind and row count, and one step's GEMMs in all.

    python scripts/bench_gemm.py [--model smollm2-135m-instruct] [--rows 1 8 32 64 256] [--repeats 7]
                                 [--modes exact q8] [--hot]
    python scripts/bench_gemm.py --formats Q4_1 Q5_0 Q4_K Q6_K [--shapes 2048x2048 8192x2048 2048x8192]
                                 [--copies 8] [--rows 1 32] [--modes exact q8]

Each timed program runs one kind of projection over every layer's matrix (distinct arrays, so a
decode-sized product reads its weights from memory as a step does), best of `repeats`. 'step' is
the sum over the kinds plus the LM head on the same rows: the GEMM time of a step of that many
rows (a decode step samples every row). `--hot` gives every layer the first layer's matrix instead, so
the weights come from the caches: the kernels' arithmetic and threading without DRAM's bandwidth
(which on a shared VM varies from run to run).

`--formats` times synthetic matrices instead of a model's: for each shape N x K and each GGML
format, `--copies` distinct matrices of random valid blocks (random bytes, finite f16 scales: the
kernel's work does not depend on the values), so formats the model's file lacks (K-quants need K a
multiple of 256, which SmolLM2-135M's 576 is not) can be compared at the same shapes.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def best_seconds(fn, args, repeats: int) -> float:
    fn(*args)[0].block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for y in fn(*args):
            y.block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def synthetic(formats: list[str], shapes: list[str], copies: int) -> dict[str, tuple]:
    """{"<N> x <K> <format>": `copies` distinct matrices of random valid blocks} on the device."""
    import jax.numpy as jnp

    from imp_jax.kernels_pallas import ggml_blocks

    f16_fields = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q2_K": [80, 82],
                  "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0],
                  "IQ4_NL": [0, 18], "MXFP4": []}   # IQ4_NL: kept pairs of the file's 18-byte blocks
    rng = np.random.default_rng(0)
    kinds = {}
    for shape in shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        for fmt in formats:
            nb = k // ggml_blocks.WEIGHTS[fmt]
            ws = []
            for _ in range(copies):
                b = rng.integers(0, 256, (n, nb, ggml_blocks.FORMATS[fmt]), dtype=np.uint8)
                for at in f16_fields[fmt]:
                    b[..., at:at + 2] = (rng.standard_normal((n, nb)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
                if fmt == "MXFP4":   # E8M0 exponents of typical scales
                    b[..., 0] = rng.integers(118, 126, (n, nb))
                ws.append(jnp.asarray(b))
            kinds[f"{n} x {k} {fmt}"] = tuple(ws)
    return kinds


def bench_formats(args) -> int:
    """--formats: per shape and row count, the formats timed in turn within each repeat (so drifts
    in the machine's speed hit them alike); the median and best over the repeats, and the weight
    bytes each pass streams."""
    import jax
    import jax.numpy as jnp

    from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm

    kinds = synthetic(args.formats, args.shapes, args.copies)
    progs = {m: jax.jit(lambda x, ws, q8=m == "q8": [cpu_gemm.matmul_wt_cpu(x, w, q8) for w in ws]) for m in args.modes}
    runs = [(fmt, m) for fmt in args.formats for m in args.modes]   # each format in each mode, in turn
    print(f"{'matrix':<22} {'mode':<5} {'MiB/pass':>8} {'rows':>5} {'median ms':>10} {'best ms':>9} {'GB/s':>7} "
          f"{'GFLOP/s':>8}" + (f" {'q8 speed-up':>11}" if len(args.modes) == 2 else ""))
    for shape in args.shapes:
        n, k = (int(v) for v in shape.lower().split("x"))
        for rows in args.rows:
            x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
            times = {run: [] for run in runs}
            for fmt, m in runs:
                best_seconds(progs[m], (x, kinds[f"{n} x {k} {fmt}"]), 1)   # compile and warm
            for _ in range(args.repeats):
                for fmt, m in runs:
                    ws = kinds[f"{n} x {k} {fmt}"]
                    t0 = time.perf_counter()
                    for y in progs[m](x, ws):
                        y.block_until_ready()
                    times[fmt, m].append(time.perf_counter() - t0)
            for fmt, m in runs:
                ws = kinds[f"{n} x {k} {fmt}"]
                nbytes = sum(w.nbytes for w in ws)
                med, best = float(np.median(times[fmt, m])), min(times[fmt, m])
                ratio = (f" {np.median(times[fmt, 'exact']) / med:10.2f}x"
                         if m == "q8" and len(args.modes) == 2 else "")
                print(f"{n} x {k} {fmt:<6} (x{len(ws)}) {m:<5} {nbytes / 2**20:8.1f} {rows:5d} {med * 1e3:10.3f} "
                      f"{best * 1e3:9.3f} {nbytes / med / 1e9:7.1f} {2 * rows * n * k * len(ws) / med / 1e9:8.1f}" + ratio)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 256])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--hot", action="store_true", help="the same matrix in every layer: weights from the caches")
    ap.add_argument("--modes", nargs="+", choices=["exact", "q8"], default=["exact", "q8"],
                    help="which arithmetic to time (the speed-up column needs both)")
    ap.add_argument("--formats", nargs="+", help="time synthetic matrices in these GGML formats (no model)")
    ap.add_argument("--shapes", nargs="+", default=["2048x2048", "8192x2048", "2048x8192"],
                    help="N x K of the synthetic matrices (--formats)")
    ap.add_argument("--copies", type=int, default=8, help="distinct matrices per shape and format (--formats)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp

    from imp_jax.kernels_pallas import ggml_blocks
    from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
    from imp_jax.model.formats.loader import load_model

    if not cpu_gemm.available():
        print("the CPU GEMM kernel is not available here")
        return 1
    if args.formats:
        return bench_formats(args)
    from imp_jax.kernels_pallas import Kernels
    model = load_model(args.model, dtype="float32", kernels=Kernels(attention="cpu", gemm="exact")).model
    kinds = dict(model.layers.matrices())
    head = model.embed if model.lm_head is None else model.lm_head
    kinds["lm_head"] = (head[...],)
    if args.hot:
        kinds = {kind: (ws[0],) * len(ws) for kind, ws in kinds.items()}
    lib = cpu_gemm.build.load("gemm_q8")
    paths = ["vpmaddubsw (AVX2)", "vpdpbusd (AVX512-VNNI, 256-bit)", "AVX-512 (the one-row path and the tiles on 512 bits)"]
    print(f"q8 integer dot: {paths[lib.imp_gemm_q8_isa()]}")

    modes = {m: q8 for m, q8 in {"exact": False, "q8": True}.items() if m in args.modes}
    progs = {m: jax.jit(lambda x, ws, q8=q8: [cpu_gemm.matmul_wt_cpu(x, w, q8) for w in ws]) for m, q8 in modes.items()}
    print(f"{'matrix':<26} {'format':<6} {'rows':>5} " + " ".join(f"{m + ' GFLOP/s':>15}" for m in modes) + f" {'speed-up':>9}")
    step = {m: {r: 0.0 for r in args.rows} for m in modes}
    for kind, ws in kinds.items():
        n, k = ggml_blocks.matrix_shape(ws[0])
        fmt = ggml_blocks.format_of(ws[0]) or str(ws[0].dtype)
        for rows in args.rows:
            x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32))
            flops = 2 * rows * n * k * len(ws)
            rate = {}
            for m in modes:
                s = best_seconds(progs[m], (x, ws), args.repeats)
                step[m][rows] += s
                rate[m] = flops / s / 1e9
            label = f"{kind} {n} x {k}" + (f" (x{len(ws)})" if len(ws) > 1 else "")
            print(f"{label:<26} {fmt:<6} {rows:5d} " + " ".join(f"{rate[m]:15.1f}" for m in modes)
                  + (f" {rate['q8'] / rate['exact']:8.2f}x" if len(rate) == 2 else ""))
    print("one step's GEMMs (ms): " + "; ".join(
        f"{r} rows: " + ", ".join(f"{m} {step[m][r] * 1e3:.2f}" for m in modes) for r in args.rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
