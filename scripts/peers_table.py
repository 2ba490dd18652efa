"""The docs/PERF.md tables of a scripts/bench_peers.sh run: imp_jax against llama-server, from its JSON files.

    python scripts/peers_table.py bench_results/peers
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def level(out: Path, prefix: str, c: int) -> dict[str, Any] | None:
    data = load(out / f"{prefix}.c{c}.json")
    return data["levels"][0] if data else None


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def main(out_dir: str) -> int:
    out = Path(out_dir)
    run = load(out / "run.json") or {}
    levels = sorted({int(p.name.split(".c")[1].split(".")[0]) for p in out.glob("serving_*.c*.json")})
    lines = [f"{run.get('date', '?')}, commit {run.get('commit', '?')}, {run.get('cpu', '?')} ({run.get('nproc', '?')} "
             f"cores), load average {run.get('loadavg_start', '?')} at the start, "
             f"{' '.join(run.get('loadavg_end', ['?']))} at the end; `bash scripts/bench_peers.sh`; model "
             f"`{Path(run.get('model', '?')).name}`; llama.cpp from llama-cpp-python {run.get('llama_cpp_python', '?')}, "
             f"`llama-server -t {run.get('threads', '?')} -c 16384 -np 32`; imp_jax `python -m imp_jax.server "
             f"--max-num-seqs 32`; prompts of {run.get('input_len', '?')} unique tokens, "
             f"{run.get('output_len', '?')} output tokens each (ignore_eos), streamed, closed loop.", ""]
    modes = [""] + sorted(p.name[len("serving_imp"):].split(".c")[0] for p in out.glob("serving_imp_*.c*.json")
                          if p.name.endswith(f".c{levels[0]}.json")) if levels else [""]
    for mode in modes:
        name = f"imp_jax `--gemm {mode[1:]}`" if mode else "imp_jax (the default exact arithmetic)"
        lines += [f"{name}:", "",
                  "| streams | requests | llama-server tok/s | imp_jax tok/s | ratio | TTFT p50 ms (llama / imp) | "
                  "TPOT p50 ms (llama / imp) | E2E p50 s (llama / imp) | failed (llama / imp) | load avg (llama / imp) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for c in levels:
            a, b = level(out, "serving_llama", c), level(out, f"serving_imp{mode}", c)
            if not a or not b:
                continue
            loads = [load(out / f"{p}.c{c}.json")["env"]["loadavg_start"][0] for p in ("serving_llama", f"serving_imp{mode}")]
            ratio = b["output_tok_per_s"] / a["output_tok_per_s"] if a["output_tok_per_s"] else None
            lines.append(f"| {c} | {b['requests']} | {a['output_tok_per_s']:.1f} | {b['output_tok_per_s']:.1f} | "
                         f"**{fmt(ratio, '.2f')}x** | {fmt(a['ttft_p50_ms'], '.0f')} / {fmt(b['ttft_p50_ms'], '.0f')} | "
                         f"{fmt(a['tpot_p50_ms'])} / {fmt(b['tpot_p50_ms'])} | "
                         f"{fmt(a['e2e_p50_ms'] and a['e2e_p50_ms'] / 1000, '.2f')} / "
                         f"{fmt(b['e2e_p50_ms'] and b['e2e_p50_ms'] / 1000, '.2f')} | {a['failed']} / {b['failed']} | "
                         f"{loads[0]:.1f} / {loads[1]:.1f} |")
        lines.append("")
    ready = {n: (load(out / f"ready_{n}.json") or {}).get("ready_s") for n in ("llama_cold", "llama_warm", "imp_cold", "imp_warm")}
    lines += ["| time to ready (process start to /health or /ready 200) | cold | warm |", "|---|---|---|",
              f"| llama-server | {fmt(ready['llama_cold'])} s | {fmt(ready['llama_warm'])} s |",
              f"| imp_jax | {fmt(ready['imp_cold'])} s | {fmt(ready['imp_warm'])} s |"]
    lines += [f"| imp_jax `--gemm {m[1:]}` | - s | {fmt((load(out / f'ready_imp_warm{m}.json') or {}).get('ready_s'))} s |"
              for m in modes if m]
    bench = load(out / "llama_bench.json") or []
    pp = next((b for b in bench if b.get("n_prompt") and not b.get("n_gen")), None)
    tg = next((b for b in bench if b.get("n_gen") and not b.get("n_prompt")), None)
    lines += ["", "| batch 1 | llama-bench t/s | imp_jax t/s | ratio |", "|---|---|---|---|"]
    for mode in modes:
        eng = load(out / f"imp_engine{mode}.json")
        e1 = eng["engine"][0] if eng else None
        imp_pp = 512 / e1["ttft_median_s"] if e1 else None
        imp_tg = 1000 / eng["decode_step_ms"] if eng else None
        tag = f" `--gemm {mode[1:]}`" if mode else ""
        lines += [f"| pp512 (prompt){tag} | {fmt(pp and pp['avg_ts'])} | {fmt(imp_pp)} | "
                  f"{fmt(pp and imp_pp and imp_pp / pp['avg_ts'], '.2f')}x |",
                  f"| tg128 (decode){tag} | {fmt(tg and tg['avg_ts'])} | {fmt(imp_tg)} | "
                  f"{fmt(tg and imp_tg and imp_tg / tg['avg_ts'], '.2f')}x |"]
    lines += ["", "imp_jax's pp512 is 512 / its median TTFT of a 512-token prompt and tg128 1000 / its batch-1 decode "
              "step (ms) in `scripts/bench_engine.py --batches 1 --prompt-len 512 --output-len 128 "
              "--max-num-batched-tokens 512`; llama-bench's are its own (`-p 512 -n 128 -r 3`)."]
    print("\n".join(lines))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench_results/peers"))
