"""Offline engine throughput and TTFT for SmolLM2 vs HF transformers `generate`, plus the decode roofline.

    python scripts/bench_engine.py [--batches 1 8 32] [--prompt-len 128] [--output-len 128]
                                   [--dtype auto|float32|bfloat16] [--kv-cache-dtype auto|bfloat16] [--out FILE]
                                   [--async-scheduling auto|on|off ...] [--prompts text|random] [--repeats N]
                                   [--speculative on|off]

Each workload runs N concurrent sequences (prompt ~prompt-len tokens, exactly output-len
tokens with ignore_eos); 'steps' counts the engine steps it took (fewer than prefill + output-len
where n-gram speculation accepted drafts: the text prompts' repetitive greedy output is
where it does, so `--prompts random` is the one to hold against scripts/bench_serving.py). The roofline is weight bytes / measured memory read bandwidth.
'ceiling' is the tok/s with every FLOP at XLA's best measured GEMM rate; 'peak' the tok/s with
every FLOP at the float32 FMA peak of all cores (measured with a small C++ loop built with the
system compiler), which no implementation can beat.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Memory read bandwidth in bytes/s: the best of a few full reads of a large array."""
    a = np.ones(nbytes // 8, np.float64)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


_PROMPTS_MADE = itertools.count()

_FMA_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>
#define F(i) a##i = _mm256_fmadd_ps(a##i, b, c);
static float run(long iters) {   // 12 independent FMA chains: enough to fill both FMA pipes
  __m256 a0 = _mm256_set1_ps(0.1f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0,
         a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  const __m256 b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it) {
    F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7) F(8) F(9) F(10) F(11)
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6),
                     "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));   // keep every chain
  }
  __m256 s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
  return s[0];
}
int main(int argc, char** argv) {
  const int threads = std::atoi(argv[1]);
  const long iters = std::atol(argv[2]);
  std::vector<float> sink(threads);
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<std::thread> ts;
  for (int i = 0; i < threads; ++i) ts.emplace_back([&, i] { sink[i] = run(iters); });
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%f %f\n", threads * 12.0 * 16 * iters / s, sink[0]);
}
"""


def measure_fma_peak(repeats: int = 3) -> float | None:
    """The float32 FMA peak of all cores (FLOP/s): AVX2 FMAs on independent chains, one thread per
    core, compiled with the system C++ compiler; None off x86-64 or without one."""
    import platform
    import shutil
    import subprocess
    import tempfile

    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "fma_peak.cc", Path(tmp) / "fma_peak"
        src.write_text(_FMA_PEAK_SOURCE)
        if subprocess.run([cxx, "-O3", "-mavx2", "-mfma", "-pthread", str(src), "-o", str(exe)],
                          capture_output=True).returncode != 0:
            return None
        runs = [subprocess.run([str(exe), str(os.cpu_count() or 1), "50000000"], capture_output=True,
                               text=True, check=True).stdout for _ in range(repeats)]
    return max(float(r.split()[0]) for r in runs)


def measure_gemm_rate(rows: int = 256, k: int = 576, n: int = 3072, repeats: int = 7) -> float:
    """The best float32 GEMM rate (FLOP/s) XLA reaches on this machine: a large-row [rows, k] x [n, k]^T."""
    import jax
    import jax.numpy as jnp

    x, w = jnp.ones((rows, k), jnp.float32), jnp.ones((n, k), jnp.float32)
    f = jax.jit(lambda x, w: jax.lax.dot_general(x, w, (((1,), (1,)), ((), ()))))
    f(x, w).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(x, w).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * k * n / best


def ceiling_tok_s(model, batch: int, prompt_len: int, output_len: int, gemm_rate: float,
                  weight_bytes: int, bandwidth: float) -> float:
    """Output tok/s if every FLOP ran at `gemm_rate` and every decode step also at least read the weights once.

    FLOPs: 2 per matrix weight per token, the LM head for sampled rows only, 4 * heads * head_dim
    per key per layer for attention.
    """
    from imp_jax.kernels_pallas import ggml_blocks

    cfg = model.config
    body = 2 * sum(math.prod(ggml_blocks.matrix_shape(w)) for ws in model.layers.matrices().values() for w in ws)
    head = 2 * cfg.vocab_size * cfg.hidden_size
    attn = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers     # per (query, key) pair
    prefill = batch * (prompt_len * body + attn * prompt_len * (prompt_len + 1) / 2 + head)
    ctx = prompt_len + output_len / 2
    step = batch * (body + head + attn * ctx)
    seconds = prefill / gemm_rate + (output_len - 1) * max(step / gemm_rate, weight_bytes / bandwidth)
    return batch * output_len / seconds


def prompts(tokenizer, n: int, length: int, kind: str = "text") -> list[list[int]]:
    """n prompts of exactly `length` tokens, each distinct from every prompt made before in this
    process: the first token differs, so no run reuses another's prefix cache. "text" repeats one
    English sentence (greedy decoding then repeats too, and n-gram speculation accepts several tokens a
    step); "random": ids drawn from [1000, 30000) as scripts/bench_serving.py's prompts are."""
    if kind == "random":
        rng = random.Random(next(_PROMPTS_MADE))
        return [[100 + next(_PROMPTS_MADE)] + [rng.randrange(1000, 30000) for _ in range(length - 1)] for _ in range(n)]
    base = tokenizer.encode("The history of science is long and full of surprising turns. " * max(40, length // 8),
                            add_special_tokens=False)
    return [[100 + next(_PROMPTS_MADE)] + base[1:length] for _ in range(n)]


def bench_engine(core, batch: int, prompt_len: int, output_len: int, kind: str = "text") -> dict:
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    first: dict[str, float] = {}
    t0 = time.perf_counter()
    host0, dev0, steps0 = core.host_seconds, core.device_seconds, core.num_steps
    work0 = core.loop_seconds - core.wait_seconds
    for i, ids in enumerate(prompts(core.tokenizer, batch, prompt_len, kind)):
        rid = f"b{batch}-{i}-{time.time_ns()}"
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
        core.add_request(GenerationRequest(rid, ids, params),
                         lambda ev, rid=rid: first.setdefault(rid, time.perf_counter()))
    decode_from = None
    while core.has_work():
        core.step()
        if decode_from is None and len(first) == batch:   # every prompt is in: decode steps from here
            decode_from = (time.perf_counter(), core.num_steps)
    wall = time.perf_counter() - t0
    host, dev = core.host_seconds - host0, core.device_seconds - dev0
    decode_steps = core.num_steps - decode_from[1]
    decode_step_s = (time.perf_counter() - decode_from[0]) / max(1, decode_steps)
    ttft = sorted(t - t0 for t in first.values())
    return dict(batch=batch, wall_s=wall, output_tok_s=batch * output_len / wall,
                ttft_median_s=ttft[len(ttft) // 2], ttft_max_s=ttft[-1], steps=core.num_steps - steps0,
                host_fraction=host / (host + dev), decode_step_s=decode_step_s,
                # all the engine thread's step-loop work per step, on the critical path or overlapped
                host_work_per_step_s=(core.loop_seconds - core.wait_seconds - work0) / max(1, core.num_steps - steps0))


def decode_step_time(core, prompt_len: int, steps: int = 24) -> float:
    """Median device time of a batch-1 decode step."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    times: list[float] = []
    ids = prompts(core.tokenizer, 1, prompt_len)[0]
    core.add_request(GenerationRequest(f"d{time.time_ns()}", ids,
                                       SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)),
                     lambda ev: None)
    while core.has_work():
        before = core.device_seconds
        core.step()
        times.append(core.device_seconds - before)
    return float(np.median(times[2:]))


def bench_transformers(gguf: Path, batch: int, prompt_len: int, output_len: int, tokenizer) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor(prompts(tokenizer, batch, prompt_len))
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                       min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - t0
    return dict(batch=batch, wall_s=wall, output_tok_s=batch * output_len / wall)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 (the engine's flag; auto = bf16 on GPU)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto | float32 | bfloat16 (the engine's flag)")
    ap.add_argument("--attention", default="auto", help="auto | xla | cpu | pallas (the engine's flag)")
    ap.add_argument("--gemm", default="auto", help="auto | exact | cpu_q8 | xla (the engine's flag)")
    ap.add_argument("--no-transformers", action="store_true", help="skip the transformers anchor")
    ap.add_argument("--long-context", type=int, default=0,
                    help="also one stream decoding --output-len tokens after a prompt of this many (0: none)")
    ap.add_argument("--async-scheduling", nargs="+", choices=("auto", "on", "off"), default=["auto"],
                    help="the engine's flag (auto: on); several (on off) run each batch under each, "
                    "interleaved")
    ap.add_argument("--prompts", choices=("text", "random"), default="text",
                    help="text: one English sentence repeated (n-gram speculation accepts several tokens a step); "
                    "random: token ids as scripts/bench_serving.py sends them")
    ap.add_argument("--speculative", choices=("on", "off"), default="on",
                    help="the engine's n-gram speculation (off: one token a decode step, as llama-bench's tg128)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each batch (and mode), interleaved; "
                    "the summary gives medians")
    ap.add_argument("--out", default="bench_results/engine.json")
    args = ap.parse_args()

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig, overlaps_steps

    max_seqs = max(args.batches)
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    core = build_engine(EngineConfig(model=args.model,
                                     max_model_len=max(args.prompt_len, args.long_context) + args.output_len + 16,
                                     max_num_seqs=max_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                     dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, attention=args.attention,
                                     gemm=args.gemm, async_scheduling=args.async_scheduling[0],
                                     speculative=args.speculative),
                        progress=lambda phase, frac: phases.setdefault(phase, time.perf_counter() - t0))
    startup = time.perf_counter() - t0
    bw = measure_bandwidth()
    weight_bytes = sum(x.nbytes for x in jax_leaves(core.step_fn.state))
    roofline_s = weight_bytes / bw
    step_s = decode_step_time(core, args.prompt_len)
    gemm = measure_gemm_rate()
    platform = core.step_fn.kv[0].devices().pop().platform
    peak = measure_fma_peak() if platform == "cpu" else None   # a CPU figure
    from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
    from imp_jax.model.weights import describe as describe_weights
    kernels = core.loaded.model.options.kernels
    kernel = kernels.cpu_gemm
    results = dict(model=args.model, startup_s=startup, load_s=phases["warming_up"],
                   compile_s=startup - phases["warming_up"],
                   compile_s_per_program={f"T{t}xS{n}xC{c}": sec for (t, n, c), sec in core.step_fn.compile_seconds.items()},
                   bandwidth_gb_s=bw / 1e9, weight_mb=weight_bytes / 1e6,
                   gemm_gflop_s=gemm / 1e9, fma_peak_gflop_s=peak / 1e9 if peak else None,
                   cpu_gemm_kernel=kernel, gemm_backend=kernels.gemm, attention_backend=kernels.attention,
                   weights=describe_weights(core.loaded.model),
                   dtype=np.dtype(core.loaded.dtype).name, kv_cache_dtype=args.kv_cache_dtype,
                   roofline_decode_step_ms=roofline_s * 1e3, decode_step_ms=step_s * 1e3,
                   decode_step_vs_roofline=step_s / roofline_s, engine=[], transformers=[])
    print(f"startup {startup:.1f}s (load {results['load_s']:.1f}s, compile {results['compile_s']:.1f}s); "
          f"weights {weight_bytes / 1e6:.0f} MB; "
          f"read bandwidth {bw / 1e9:.1f} GB/s")
    print(f"batch-1 decode step {step_s * 1e3:.1f} ms; roofline {roofline_s * 1e3:.1f} ms "
          f"({step_s / roofline_s:.2f}x)")
    print(f"best XLA float32 GEMM rate {gemm / 1e9:.0f} GFLOP/s; 'ceiling' = tok/s with every FLOP at that rate")
    if peak:
        print(f"float32 FMA peak of all cores {peak / 1e9:.0f} GFLOP/s; 'peak' = tok/s with every FLOP at that rate "
              f"and nothing else taking time")
    print(f"weights: {describe_weights(core.loaded.model)}; GEMMs: "
          f"{'the CPU GEMM kernel (--gemm %s; float32 matrices at %d-%d rows, narrow ones at all)' % (kernels.gemm, cpu_gemm.MIN_ROWS, cpu_gemm.MAX_ROWS) if kernel else 'XLA dot (--gemm xla, or no kernel here)'}; "
          f"attention: {kernels.attention}")
    print(f"{'batch':>5} {'async':>5} {'engine tok/s':>13} {'TTFT med':>9} {'TTFT max':>9} {'host %':>7} "
          f"{'step ms':>8} {'steps':>6} {'ceiling':>8} {'peak':>7} {'hf tok/s':>9} {'ratio':>6}")
    runs = [(b, mode) for b in args.batches for _ in range(args.repeats) for mode in args.async_scheduling]
    for b, mode in runs:
        core.async_scheduling = overlaps_steps(mode)
        e = bench_engine(core, b, args.prompt_len, args.output_len, args.prompts)
        e["async_scheduling"] = mode
        e["ceiling_tok_s"] = ceiling_tok_s(core.loaded.model, b, args.prompt_len, args.output_len, gemm,
                                           weight_bytes, bw)
        e["peak_tok_s"] = (ceiling_tok_s(core.loaded.model, b, args.prompt_len, args.output_len, peak, 0, bw)
                           if peak else None)
        results["engine"].append(e)
        h = None
        if not args.no_transformers:
            h = bench_transformers(core.loaded.path, b, args.prompt_len, args.output_len, core.tokenizer)
            results["transformers"].append(h)
        hf = f"{h['output_tok_s']:9.1f} {e['output_tok_s'] / h['output_tok_s']:6.2f}" if h else f"{'-':>9} {'-':>6}"
        pk = f"{e['peak_tok_s']:7.1f}" if peak else f"{'-':>7}"
        print(f"{b:5d} {mode:>5} {e['output_tok_s']:13.1f} {e['ttft_median_s']:9.2f} {e['ttft_max_s']:9.2f} "
              f"{100 * e['host_fraction']:6.1f}% {1e3 * e['decode_step_s']:8.2f} {e['steps']:6d} {e['ceiling_tok_s']:8.1f} "
              f"{pk} {hf}")
    if args.repeats > 1 or len(args.async_scheduling) > 1:
        print("medians:")
        for b in args.batches:
            for mode in args.async_scheduling:
                es = [e for e in results["engine"] if e["batch"] == b and e["async_scheduling"] == mode]
                med = lambda k: float(np.median([e[k] for e in es]))
                print(f"{b:5d} {mode:>5} {med('output_tok_s'):13.1f} tok/s, host {100 * med('host_fraction'):5.2f}%, "
                      f"decode step {1e3 * med('decode_step_s'):.2f} ms, "
                      f"host work {1e3 * med('host_work_per_step_s'):.2f} ms/step ({len(es)} runs)")
    if args.long_context:
        results["long_context"] = dict(bench_engine(core, 1, args.long_context, args.output_len, args.prompts),
                                       context=args.long_context)
        print(f"one stream after a {args.long_context}-token prompt: "
              f"{results['long_context']['output_tok_s']:.1f} tok/s, decode step "
              f"{1e3 * results['long_context']['decode_step_s']:.2f} ms")
    results["device_memory"] = device_memory()
    results["compilations_after_warmup"] = core.step_fn.compilations_after_warmup
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


def device_memory() -> dict | None:
    """The device allocator's bytes in use, peak and limit (GPU); None where it keeps none (CPU)."""
    import jax

    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


if __name__ == "__main__":
    sys.exit(main())
