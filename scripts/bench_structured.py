"""Structured output cost: output tok/s of a json_schema Chat request vs the same request unconstrained.

    python scripts/bench_structured.py --url http://127.0.0.1:8080 [--concurrency 1 8] [--output-len 64]
        [--requests-per-stream 2] [--rounds 2] [--out bench_results/structured.json]

At each concurrency level, that many clients each send non-streamed /v1/chat/completions requests
(the next when one ends) until `requests-per-stream` x concurrency are done, once unconstrained and
once with `response_format` json_schema, alternating for `--rounds` so a change in the machine's
load hits both alike. Every request runs exactly --output-len tokens: the unconstrained one with
`ignore_eos`, the constrained one under a schema (a long array of short strings) that is still open
when max_tokens cuts it. Prints output tok/s of each, their ratio, the engine's mask time per
constrained step and per row, and the engine's host and device time per step of each (the deltas of
/health's counters: on a shared machine the host time is the steadier measure of what a constraint
adds), and the 1-minute load average before and after; JSON to --out. Send it only to a server you run on this machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

SCHEMA = {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 24}, "minItems": 500,
          "maxItems": 1000}  # still open after any --output-len this is run with
MESSAGES = [{"role": "system", "content": "Reply with a JSON array of strings."},
            {"role": "user", "content": "List as many city names as you can."}]
COUNTERS = ("constrained_steps_total", "constrained_rows_total", "constraint_mask_seconds_total", "num_steps",
            "step_host_seconds_total", "step_device_seconds_total", "compilations_after_warmup")


def body(model: str, output_len: int, constrained: bool) -> dict[str, Any]:
    b: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": output_len, "temperature": 0.7,
                         "seed": 1}
    if constrained:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "cities", "schema": SCHEMA}}
    else:
        b["ignore_eos"] = True
    return b


async def run_level(client: httpx.AsyncClient, url: str, payload: dict[str, Any], concurrency: int,
                    requests: int) -> tuple[int, float]:
    """(output tokens, seconds) of `requests` requests from `concurrency` closed-loop clients."""
    left = requests
    tokens = 0

    async def worker() -> None:
        nonlocal left, tokens
        while left > 0:
            left -= 1
            r = await client.post(url + "/v1/chat/completions", json=payload, timeout=600)
            r.raise_for_status()
            out = r.json()
            if out["choices"][0]["finish_reason"] != "length":
                raise SystemExit(f"a request ended before --output-len: {out['choices'][0]}")
            tokens += out["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, time.perf_counter() - t0


def stats(url: str) -> dict[str, float]:
    health = httpx.get(url + "/health", timeout=30).json()
    return {k: float(health.get(k, 0)) for k in COUNTERS}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    results = []
    async with httpx.AsyncClient() as client:
        for c in args.concurrency:
            totals = {False: [0, 0.0], True: [0, 0.0]}
            engine = {False: dict.fromkeys(COUNTERS, 0.0), True: dict.fromkeys(COUNTERS, 0.0)}
            for _ in range(args.rounds):
                for constrained in (False, True):
                    before = stats(args.url)
                    toks, secs = await run_level(client, args.url, body(model, args.output_len, constrained), c,
                                                 args.requests_per_stream * c)
                    after = stats(args.url)
                    totals[constrained][0] += toks
                    totals[constrained][1] += secs
                    for k in COUNTERS:
                        engine[constrained][k] += after[k] - before[k]
            free, con = (totals[k][0] / totals[k][1] for k in (False, True))
            mask = engine[True]
            steps, rows = mask["constrained_steps_total"], mask["constrained_rows_total"]
            per_step = {k: {which: 1e3 * engine[k][f"step_{which}_seconds_total"] / engine[k]["num_steps"]
                            for which in ("host", "device")} for k in (False, True)}
            results.append({
                "concurrency": c, "unconstrained_tok_s": free, "json_schema_tok_s": con, "ratio": con / free,
                "mask_ms_per_step": 1e3 * mask["constraint_mask_seconds_total"] / steps if steps else None,
                "mask_ms_per_row": 1e3 * mask["constraint_mask_seconds_total"] / rows if rows else None,
                "rows_per_step": rows / steps if steps else None,
                "host_ms_per_step": {"unconstrained": per_step[False]["host"], "json_schema": per_step[True]["host"]},
                "device_ms_per_step": {"unconstrained": per_step[False]["device"],
                                       "json_schema": per_step[True]["device"]},
                "compilations_after_warmup": mask["compilations_after_warmup"] + engine[False]["compilations_after_warmup"],
            })
    return {"results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    report = asyncio.run(main_async(args))
    report.update(load_avg_1m_before=load_before, load_avg_1m_after=os.getloadavg()[0], output_len=args.output_len,
                  rounds=args.rounds, requests_per_stream=args.requests_per_stream, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(f"{'streams':>7} {'free tok/s':>10} {'json tok/s':>10} {'ratio':>6} {'mask ms/step':>12} "
          f"{'mask ms/row':>11} {'host ms/step free/json':>22} {'device ms/step free/json':>24}")
    for r in report["results"]:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        host, dev = r["host_ms_per_step"], r["device_ms_per_step"]
        print(f"{r['concurrency']:>7} {r['unconstrained_tok_s']:>10.1f} {r['json_schema_tok_s']:>10.1f} "
              f"{r['ratio']:>6.3f} {fmt(r['mask_ms_per_step']):>12} {fmt(r['mask_ms_per_row']):>11} "
              f"{host['unconstrained']:>10.2f} / {host['json_schema']:<9.2f} "
              f"{dev['unconstrained']:>11.1f} / {dev['json_schema']:<10.1f}")
    print(f"load average (1 min): {report['load_avg_1m_before']:.2f} before, {report['load_avg_1m_after']:.2f} after")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
