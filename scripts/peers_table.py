"""The docs/PERF.md tables of a scripts/bench_peers.sh run: imp_jax against llama-server, from its JSON files.

    python scripts/peers_table.py bench_results/peers

A run of ROUNDS rounds leaves one file per server, concurrency level and round (`serving_llama.c8.r2.json`;
a run before rounds existed, `serving_llama.c8.json`, reads as one round): each cell is the median over the
rounds, throughput with its spread (min-max), so one noisy round on a shared machine shows as a wide spread
instead of moving the ratio.
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

LEVEL = re.compile(r"\.c(\d+)(?:\.r\d+)?\.json$")


def load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def by_round(out: Path, name: str) -> list[Any]:
    """`NAME.json` (a run from before rounds; None when absent), then every `NAME.rN.json` in round order."""
    paths = sorted(out.glob(f"{name}.r*.json"), key=lambda p: int(p.name.rsplit(".r", 1)[1].split(".")[0]))
    return [load(out / f"{name}.json")] + [load(p) for p in paths]


def rounds(out: Path, prefix: str, c: int) -> list[dict[str, Any]]:
    """Every round's file of `prefix` at concurrency `c` (`PREFIX.cC.json`, `PREFIX.cC.rN.json`), in round order."""
    return [data for data in by_round(out, f"{prefix}.c{c}") if data]


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def spread(values: list[float]) -> str:
    """`median (min-max)`, or the one value of a single round."""
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def ready_s(out: Path, name: str) -> float | None:
    """The median time to ready of `name` over the rounds (`ready_NAME.json`, `ready_NAME.rN.json`)."""
    return median([(data or {}).get("ready_s") for data in by_round(out, f"ready_{name}")])


def level_row(out: Path, mode: str, c: int) -> str | None:
    """One concurrency level's row: llama-server's rounds against imp_jax's (`mode`: "" or "_cpu_q8", ...)."""
    a_runs, b_runs = rounds(out, "serving_llama", c), rounds(out, f"serving_imp{mode}", c)
    if not a_runs or not b_runs:
        return None
    a, b = [r["levels"][0] for r in a_runs], [r["levels"][0] for r in b_runs]
    tps = lambda lv: [x["output_tok_per_s"] for x in lv]   # noqa: E731
    med = lambda lv, key: median([x[key] for x in lv])      # noqa: E731
    ratio = median(tps(b)) / median(tps(a)) if median(tps(a)) else None
    e2e = lambda lv: med(lv, "e2e_p50_ms") and med(lv, "e2e_p50_ms") / 1000   # noqa: E731
    loads = [median([r["env"]["loadavg_start"][0] for r in runs]) for runs in (a_runs, b_runs)]
    return (f"| {c} | {b[0]['requests']} | {len(a)} / {len(b)} | {spread(tps(a))} | {spread(tps(b))} | "
            f"**{fmt(ratio, '.2f')}x** | {fmt(med(a, 'ttft_p50_ms'), '.0f')} / {fmt(med(b, 'ttft_p50_ms'), '.0f')} | "
            f"{fmt(med(a, 'tpot_p50_ms'))} / {fmt(med(b, 'tpot_p50_ms'))} | {fmt(e2e(a), '.2f')} / {fmt(e2e(b), '.2f')} | "
            f"{sum(x['failed'] for x in a)} / {sum(x['failed'] for x in b)} | {fmt(loads[0])} / {fmt(loads[1])} |")


def llama_bench_ts(runs: list[Any], depth: int, prompt: bool) -> list[float]:
    """llama-bench's t/s per round: its pp512 (`prompt`) or its tg128 after `depth` tokens."""
    return [b["avg_ts"] for run in runs for b in run or []
            if b.get("n_depth", 0) == depth and bool(b.get("n_prompt")) == prompt and bool(b.get("n_gen")) != prompt]


def batch_one(out: Path, modes: list[str]) -> list[str]:
    """The batch-1 rows: llama-bench and imp_jax's bench_engine.py, run in turn in each round
    (`llama_bench.rN.json`, `imp_engine{mode}.rN.json`; a run from before rounds, `llama_bench.json`, reads as one
    round). imp_jax's tg128 is the wall clock of its decode steps, one token each (speculation off), from a
    16-token prompt and after a 512-token one; its pp512 is 512 / the 512-token prompt's time to first token."""
    llama_runs = [r for r in by_round(out, "llama_bench") if r]
    llama = {"pp512": llama_bench_ts(llama_runs, 0, True), "tg0": llama_bench_ts(llama_runs, 0, False),
             "tg512": llama_bench_ts(llama_runs, 512, False)}
    lines = ["", "| batch 1 | rounds (llama / imp) | llama-bench t/s | imp_jax t/s | ratio of medians |", "|---|---|---|---|---|"]
    names = {"pp512": "pp512 (prompt)", "tg0": "tg128 from an empty context", "tg512": "tg128 after 512 tokens"}
    for mode in modes:
        runs = [r for r in by_round(out, f"imp_engine{mode}")[1:] if r and r.get("engine")]   # rounds only: an older
        # run's imp_engine.json timed the device alone
        imp = {"pp512": [512 / r["long_context"]["ttft_median_s"] for r in runs if r.get("long_context")],
               "tg0": [1 / r["engine"][0]["decode_step_s"] for r in runs],
               "tg512": [1 / r["long_context"]["decode_step_s"] for r in runs if r.get("long_context")]}
        tag = f" `--gemm {mode[1:]}`" if mode else ""
        for key, name in names.items():
            a, b = llama[key], imp[key]
            ratio = fmt(median(b) / median(a), ".2f") if a and b else "-"
            lines.append(f"| {name}{tag} | {len(a)} / {len(b)} | {spread(a) if a else '-'} | {spread(b) if b else '-'} | "
                         f"**{ratio}x** |")
    return lines + ["", "Batch 1, in turn in each round: llama-bench `-p 512 -n 128 -d 0,512 -r 1`, then imp_jax's "
                    "`scripts/bench_engine.py --batches 1 --prompt-len 16 --long-context 512 --output-len 128 "
                    "--prompts random --speculative off`: its tg128 is 1 / the wall clock of a decode step (one token "
                    "each) from a 16-token prompt and after a 512-token one, its pp512 512 / the 512-token prompt's "
                    "time to first token."]


def main(out_dir: str) -> int:
    out = Path(out_dir)
    run = load(out / "run.json") or {}
    levels = sorted({int(m.group(1)) for p in out.glob("serving_*.json") if (m := LEVEL.search(p.name))})
    lines = [f"{run.get('date', '?')}, commit {run.get('commit', '?')}, {run.get('cpu', '?')} ({run.get('nproc', '?')} "
             f"cores), load average {run.get('loadavg_start', '?')} at the start, "
             f"{' '.join(run.get('loadavg_end', ['?']))} at the end; `bash scripts/bench_peers.sh`; model "
             f"`{Path(run.get('model', '?')).name}`; llama.cpp from llama-cpp-python {run.get('llama_cpp_python', '?')} "
             f"({run.get('llama_isa', 'native')}), `llama-server -t {run.get('threads', '?')} -c 16384 -np 32`; imp_jax "
             f"`python -m imp_jax.server --max-num-seqs 32`; prompts of {run.get('input_len', '?')} unique tokens, "
             f"{run.get('output_len', '?')} output tokens each (ignore_eos), streamed, closed loop; "
             f"{run.get('rounds', 1)} round(s), llama-server then imp_jax in each: medians (min-max) over them.", ""]
    modes = [""] + sorted({p.name[len("serving_imp"):].split(".c")[0] for p in out.glob("serving_imp_*.json")})
    for mode in modes:
        name = f"imp_jax `--gemm {mode[1:]}`" if mode else "imp_jax (the default, `--gemm auto`)"
        lines += [f"{name}:", "",
                  "| streams | requests | rounds (llama / imp) | llama-server tok/s | imp_jax tok/s | ratio of medians | "
                  "TTFT p50 ms (llama / imp) | TPOT p50 ms (llama / imp) | E2E p50 s (llama / imp) | "
                  "failed (llama / imp) | load avg (llama / imp) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [row for c in levels if (row := level_row(out, mode, c))]
        lines.append("")
    lines += ["| time to ready (process start to /health or /ready 200; warm: median over the rounds) | cold | warm |",
              "|---|---|---|",
              f"| llama-server | {fmt(ready_s(out, 'llama_cold'))} s | {fmt(ready_s(out, 'llama_warm'))} s |",
              f"| imp_jax | {fmt(ready_s(out, 'imp_cold'))} s | {fmt(ready_s(out, 'imp_warm'))} s |"]
    lines += [f"| imp_jax `--gemm {m[1:]}` | - s | {fmt(ready_s(out, f'imp_warm{m}'))} s |" for m in modes if m]
    lines += batch_one(out, modes)
    print("\n".join(lines))
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "bench_results/peers"))
