"""Fairness between API keys: one key's flood against another key's single stream, on a real server.

    python scripts/bench_fairness.py [--model smollm2-135m-instruct] [--modes fair unfair]
        [--flood 32 --n 4 --flood-tokens 64] [--b-requests 3 --b-tokens 32]
        [--server-args "--max-num-seqs 8 ..."] [--out bench_results/fairness.json]

Per mode it starts `python -m imp_jax.server` on loopback with two keys (a key file): `fair` as is,
`unfair` with --no-fair-tenants, `capped` fair with --max-concurrent-per-key --cap (A's refused
requests retry after their Retry-After). Key B sends --b-requests streamed chat requests one at a time, alone
and then while key A keeps --flood requests of n=--n choices, --flood-tokens tokens each (ignore_eos)
in flight; the flood is cancelled once B is done. Reported for B: time to first token and decode
tokens/s (after the first token), alone and under the flood, and their ratios. A table on stdout,
JSON to --out. The default sizing is the tests' (its programs come from the compile cache).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from loopback import free_port

KEYS = {"A": "bench-key-a", "B": "bench-key-b"}
SIZING = "--max-num-seqs 8 --max-num-batched-tokens 64 --max-model-len 1024 --num-kv-blocks 256"
PROMPT_B = "Write a short story about a lighthouse keeper and the sea."
PROMPT_A = "List every prime number you know, one per line, with a remark on each."


MODE_FLAGS = {"fair": [], "unfair": ["--no-fair-tenants"], "capped": ["--max-concurrent-per-key"]}


def start_server(args: argparse.Namespace, mode: str, key_file: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """The server for one mode, once its /ready answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "imp_jax.server", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
           "--api-key-file", str(key_file), *shlex.split(args.server_args), *MODE_FLAGS[mode]]
    if mode == "capped":
        cmd.append(str(args.cap))
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited: see {log}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"not ready after {args.ready_timeout:.0f} s: see {log}")


async def stream_b(client: httpx.AsyncClient, model: str, tokens: int) -> dict[str, float]:
    """One streamed request of key B: TTFT and decode tokens/s after the first token (usage counts tokens)."""
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT_B}], "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent, first, n = time.monotonic(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=_auth("B")) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                first = time.monotonic()
            if chunk.get("usage"):
                n = chunk["usage"]["completion_tokens"]
    end = time.monotonic()
    assert first is not None, "no token came back"
    return {"ttft_s": first - sent, "tok_s": (n - 1) / max(end - first, 1e-9), "tokens": n}


async def flood_a(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT_A}], "max_tokens": args.flood_tokens, "n": args.n,
            "ignore_eos": True}

    async def one() -> None:
        while True:   # keep the flood up until cancelled
            r = await client.post("/v1/chat/completions", json=body, headers=_auth("A"))
            if r.status_code == 429:
                await asyncio.sleep(float(r.headers.get("Retry-After", "1")))

    await asyncio.gather(*(one() for _ in range(args.flood)))


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[key]}"}


async def b_series(client: httpx.AsyncClient, model: str, args: argparse.Namespace) -> list[dict[str, float]]:
    return [await stream_b(client, model, args.b_tokens) for _ in range(args.b_requests)]


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """B alone, then B under A's flood."""
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=args.flood + 8)) as c:
        model = (await c.get("/v1/models", headers=_auth("B"))).json()["data"][0]["id"]
        await stream_b(c, model, 4)   # warm: the first request's one-off costs
        alone = await b_series(c, model, args)
        flood = asyncio.create_task(flood_a(c, model, args))
        await asyncio.sleep(args.flood_head_start)
        waiting = (await c.get("/metrics", headers=_auth("A"))).text
        under = await b_series(c, model, args)
        flood.cancel()
        await asyncio.gather(flood, return_exceptions=True)
    queued = [line for line in waiting.splitlines() if line.startswith("imp_queue_depth ")]
    return {"alone": alone, "flood": under, "queue_depth_at_b_start": queued[0].split()[-1] if queued else None}


def summary(runs: dict[str, Any]) -> dict[str, float]:
    def mean(side: str, key: str) -> float:
        return statistics.fmean(r[key] for r in runs[side])

    out = {f"{side}_{key}": mean(side, key) for side in ("alone", "flood") for key in ("ttft_s", "tok_s")}
    out["ttft_ratio"] = out["flood_ttft_s"] / out["alone_ttft_s"]
    out["tok_s_ratio"] = out["alone_tok_s"] / out["flood_tok_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--modes", nargs="+", default=["fair", "unfair"], choices=list(MODE_FLAGS))
    ap.add_argument("--cap", type=int, default=1, help="--max-concurrent-per-key of the capped mode")
    ap.add_argument("--flood", type=int, default=32, help="key A's concurrent requests")
    ap.add_argument("--n", type=int, default=4, help="choices per flood request")
    ap.add_argument("--flood-tokens", type=int, default=64)
    ap.add_argument("--flood-head-start", type=float, default=2.0, help="seconds the flood runs before B starts")
    ap.add_argument("--b-requests", type=int, default=3)
    ap.add_argument("--b-tokens", type=int, default=32)
    ap.add_argument("--server-args", default=SIZING)
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--out", default="bench_results/fairness.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_fairness_"))
    key_file = tmp / "keys.txt"
    key_file.write_text("".join(f"{k}\n" for k in KEYS.values()))
    result: dict[str, Any] = {"args": vars(args), "load_average_before": os.getloadavg(), "modes": {}}
    for mode in args.modes:
        proc, url = start_server(args, mode, key_file, tmp / f"server_{mode}.log")
        try:
            runs = asyncio.run(measure(url, args))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        result["modes"][mode] = {"summary": summary(runs), **runs}
        s = result["modes"][mode]["summary"]
        print(f"{mode:7s} B alone: TTFT {s['alone_ttft_s']:.2f} s, {s['alone_tok_s']:.1f} tok/s | under flood: "
              f"TTFT {s['flood_ttft_s']:.2f} s ({s['ttft_ratio']:.1f}x), {s['flood_tok_s']:.1f} tok/s "
              f"({s['tok_s_ratio']:.1f}x slower) | queue depth at B's start {runs['queue_depth_at_b_start']}",
              flush=True)
    result["load_average_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"load average before {result['load_average_before']}, after {result['load_average_after']}; "
          f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
