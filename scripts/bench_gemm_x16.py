"""The q8 GEMM on Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K / Q6_K / IQ4_XS / IQ4_NL matrices as the file stores them (gemm_q8.h's AVX-512 path) against the same
matrices interleaved 16 rows at a time (ggml_x16.py, gemm_q8_x16.h): one thread, outside XLA, interleaved rounds.

    python scripts/bench_gemm_x16.py [--cases Q5_0:3072x576 Q8_0:49152x576 ...] [--rows 1 8 32 256]
                                     [--rounds 15] [--copies 8] [--out bench_results/gemm_x16.json]

Each round times both layouts once per case (`--copies` distinct matrices, so the weights come from memory
as in a decode step's layers; 1 keeps one matrix in the caches), in this thread's CPU time. Printed per case:
each layout's median (and best) ms per call and the median (min-max) of the per-round ratios x16 / file.
The default cases are SmolLM2-135M Q4_K_M's Q5_0, Q8_0, Q4_K and Q6_K matrices (fused qkv, o, gate_up, down, the
LM head).
Needs a CPU with the q8 library's AVX-512 path.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import numpy as np

CASES = ["Q5_0:960x576", "Q8_0:960x576", "Q5_0:576x576", "Q5_0:3072x576", "Q4_K:576x1536", "Q6_K:576x1536", "Q8_0:49152x576"]
# (a case's K must be whole blocks of its format: 256 weights for the K-quants and IQ4_XS, 64 for IQ4_NL)


def random_blocks(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random valid blocks of `fmt` for an [n, k] matrix (scripts/quant_blocks.py), as the loader keeps them."""
    from quant_blocks import BLOCK_WEIGHTS, random_blocks as blocks

    from imp_jax.kernels_pallas import ggml_blocks

    b = blocks(fmt, n, k // BLOCK_WEIGHTS[fmt], seed=seed)
    return ggml_blocks.iq4_nl_pairs(b) if fmt == "IQ4_NL" else b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=CASES)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 8, 32, 256])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--copies", type=int, default=8)
    p.add_argument("--out", default="bench_results/gemm_x16.json")
    args = p.parse_args(argv)

    from imp_jax.kernels_pallas import ggml_blocks, ggml_x16
    from imp_jax.kernels_pallas.cpu import build
    from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm

    if not cpu_gemm.interleaves():
        print("this CPU lacks the q8 library's AVX-512 path: nothing to compare", file=sys.stderr)
        return 1
    lib = build.load("gemm_q8")
    for fn in (lib.imp_gemm_q8_run, lib.imp_gemm_q8_x16_run):
        fn.restype = ctypes.c_int
    lib.imp_gemm_q8_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    lib.imp_gemm_q8_x16_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    rng = np.random.default_rng(0)
    results = []
    print(f"{'case':<16} {'rows':>5} {'file ms (best)':>20} {'x16 ms (best)':>20} {'x16 / file':>24}")
    for case in args.cases:
        fmt, shape = case.split(":")
        n, k = (int(v) for v in shape.split("x"))
        raw = [random_blocks(fmt, n, k, i) for i in range(args.copies)]
        groups = [ggml_x16.interleave(b, fmt) for b in raw]
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = np.zeros((m, n), np.float32)

            def file_call(i: int) -> None:
                assert lib.imp_gemm_q8_run(ggml_blocks.FORMATS[fmt], 2, x.ctypes.data, m, k, raw[i].ctypes.data, n, y.ctypes.data) == 0

            def x16_call(i: int) -> None:
                assert lib.imp_gemm_q8_x16_run(groups[i].shape[-1], x.ctypes.data, m, k, groups[i].ctypes.data, n,
                                               y.ctypes.data) == 0

            times: dict[str, list[float]] = {"file": [], "x16": []}
            for r in range(args.rounds):
                for name, call in (("file", file_call), ("x16", x16_call))[:: 1 if r % 2 else -1]:
                    t0 = time.thread_time()
                    for i in range(args.copies):
                        call(i)
                    times[name].append(1e3 * (time.thread_time() - t0) / args.copies)
            ratios = np.array(times["x16"]) / np.array(times["file"])
            row = {"case": case, "rows": m, **{f"{k_}_ms_median": float(np.median(v)) for k_, v in times.items()},
                   **{f"{k_}_ms_best": float(np.min(v)) for k_, v in times.items()},
                   "ratio_median": float(np.median(ratios)), "ratio_min": float(ratios.min()), "ratio_max": float(ratios.max())}
            results.append(row)
            print(f"{case:<16} {m:>5} {row['file_ms_median']:>11.4f} ({row['file_ms_best']:.4f}) "
                  f"{row['x16_ms_median']:>11.4f} ({row['x16_ms_best']:.4f}) "
                  f"{row['ratio_median']:>9.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rounds": args.rounds, "copies": args.copies, "results": results}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
