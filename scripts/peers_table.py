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
    at = lambda depth, **kw: next((b for b in bench if b.get("n_depth", 0) == depth
                                   and all(bool(b.get(k)) == v for k, v in kw.items())), None)
    pp, tg0, tg512 = at(0, n_prompt=True, n_gen=False), at(0, n_gen=True, n_prompt=False), at(512, n_gen=True, n_prompt=False)
    lines += ["", "| batch 1 | llama-bench t/s | imp_jax t/s | ratio |", "|---|---|---|---|"]
    ratio = lambda a, b: fmt(a and b and b / a, ".2f")
    for mode in modes:
        eng, short = load(out / f"imp_engine{mode}.json"), load(out / f"imp_engine{mode}_short.json")
        e1 = eng["engine"][0] if eng else None
        imp_pp = 512 / e1["ttft_median_s"] if e1 else None
        imp_tg512 = 1000 / eng["decode_step_ms"] if eng else None
        imp_tg0 = 1000 / short["decode_step_ms"] if short else None
        tag = f" `--gemm {mode[1:]}`" if mode else ""
        llama = lambda b: b and b["avg_ts"]
        lines += [f"| pp512 (prompt){tag} | {fmt(llama(pp))} | {fmt(imp_pp)} | {ratio(llama(pp), imp_pp)}x |",
                  f"| tg128 from an empty context{tag} | {fmt(llama(tg0))} | {fmt(imp_tg0)} | {ratio(llama(tg0), imp_tg0)}x |",
                  f"| tg128 after 512 tokens{tag} | {fmt(llama(tg512))} | {fmt(imp_tg512)} | {ratio(llama(tg512), imp_tg512)}x |"]
    lines += ["", "imp_jax's pp512 is 512 / its median TTFT of a 512-token prompt, and its tg128 1000 / its batch-1 "
              "decode step (ms) in `scripts/bench_engine.py --batches 1` at a 64-token context (the middle of "
              "llama-bench's 0..128) and at a 512-token one; llama-bench's are its own (`-p 512 -n 128 -d 0,512 -r 3`)."]
    print("\n".join(lines))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench_results/peers"))
