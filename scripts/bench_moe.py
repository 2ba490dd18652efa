"""Mixture-of-experts on this CPU: the expert-FFN implementations, and an MoE vs a dense model with the
same active parameters through the engine.

    PYTHONPATH=. python scripts/bench_moe.py [--part kernels engine quant] [--tokens 1 32 128] [--batches 1 32]
                                             [--repeats 5] [--out bench_results/moe.json]

kernels: model/architectures/moe.py's `expert_ffn` ("ragged": tokens sorted by expert, jax.lax.ragged_dot_general;
"dense": every expert on every token, the chosen ones kept; "gather": each token's k experts'
weights gathered) on one layer's experts, jitted, interleaved repeats, median ms per call.
engine: tiny random Mixtral (E experts, top-k, expert width I) against a tiny Llama whose MLP is
k * I wide (the same active parameters per token; attention identical), each served by EngineCore
with greedy decoding of N sequences; output tok/s, interleaved repeats, medians.
quant: a tiny random Mixtral GGUF (the engine part's shape) whose expert stacks are `--expert-type`
blocks (Q4_K by default; attention, router, embedding and head float32), served with its expert stacks
kept as the file's blocks (`--quantized-weights keep`) and dequantised at load (`dequantize`): bytes
of weights, output tok/s.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPE = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, num_hidden_layers=4, vocab_size=256,
             max_position_embeddings=1024)


def bench_kernels(tokens: list[int], repeats: int, E: int, k: int, H: int, I: int, gemm: str) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from imp_jax.kernels_pallas import AttentionShape, select_kernels

    from imp_jax.model.architectures.moe import EXPERT_IMPLS, expert_ffn, route

    rng = np.random.default_rng(0)
    gate_up = jnp.asarray(rng.normal(0, 0.02, (E, 2 * I, H)), jnp.float32)
    down = jnp.asarray(rng.normal(0, 0.02, (E, H, I)), jnp.float32)
    router = jnp.asarray(rng.normal(0, 1, (E, H)), jnp.float32)
    kernels = select_kernels(jax.local_devices()[0], AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32),
                                                                     8, 4, 64, 16), gemm=gemm)
    fns = {impl: jax.jit(lambda h, n, impl=impl: expert_ffn(h, *route(h @ router.T, k, normalize=True),
                                                            gate_up, down, impl, n, kernels)) for impl in EXPERT_IMPLS}
    rows = []
    for n in tokens:
        T = max(16, 1 << (n - 1).bit_length())   # the engine's token bucket: n real tokens, the rest padding
        h = jnp.asarray(rng.normal(0, 1, (T, H)), jnp.float32)
        ref = np.asarray(fns["dense"](h, n))[:n]
        times: dict[str, list[float]] = {impl: [] for impl in EXPERT_IMPLS}
        for impl, f in fns.items():   # compiled, and right on the real rows
            np.testing.assert_allclose(np.asarray(f(h, n))[:n], ref, rtol=1e-4, atol=1e-5)
        calls = max(1, 64 // n)
        for _ in range(repeats):
            for impl, f in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    out = f(h, n)
                out.block_until_ready()
                times[impl].append((time.perf_counter() - t0) / calls)
        row = dict(tokens=n, bucket=T, experts=E, top_k=k, hidden=H, expert_intermediate=I,
                   **{f"{impl}_ms": 1e3 * float(np.median(ts)) for impl, ts in times.items()})
        rows.append(row)
        print(f"tokens {n:4d} (bucket {T:4d}): " + "  ".join(f"{impl} {row[impl + '_ms']:.3f} ms"
                                                          for impl in EXPERT_IMPLS), flush=True)
    return rows


def write_models(root: Path, E: int, k: int, I: int) -> dict[str, Path]:
    """A tiny random Mixtral and a Llama of the same attention with a k * I wide MLP, each with a tokenizer."""
    import torch
    import transformers

    from tiny_models import write_tiny_tokenizer

    out = {}
    for name, cls, cfg in (
            ("moe", transformers.MixtralForCausalLM,
             transformers.MixtralConfig(**SHAPE, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)),
            ("dense", transformers.LlamaForCausalLM, transformers.LlamaConfig(**SHAPE, intermediate_size=k * I))):
        torch.manual_seed(0)
        path = root / name
        cls(cfg).float().save_pretrained(path)
        write_tiny_tokenizer(path)
        out[name] = path
    return out


def bench_engine(paths: dict[str, Path], batches: list[int], repeats: int, prompt_len: int, output_len: int,
                 impls: list[str], max_tokens: int = 64) -> list[dict]:
    from imp_jax.model.architectures.moe import MoELM
    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    cores = {}
    builds = [("dense", paths["dense"], None)] + [(f"moe_{impl}", paths["moe"], impl) for impl in impls]
    for name, path, impl in builds:
        if impl:
            MoELM.expert_impl = impl   # read when the step programs are traced, during the build's warm-up
        t0 = time.perf_counter()
        cores[name] = build_engine(EngineConfig(model=str(path), max_model_len=prompt_len + output_len + 16,
                                                max_num_seqs=max(batches), max_num_batched_tokens=max_tokens))
        print(f"{name}: built and compiled in {time.perf_counter() - t0:.1f}s", flush=True)
    rng = np.random.default_rng(0)

    def run(core, batch: int) -> float:
        for i in range(batch):
            ids = [int(t) for t in rng.integers(4, 150, prompt_len)]
            core.add_request(GenerationRequest(f"r{time.time_ns()}-{i}", ids, SamplingParams(
                temperature=0.0, repetition_penalty=1.0, max_tokens=output_len, ignore_eos=True)), lambda ev: None)
        t0 = time.perf_counter()
        while core.has_work():
            core.step()
        return batch * output_len / (time.perf_counter() - t0)

    rows = []
    for b in batches:
        got: dict[str, list[float]] = {name: [] for name in cores}
        for _ in range(repeats):
            for name, core in cores.items():
                got[name].append(run(core, b))
        row = dict(batch=b, **{f"{n}_tok_s": float(np.median(v)) for n, v in got.items()})
        for impl in impls:
            row[f"moe_{impl}_over_dense"] = row[f"moe_{impl}_tok_s"] / row["dense_tok_s"]
        rows.append(row)
        print(f"batch {b:3d}: dense {row['dense_tok_s']:8.1f} tok/s  " + "  ".join(
            f"MoE/{impl} {row[f'moe_{impl}_tok_s']:8.1f} ({row[f'moe_{impl}_over_dense']:.2f}x)" for impl in impls),
            flush=True)
    for name, core in cores.items():
        assert core.step_fn.compilations_after_warmup == 0, (name, core.step_fn.compilations_after_warmup)
    return rows


def write_quant_gguf(path: Path, E: int, k: int, I: int, qtype: str) -> None:
    """A random Mixtral (llama architecture with expert stacks) GGUF of SHAPE whose gate / up / down
    expert stacks are `qtype` blocks (random bytes, small finite scales), everything else float32."""
    import gguf

    from quant_blocks import BLOCK_WEIGHTS, random_blocks
    from tiny_gguf import write_random_moe_gguf

    def stack(rng, i: int, leaf: str, n: int, kk: int) -> tuple[np.ndarray, gguf.GGMLQuantizationType]:
        s = np.stack([random_blocks(qtype, n, kk // BLOCK_WEIGHTS[qtype], seed=int(rng.integers(1 << 30)),
                                    scale=0.3 / kk) for _ in range(E)])
        if qtype == "MXFP4":   # E8M0 exponents of small weights (2^-16..2^-12 times at most 6)
            s[..., 0] = rng.integers(112, 117, s.shape[:-1])
        return s.reshape(E, n, -1), gguf.GGMLQuantizationType[qtype]

    write_random_moe_gguf(path, "llama", hidden=SHAPE["hidden_size"], ffn=I, heads=SHAPE["num_attention_heads"],
                          kv_heads=SHAPE["num_key_value_heads"], layers=SHAPE["num_hidden_layers"], experts=E, used=k,
                          expert_stack=stack)


def bench_quant(path: Path, batches: list[int], repeats: int, prompt_len: int, output_len: int,
                max_tokens: int) -> dict:
    """The GGUF served with its expert stacks kept as blocks and dequantised at load: weight bytes
    (and the kept stacks' bytes against the file's), output tok/s per batch."""
    import gguf
    import jax
    from flax import nnx

    from imp_jax.kernels_pallas import Kernels
    from imp_jax.model.formats.loader import load_model
    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    modes = ("keep", "dequantize")
    out: dict = {"file_bytes": path.stat().st_size,
                 "file_expert_bytes": sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors
                                          if "_exps" in t.name)}
    for mode in modes:
        model = load_model(path, dtype="float32", kernels=Kernels(gemm="exact", quantized=mode)).model
        leaves = jax.tree.leaves(nnx.state(model))
        out[f"{mode}_weight_bytes"] = int(sum(a.nbytes for a in leaves))
        out[f"{mode}_expert_bytes"] = int(sum(a.nbytes for m in model.layers.mlp for a in (m.gate_up[...], m.down[...])))
        print(f"{mode}: weights {out[f'{mode}_weight_bytes'] / 2**20:.1f} MiB, expert stacks "
              f"{out[f'{mode}_expert_bytes'] / 2**20:.1f} MiB (file's {out['file_expert_bytes'] / 2**20:.1f} MiB)",
              flush=True)
        del model
    cores = {mode: build_engine(EngineConfig(model=str(path), quantized_weights=mode, max_num_seqs=max(batches),
                                             max_model_len=prompt_len + output_len + 16,
                                             max_num_batched_tokens=max_tokens)) for mode in modes}
    rng = np.random.default_rng(0)

    def run(core, batch: int) -> float:
        for i in range(batch):
            ids = [int(t) for t in rng.integers(4, 150, prompt_len)]
            core.add_request(GenerationRequest(f"r{time.time_ns()}-{i}", ids, SamplingParams(
                temperature=0.0, max_tokens=output_len, ignore_eos=True)), lambda ev: None)
        t0 = time.perf_counter()
        while core.has_work():
            core.step()
        return batch * output_len / (time.perf_counter() - t0)

    out["engine"] = []
    for b in batches:
        got: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(repeats):
            for m, core in cores.items():
                got[m].append(run(core, b))
        row = dict(batch=b, **{f"{m}_tok_s": float(np.median(v)) for m, v in got.items()})
        out["engine"].append(row)
        print(f"batch {b:3d}: keep {row['keep_tok_s']:8.1f} tok/s  dequantize {row['dequantize_tok_s']:8.1f} tok/s "
              f"({row['keep_tok_s'] / row['dequantize_tok_s']:.2f}x)", flush=True)
    for m, core in cores.items():
        assert core.step_fn.compilations_after_warmup == 0, (m, core.step_fn.compilations_after_warmup)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", nargs="+", choices=("kernels", "engine", "quant"), default=["kernels", "engine"])
    ap.add_argument("--expert-type", default="Q4_K", help="the quant part's expert stack type (a GGML type "
                    "kept as blocks: Q4_K, Q8_0, MXFP4, ...)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--impls", nargs="+", default=["tiles", "pairs", "dense", "ragged"],
                    help="expert-FFN implementations to serve the MoE with in the engine part")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-intermediate", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--gemm", default="exact", help="the kernels part's GEMM for tiles / dense: exact (the x86-64 "
                    "kernel, what the engine picks there for float weights) or xla")
    ap.add_argument("--out", default="bench_results/moe.json")
    args = ap.parse_args()
    E, k, I = args.experts, args.top_k, args.expert_intermediate
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    results: dict = dict(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=commit,
                         load_average=os.getloadavg(), model=dict(SHAPE, experts=E, top_k=k, expert_intermediate=I,
                                                                 dense_intermediate=k * I))
    if "kernels" in args.part:
        results["kernels"] = bench_kernels(args.tokens, args.repeats, E, k, SHAPE["hidden_size"], I, args.gemm)
    if "engine" in args.part:
        with tempfile.TemporaryDirectory() as tmp:
            paths = write_models(Path(tmp), E, k, I)
            results["engine"] = bench_engine(paths, args.batches, args.repeats, args.prompt_len, args.output_len,
                                             args.impls, args.max_num_batched_tokens)
    if "quant" in args.part:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"mixtral-{args.expert_type}.gguf"
            write_quant_gguf(path, E, k, I, args.expert_type)
            results["quant"] = dict(expert_type=args.expert_type, **bench_quant(
                path, args.batches, args.repeats, args.prompt_len, args.output_len, args.max_num_batched_tokens))
    results["load_average_after"] = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
