"""The q8 GEMM library (gemm_q8.cc and its headers) of two or more git revisions, interleaved in one
process: per weight format, matrix shape and row count, one thread, outside XLA.

    python scripts/bench_gemm_q8_ab.py --revs main HEAD [--cases Q5_0:3072x576 Q4_K:576x1536 ...]
                                       [--rows 1 8 32] [--rounds 21] [--copies 8] [--isa 2]

Each revision's sources (`git show REV:imp_jax/kernels_pallas/cpu/...`; `.` is the working tree) are
compiled as build.py compiles them, plus `-fno-gnu-unique`: the libraries' template statics (the tile
tables) would otherwise be merged across the libraries loaded in one process. Each round calls every
revision once per case (`--copies` distinct matrices, so the weights come from memory as in a decode
step's layers), the revisions' order rotating from round to round, timed in this thread's CPU time (a
machine shared with other work preempts the thread; that time is not counted, what the other work does
to the caches and memory bandwidth is). Printed per case: each revision's median (and best) ms per call (per matrix) and the
median (min-max) of the per-round ratios to the first revision. The default cases are the matrices of
SmolLM2-135M's llama-quantize Q4_K_M (fused qkv Q5_0 or Q8_0, o Q5_0, gate_up Q5_0, down Q4_K or
Q6_K, the tied LM head Q8_0).
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
KERNELS = "imp_jax/kernels_pallas/cpu"
CASES = ["Q5_0:960x576", "Q8_0:960x576", "Q5_0:576x576", "Q5_0:3072x576", "Q4_K:576x1536", "Q6_K:576x1536",
         "Q8_0:49152x576"]


def kernel_sources(rev: str, src: Path) -> None:
    """The CPU kernels' sources (`*.cc`, `*.h`) of revision `rev` ('.': the working tree) written into `src`."""
    src.mkdir(parents=True)
    names = subprocess.run(["git", "ls-tree", "--name-only", rev if rev != "." else "HEAD", f"{KERNELS}/"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        if name.endswith((".h", ".cc")):
            data = ((ROOT / name).read_bytes() if rev == "." else
                    subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, check=True).stdout)
            (src / Path(name).name).write_bytes(data)
    if rev == ".":   # headers new in the working tree
        for h in (ROOT / KERNELS).glob("*.h"):
            (src / h.name).write_bytes(h.read_bytes())


def build(rev: str, out: Path) -> ctypes.CDLL:
    """gemm_q8 of revision `rev` ('.': the working tree) compiled into `out`, loaded."""
    from imp_jax.kernels_pallas.cpu import build as kbuild

    src = out / "src"
    kernel_sources(rev, src)
    lib = out / "gemm_q8.so"
    subprocess.run(["g++", *kbuild.FLAGS, *kbuild.KERNEL_FLAGS["gemm_q8"], "-fno-gnu-unique", "-w", "-fPIC", "-shared",
                    "-I", kbuild.include_dir(), str(src / "gemm_q8.cc"), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.imp_gemm_q8_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return dll


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--revs", nargs="+", default=["main", "."], help="git revisions ('.': the working tree)")
    ap.add_argument("--cases", nargs="+", default=CASES, help="FORMAT:NxK")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=21)
    ap.add_argument("--copies", type=int, default=8, help="distinct matrices per case (weights from memory)")
    ap.add_argument("--isa", type=int, default=2, help="0 AVX2, 1 VNNI (256-bit), 2 AVX-512")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "scripts"))
    from quant_blocks import random_blocks

    from imp_jax.kernels_pallas import ggml_blocks

    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        libs = list(pool.map(lambda ir: build(ir[1], Path(tmp) / str(ir[0])), enumerate(args.revs)))
        print(f"{'case':<16} {'rows':>4} " + " ".join(f"{rev + ' ms (best)':>20}" for rev in args.revs)
              + "".join(f" {rev + ' / ' + args.revs[0]:>24}" for rev in args.revs[1:]))
        for case in args.cases:
            fmt, shape = case.split(":")
            n, k = (int(v) for v in shape.lower().split("x"))
            ws = [random_blocks(fmt, n, k // ggml_blocks.WEIGHTS[fmt], seed) for seed in range(args.copies)]
            for rows in args.rows:
                x = np.random.default_rng(rows).standard_normal((rows, k)).astype(np.float32)
                y = np.zeros((rows, n), np.float32)
                times = np.zeros((args.rounds, len(libs)))
                for r in range(-1, args.rounds):   # round -1 warms up
                    for j in np.roll(np.arange(len(libs)), r):
                        t0 = time.thread_time()
                        for w in ws:
                            assert libs[j].imp_gemm_q8_run(w.shape[-1], args.isa, x.ctypes.data, rows, k, w.ctypes.data,
                                                           n, y.ctypes.data) == 0
                        if r >= 0:
                            times[r, j] = (time.thread_time() - t0) / len(ws)
                med, best = np.median(times, 0), times.min(0)
                ratios = [times[:, j] / times[:, 0] for j in range(1, len(libs))]
                print(f"{case:<16} {rows:4d} " + " ".join(f"{t * 1e3:10.4f} ({b * 1e3:.4f})" for t, b in zip(med, best))
                      + "".join(f" {np.median(q):10.3f} ({q.min():.3f}-{q.max():.3f})" for q in ratios), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
