"""What LoRA costs: output tok/s at N streams with 0, 1 and 4 distinct adapters in the batch, against the
same engine without adapter slabs (--max-loras 0).

    PYTHONPATH=. python scripts/bench_lora.py [--streams 8] [--prompt-len 128] [--output-len 128]
                                              [--rank 16] [--repeats 2] [--single-thread] [--out FILE]

The adapters are synthetic PEFT directories (random rank-`rank` A and B on q/k/v/o/gate/up/down of
every layer) written here with numpy, so the script needs neither torch nor peft. Each workload
runs `streams` greedy sequences together (ignore_eos, exactly output-len tokens); the best of
`repeats` runs counts (the machine is shared), and beside tok/s the median device time of a
decode step of the 8 streams, which a noisy neighbour moves less.

`--single-thread` runs XLA and the kernels on one thread pinned to one core and counts CPU time
(time.process_time) instead of wall time: the work a workload costs, which neighbours sharing the
machine barely move (they steal wall time, not CPU time). Its tok/s are per CPU-second.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_made = itertools.count()


def write_adapter(path: Path, model, rank: int, seed: int) -> Path:
    """A PEFT LoRA directory for `model` (its lora_targets' shapes), random non-zero A and B."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(model.config.num_layers):
        for module, t in model.lora_targets().items():
            if module not in TARGETS:   # the decoder layers' projections only (not lm_head, embed_tokens)
                continue
            key = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, t.in_dim)) * 0.02).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((t.out_dim, rank)) * 0.02).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))
    return path


def run(core, streams: int, prompt_len: int, output_len: int, loras: list[str | None],
        clock=None) -> tuple[float, float]:
    """Output tok/s of `streams` sequences, stream i under adapter loras[i % len(loras)], and the median
    device time of the steps in the run's second half (all decode: robust to a noisy neighbour). With a
    `clock` (time.process_time), both in its time instead, a step's being its whole `core.step()`."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    base = core.tokenizer.encode("The history of science is long and full of surprising turns. " * 40,
                                 add_special_tokens=False)
    now = clock or time.perf_counter
    t0 = now()
    for i in range(streams):
        ids = [100 + next(_made)] + base[1:prompt_len]   # distinct first tokens: no prefix-cache reuse
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        core.add_request(GenerationRequest(f"bench-{time.time_ns()}-{i}", ids, params, lora=loras[i % len(loras)]),
                         lambda ev: None)
    steps = []
    while core.has_work():
        before, t = core.device_seconds, now()
        core.step()
        steps.append(now() - t if clock else core.device_seconds - before)
    return streams * output_len / (now() - t0), float(np.median(steps[len(steps) // 2:]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--single-thread", action="store_true", help="one thread on one core, CPU time (see above)")
    ap.add_argument("--out", default="bench_results/lora.json")
    args = ap.parse_args()
    clock = None
    if args.single_thread:   # before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        clock = time.process_time

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    config = dict(model=args.model, max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.streams,
                  max_num_batched_tokens=256)
    t0 = time.perf_counter()
    plain = build_engine(EngineConfig(**config))
    t1 = time.perf_counter()
    slabs = build_engine(EngineConfig(**config, max_loras=4, max_lora_rank=args.rank))
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(4):
            path = write_adapter(Path(tmp) / f"a{k}", slabs.loaded.model, args.rank, seed=k)
            slabs.load_lora(f"a{k}", slabs.loras.read(str(path)))
    workloads = {"no slabs (--max-loras 0)": (plain, [None]), "slabs, 0 adapters": (slabs, [None]),
                 "slabs, 1 adapter": (slabs, ["a0"]), "slabs, 4 adapters": (slabs, ["a0", "a1", "a2", "a3"])}
    best = {name: 0.0 for name in workloads}
    step_ms = {name: float("inf") for name in workloads}
    run(plain, args.streams, args.prompt_len, 8, [None])   # first runs of each bucket out of the way
    run(slabs, args.streams, args.prompt_len, 8, ["a0", None])
    for _ in range(args.repeats):   # interleaved, so a noisy neighbour hits every workload alike
        for name, (core, loras) in workloads.items():
            tok_s, step_s = run(core, args.streams, args.prompt_len, args.output_len, loras, clock)
            best[name], step_ms[name] = max(best[name], tok_s), min(step_ms[name], 1e3 * step_s)
    ref, ref_ms = best["no slabs (--max-loras 0)"], step_ms["no slabs (--max-loras 0)"]
    print(f"startup: {t1 - t0:.1f}s without slabs, {t2 - t1:.1f}s with 4 slots of rank {args.rank}")
    print(f"{'workload':<26} {'tok/s':>8} {'vs no slabs':>12} {'decode step ms':>15} {'vs no slabs':>12}"
          + ("   (CPU time, one thread)" if clock else ""))
    for name, tok_s in best.items():
        print(f"{name:<26} {tok_s:8.1f} {100 * (tok_s / ref - 1):+11.1f}% {step_ms[name]:15.2f} "
              f"{100 * (step_ms[name] / ref_ms - 1):+11.1f}%")
    compiles = plain.step_fn.compilations_after_warmup + slabs.step_fn.compilations_after_warmup
    print(f"compilations after warm-up: {compiles}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(vars(args), tok_s=best, decode_step_ms=step_ms, compilations_after_warmup=compiles),
                              indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
