"""Tensor and data parallelism's cost and memory: tok/s and per-device weight and KV bytes for each
TP size, and for D data-parallel replicas.

    python scripts/bench_parallel.py [--tp 1 2 4] [--dp 2] [--batches 1 8] [--prompt-len 64]
                                     [--output-len 32] [--model smollm2-135m-instruct] [--out FILE]

`--dp D` (0: skip) builds D one-device replicas, as `--data-parallel-size D` does, splits each
batch evenly over them and runs every replica's engine loop on its own thread.

On a CPU the devices are fake (`--xla_force_host_platform_device_count`, set here before jax
starts): every "device" shares the same cores, so what this measures is the cost of splitting a
step (per-shard programs, the psums after o_proj and down_proj, the logits gather), not a
speed-up. On GPUs (no fake devices) the same script measures real ones. Prints and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas to measure (0: none)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def per_device_bytes(arrays) -> int:
    """Bytes one device (the mesh's first) holds of `arrays`."""
    total = 0
    for a in arrays:
        first = min(a.sharding.device_set, key=lambda d: d.id)
        total += sum(s.data.nbytes for s in a.addressable_shards if s.device == first)
    return total


def workload(core, batch: int, prompt_len: int, output_len: int, seed: int) -> dict:
    """`batch` concurrent greedy requests of `prompt_len` random tokens and exactly `output_len` outputs."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    rng = np.random.default_rng(seed)
    first: dict[str, float] = {}
    done: list[int] = []

    def emit(ev):
        first.setdefault(ev.request_id, time.perf_counter())
        done.extend(ev.token_ids)

    t0 = time.perf_counter()
    for i in range(batch):   # distinct prompts: no prefix-cache hits
        prompt = rng.integers(0, core.loaded.config.vocab_size, prompt_len).tolist()
        core.add_request(GenerationRequest(f"b{seed}-{i}", prompt, SamplingParams(
            temperature=0.0, max_tokens=output_len, ignore_eos=True)), emit)
    while core.has_work():
        core.step()
    wall = time.perf_counter() - t0
    ttft = max(first.values()) - t0
    decode_s = wall - ttft
    return {"batch": batch, "wall_s": round(wall, 3), "tok_s": round(len(done) / wall, 1),
            "decode_tok_s": round(batch * (output_len - 1) / decode_s, 1) if decode_s > 0 else None,
            "ttft_s": round(ttft, 3)}


def run(args: argparse.Namespace) -> list[dict]:
    import jax

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    rows = []
    for n in args.tp:
        t0 = time.perf_counter()
        core = build_engine(EngineConfig(model=args.model, tensor_parallel_size=n, max_num_seqs=max(args.batches),
                                         max_num_batched_tokens=max(64, max(args.batches)), max_model_len=512,
                                         num_kv_blocks=256))
        start_s = time.perf_counter() - t0
        step = core.step_fn
        workload(core, 1, args.prompt_len, 4, seed=99)   # first runs of the programs the workloads use
        row = {"tp": n, "devices": [str(d) for d in step.mesh.devices.flat], "start_s": round(start_s, 1),
               "kv_bytes_per_device": per_device_bytes(step.kv), "kv_bytes_total": sum(int(k.nbytes) for k in step.kv),
               "weight_bytes_per_device": per_device_bytes(step._leaves),
               "runs": [workload(core, b, args.prompt_len, args.output_len, seed=b) for b in args.batches],
               "compilations_after_warmup": step.compilations_after_warmup}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del core, step
        jax.clear_caches()
    if args.dp > 0:
        rows.append(run_replicas(args))
    return rows


def run_replicas(args: argparse.Namespace) -> dict:
    """D replicas (one device each), each batch split over them, each replica stepped on its own thread."""
    import threading

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    d = args.dp
    config = EngineConfig(model=args.model, data_parallel_size=d, max_num_seqs=max(args.batches),
                          max_num_batched_tokens=max(64, max(args.batches)), max_model_len=512, num_kv_blocks=256)
    t0 = time.perf_counter()
    cores = [build_engine(config, replica=i) for i in range(d)]
    start_s = time.perf_counter() - t0
    for core in cores:
        workload(core, 1, args.prompt_len, 4, seed=99)

    def together(batch: int) -> dict:
        shares = [batch // d + (i < batch % d) for i in range(d)]
        results: list[dict | None] = [None] * d
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, workload(cores[i], shares[i], args.prompt_len, args.output_len, seed=batch * 10 + i)))
            for i in range(d) if shares[i]]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        wall = time.perf_counter() - t
        done = [r for r in results if r is not None]
        return {"batch": batch, "wall_s": round(wall, 3), "tok_s": round(batch * args.output_len / wall, 1),
                "ttft_s": max(r["ttft_s"] for r in done), "per_replica": done}

    row = {"dp": d, "devices": [str(c.step_fn.mesh.devices.flat[0]) for c in cores], "start_s": round(start_s, 1),
           "kv_bytes_per_device": per_device_bytes(cores[0].step_fn.kv),
           "weight_bytes_per_device": per_device_bytes(cores[0].step_fn._leaves),
           "runs": [together(b) for b in args.batches],
           "compilations_after_warmup": sum(c.step_fn.compilations_after_warmup for c in cores)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "jax" not in sys.modules and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        # the device count is fixed when jax starts: re-run in a process that fakes enough CPU devices
        # (only where the default backend is the CPU; GPUs are real devices)
        probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                               capture_output=True, text=True)
        if probe.stdout.strip() == "cpu":
            flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={max(*args.tp, args.dp)}"
            return subprocess.call([sys.executable, *sys.argv], env={**os.environ, "XLA_FLAGS": flags.strip()})
    rows = run(args)
    result = {"model": args.model, "prompt_len": args.prompt_len, "output_len": args.output_len, "results": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
