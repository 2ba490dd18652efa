"""Where a decode step's time goes: a jax.profiler trace of N greedy decode steps, summed per op.

    python scripts/profile_step.py [--model smollm2-135m-instruct] [--batch 1] [--steps 40]
                                   [--gemm auto] [--repetition-penalty 1.0] [--top 25] [--out FILE]

Builds the engine (`--max-num-seqs 8 --max-num-batched-tokens 64`), runs `--batch` greedy
requests once to warm up, then traces the same workload and prints the trace's events summed by
name (total ms, per step, calls): the compiled step's thunks (`ffi_call.*` are the CPU kernels:
one per layer and projection inside the layer loop, `while.*` the layer loop itself, `cond.*` the
per-layer weight picks and the sampler's skips) beside the engine's own Python frames. The CPU
kernels' calls are also summed as one line, "CPU kernel calls", so the GEMM share of a step reads
at a glance. The trace itself (perfetto JSON) stays in a temporary directory unless `--out`.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import sys
import tempfile
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gemm", default="auto", help="auto | exact | cpu_q8 | xla (the engine's flag)")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="the requests' (the server's default preset applies 1.05 even at temperature 0)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None, help="a directory to keep the trace in")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    core = build_engine(EngineConfig(model=args.model, max_num_seqs=max(8, args.batch), max_num_batched_tokens=64,
                                     max_model_len=1024, num_kv_blocks=256, gemm=args.gemm))

    def run(tag: str) -> float:
        for i in range(args.batch):
            prompt = [(100 + 7 * i + j) % core.loaded.config.vocab_size for j in range(args.prompt_len)]
            core.add_request(GenerationRequest(f"{tag}-{i}", prompt, SamplingParams(
                temperature=0.0, repetition_penalty=args.repetition_penalty, max_tokens=args.steps + 1, ignore_eos=True)),
                lambda event: None)
        while core.scheduler.waiting or any(s.is_prefill for s in core.scheduler.running):
            core.step()   # prefill, not traced
        t0 = time.perf_counter()
        while core.has_work():
            core.step()
        return time.perf_counter() - t0

    run("warm")
    where = args.out or tempfile.mkdtemp(prefix="imp-profile-")
    jax.profiler.start_trace(where, create_perfetto_trace=True)
    seconds = run("traced")
    jax.profiler.stop_trace()
    path = sorted(glob.glob(f"{where}/**/*.trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X":
            total[e["name"]] += e.get("dur", 0)
            calls[e["name"]] += 1
    kernels = [n for n in total if n.startswith("ffi_call")]
    total["CPU kernel calls"] = sum(total[n] for n in kernels)
    calls["CPU kernel calls"] = sum(calls[n] for n in kernels)
    steps = args.steps
    print(f"{args.model}, batch {args.batch}, {steps} decode steps traced in {seconds:.2f} s "
          f"({1e3 * seconds / steps:.1f} ms per step with the profiler on); trace in {where}")
    print(f"{'total ms':>9} {'ms/step':>8} {'calls':>7}  name")
    for name, us in total.most_common(args.top):
        print(f"{us / 1e3:9.1f} {us / 1e3 / steps:8.2f} {calls[name]:7d}  {name[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
