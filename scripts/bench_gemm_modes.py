"""Two `--gemm` modes of the engine in one process, their runs interleaved: on a shared machine,
the ratio of their speeds holds up where two separate bench_engine runs may see different loads.

    python scripts/bench_gemm_modes.py [--modes exact cpu_q8] [--batches 1 8 32] [--rounds 3]

Per batch size and round, each engine runs the bench_engine workload (that many concurrent prompts
of --prompt-len tokens, --output-len tokens each, greedy, ignore_eos), in alternating order; and
batch-1 decode steps are timed in alternating slices of 16. Prints medians over the rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_engine import bench_engine, decode_step_time  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--modes", nargs="+", default=["exact", "cpu_q8"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    args = ap.parse_args()

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    cores = {}
    for mode in args.modes:
        t0 = time.perf_counter()
        cores[mode] = build_engine(EngineConfig(model=args.model, gemm=mode, max_num_seqs=max(args.batches),
                                                max_model_len=args.prompt_len + args.output_len + 16,
                                                max_num_batched_tokens=args.max_num_batched_tokens))
        print(f"{mode}: built in {time.perf_counter() - t0:.1f}s ({cores[mode].loaded.model.options.kernels.describe()})")
    steps = {m: [] for m in cores}
    for r in range(args.rounds * 4):
        for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
            steps[mode].append(decode_step_time(cores[mode], args.prompt_len, steps=18))
    print("batch-1 decode step, median of slices: " + ", ".join(
        f"{m} {statistics.median(v) * 1e3:.2f} ms" for m, v in steps.items()))
    print(f"{'batch':>5} " + " ".join(f"{m + ' tok/s':>14}" for m in args.modes) + "  (median of rounds; each round's runs)")
    for b in args.batches:
        runs = {m: [] for m in cores}
        for r in range(args.rounds):
            for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
                runs[mode].append(bench_engine(cores[mode], b, args.prompt_len, args.output_len)["output_tok_s"])
        print(f"{b:5d} " + " ".join(f"{statistics.median(runs[m]):14.1f}" for m in args.modes) + "  "
              + "; ".join(f"{m}: " + " ".join(f"{x:.1f}" for x in runs[m]) for m in args.modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
