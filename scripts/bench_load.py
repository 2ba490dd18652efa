"""Load, compile and run times of SmolLM2: GGUF vs HF dir vs converted checkpoint, scan vs unrolled layers.

    python scripts/bench_load.py [--quick] [--out bench_results/load.json] [--work-dir DIR]

The HF dir (safetensors written from the GGUF's dequantised tensors) and the converted checkpoint are
made once under --work-dir and reused. Run times are medians of --runs calls after one warm-up call;
compile times are one trace + XLA compile each, with no persistent compilation cache.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.convert import convert, write_tokenizer
from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.model.formats.hub import CONVERTED_MARKER, resolve_model
from imp_jax.paths import imp_jax_home
from imp_jax.model.formats.loader import load_model
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch

BLOCK_SIZE = 16
DECODE_BUCKET = 16  # the engine's smallest token bucket: a batch-1 decode step runs at this shape


@dataclasses.dataclass(frozen=True)
class Shape:
    """One benchmarked program: `real` tokens of one sequence, starting at `start`, padded to `bucket`."""

    name: str
    real: int
    start: int
    bucket: int


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_load.py", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct", help="GGUF path or alias")
    ap.add_argument("--out", default="bench_results/load.json")
    ap.add_argument("--work-dir", default=None, help="where the HF dir and converted checkpoint are kept "
                                                     "(default $IMP_JAX_HOME/bench/<model>)")
    ap.add_argument("--quick", action="store_true", help="sanity run: one load each, 32-token prefill")
    ap.add_argument("--runs", type=int, default=None, help="timed runs per program (>= 5)")
    ap.add_argument("--load-repeats", type=int, default=None, help="loads timed per format")
    ap.add_argument("--layer-loops", default="scan,unroll")
    args = ap.parse_args(argv)
    runs = max(5, args.runs or (5 if args.quick else 10))
    load_repeats = args.load_repeats or (1 if args.quick else 5)
    prefill = 32 if args.quick else 128
    shapes = [Shape(f"prefill{prefill}", prefill, 0, prefill), Shape("decode", 1, prefill, DECODE_BUCKET)]

    import gguf, orbax.checkpoint, safetensors, tokenizers  # noqa: F401,E401  imports out of the timings
    gguf_path = resolve_model(args.model).path
    work = Path(args.work_dir) if args.work_dir else imp_jax_home() / "bench" / gguf_path.stem
    result: dict[str, Any] = {"model": args.model, "gguf": str(gguf_path), "quick": args.quick,
                              "env": environment(), "runs": runs, "load_repeats": load_repeats}
    print(f"# {args.model}: {gguf_path}\n# work dir {work}; {result['env']['backend']}, "
          f"{result['env']['cpu_count']} CPUs, load average {result['env']['loadavg_start']}", flush=True)

    hf_dir, conv_dir = work / "hf", work / "converted"
    result["prepare_s"] = prepare(gguf_path, hf_dir, conv_dir)
    paths = {"gguf": gguf_path, "hf_dir": hf_dir, "converted": conv_dir}
    result["load"], result["identical_logits"] = time_loads(paths, load_repeats, shapes[0])

    result["layer_loops"] = {}
    for loop in args.layer_loops.split(","):
        print(f"# layer loop {loop}", flush=True)
        model = load_model(conv_dir, dtype="float32", layer_loop=loop).model
        result["layer_loops"][loop] = {s.name: bench_program(model, s, runs) for s in shapes}
        del model
    result["tokens"] = {s.name: dataclasses.asdict(s) for s in shapes}
    result["env"]["loadavg_end"] = os.getloadavg()

    print(format_table(result))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"# wrote {out}")
    return 0


def environment() -> dict[str, Any]:
    return {"backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "jax": jax.__version__, "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "loadavg_start": os.getloadavg(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def time_loads(paths: dict[str, Path], repeats: int, shape: Shape) -> tuple[dict[str, Any], dict[str, bool]]:
    """Wall time of load_model (float32, weights on device) per format, in interleaved rounds, one model alive
    at a time; in the last round each model's prefill logits are compared with the first format's."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    identical: dict[str, bool] = {}
    prog, ref = None, None
    for r in range(repeats):
        for name, path in paths.items():
            gc.collect()
            t0 = time.perf_counter()
            loaded = load_model(path, dtype="float32")
            jax.block_until_ready(nnx.state(loaded.model))
            times[name].append(time.perf_counter() - t0)
            print(f"  load {name}: {times[name][-1]:.2f}s", flush=True)
            if r == repeats - 1:
                if prog is None:
                    prog = Program(loaded.model, shape)
                    prog.compile()
                    ref = prog.run()[0]
                identical[name] = bool(np.array_equal(prog.run(nnx.state(loaded.model))[0], ref))
            del loaded
    print(f"  identical prefill logits vs {next(iter(paths))}: {identical}", flush=True)
    loads = {name: {"path": str(paths[name]), "median_s": statistics.median(t), "min_s": min(t), "all_s": t}
             for name, t in times.items()}
    return loads, identical


def prepare(gguf_path: Path, hf_dir: Path, conv_dir: Path) -> dict[str, float]:
    """Write the HF dir and the converted checkpoint (convert() from the GGUF) if missing; seconds spent."""
    spent = {}
    if not (hf_dir / "config.json").is_file():
        t0 = time.perf_counter()
        write_hf_dir(gguf_path, hf_dir)
        spent["write_hf_dir_s"] = time.perf_counter() - t0
    if not (conv_dir / CONVERTED_MARKER).is_file():
        t0 = time.perf_counter()
        convert(gguf_path, conv_dir, dtype="float32", overwrite=True)
        spent["convert_s"] = time.perf_counter() - t0
    for name, s in spent.items():
        print(f"  {name}: {s:.1f}s", flush=True)
    return spent


def write_hf_dir(gguf_path: Path, dst: Path) -> None:
    """A HF checkpoint dir from a GGUF: float32 safetensors, config.json (last) and tokenizer files."""
    from safetensors.numpy import save_file

    from imp_jax.model.formats.gguf_loader import load_gguf

    ckpt = load_gguf(gguf_path)
    dst.mkdir(parents=True, exist_ok=True)
    save_file({name: ckpt.tensors[name] for name in ckpt.tensors}, str(dst / "model.safetensors"))
    write_tokenizer(ckpt.tokenizer, dst)
    (dst / "generation_config.json").write_text(json.dumps(ckpt.generation_config))
    (dst / "config.json").write_text(json.dumps(ckpt.hf_config, indent=2))


class Program:
    """A jitted paged forward (+ logits of the sampled rows) over a private KV pool, for one shape."""

    def __init__(self, model: Any, shape: Shape, num_blocks: int = 64, max_blocks: int = 32):
        self.graphdef, self.state = nnx.split(model)
        kv_shape = model.kv_cache_shape(num_blocks, BLOCK_SIZE)
        self.kv = (jnp.zeros(kv_shape, model.dtype), jnp.zeros(kv_shape, model.dtype))
        vocab = model.config.vocab_size
        ids = np.random.default_rng(0).integers(0, vocab, shape.real).tolist()
        table = list(range(1, 1 + -(-(shape.start + shape.real) // BLOCK_SIZE)))
        b = build_step_batch([SeqChunk(ids, shape.start, table)], num_tokens=shape.bucket, num_seqs=1,
                             max_blocks=max_blocks, block_size=BLOCK_SIZE)
        meta = AttentionMetadata(*(jnp.asarray(a) for a in (b.query_start_loc, b.seq_lens, b.block_tables,
                                                           b.slot_mapping, b.num_seqs)))
        self.inputs = (jnp.asarray(b.input_ids), jnp.asarray(b.positions), meta, jnp.asarray(b.last_token_rows))
        graphdef = self.graphdef

        def forward(state, kv, input_ids, positions, meta, rows):
            m = nnx.merge(graphdef, state)
            hidden, kv = m(input_ids, positions, kv, meta)
            return m.logits(hidden[rows]), kv

        self.jitted = jax.jit(forward, donate_argnums=1)
        self.compiled: Callable | None = None

    def compile(self) -> float:
        t0 = time.perf_counter()
        self.compiled = self.jitted.lower(self.state, self.kv, *self.inputs).compile()
        return time.perf_counter() - t0

    def run(self, state: Any = None) -> tuple[np.ndarray, float]:
        """Logits of the sampled row and the wall time of one call (dispatch to ready)."""
        t0 = time.perf_counter()
        logits, self.kv = self.compiled(self.state if state is None else state, self.kv, *self.inputs)
        logits.block_until_ready()
        return np.asarray(logits), time.perf_counter() - t0


def bench_program(model: Any, shape: Shape, runs: int) -> dict[str, Any]:
    """Compile time and median run time of one program (after a warm-up call)."""
    prog = Program(model, shape)
    compile_s = prog.compile()
    prog.run()  # warm-up
    times = [prog.run()[1] for _ in range(runs)]
    row = {"compile_s": compile_s, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
           "all_ms": [1e3 * t for t in times]}
    print(f"  {shape.name}: compile {compile_s:.1f}s, run median {row['median_ms']:.1f}ms "
          f"(min {row['min_ms']:.1f}ms)", flush=True)
    return row


def format_table(result: dict[str, Any]) -> str:
    lines = ["", f"{'load (float32)':<16}{'median s':>10}{'min s':>10}  identical prefill logits"]
    for name, row in result["load"].items():
        lines.append(f"{name:<16}{row['median_s']:>10.2f}{row['min_s']:>10.2f}  "
                     f"{result['identical_logits'].get(name)}")
    names = list(result["tokens"])
    lines += ["", f"{'layer loop':<12}" + "".join(f"{n + ' compile s':>22}{n + ' run ms':>20}" for n in names)]
    for loop, rows in result["layer_loops"].items():
        lines.append(f"{loop:<12}" + "".join(f"{rows[n]['compile_s']:>22.2f}{rows[n]['median_ms']:>20.2f}"
                                             for n in names))
    env = result["env"]
    lines.append(f"\n(decode = 1 token at position {result['tokens']['decode']['start']} in the "
                 f"{DECODE_BUCKET}-token bucket; load average {env['loadavg_start']} -> {env['loadavg_end']})")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
