"""Closed-loop serving benchmark against any OpenAI-compatible server (imp_jax, llama-server, vLLM).

    python scripts/bench_serving.py --url http://127.0.0.1:8080 [--concurrency 1 8 32]
        [--input-len 128] [--output-len 128] [--shared-prefix 0] [--slo-ttft-ms 1000 --slo-tpot-ms 100]
        [--out bench_results/serving.json]

At each concurrency level, that many clients each send a streamed /v1/completions request and
the next one when it ends, until --requests are done. Prompts are token-id lists (so every server
sees the same tokens), each distinct from its first token: no prefix-cache hit flatters anyone.
--shared-prefix N makes the first N tokens common to all prompts (the cached case). Output length
is held at --output-len with `ignore_eos` and a -100 `logit_bias` on --ban-tokens (the EOS ids).
Per level: TTFT, TPOT, inter-token and end-to-end latency at p50/p95/p99, requests/s, output
tok/s, goodput under the SLOs, and the deltas of the server's `imp_*` /metrics series when it has
them. A table on stdout, JSON to --out. Send it only to servers you run on this machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PERCENTILES = (50, 95, 99)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    ok: bool
    error: str = ""
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    prompt_tokens: int = 0
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried text

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def make_prompts(count: int, length: int, shared_prefix: int, token_range: tuple[int, int], seed: int) -> list[list[int]]:
    """`count` token-id prompts of `length` tokens; after the shared prefix each starts with its own token."""
    rng = random.Random(seed)
    lo, hi = token_range
    if hi - lo < count:
        raise SystemExit(f"--token-range {lo}..{hi} has fewer ids than the {count} prompts that must start apart")
    prefix = [rng.randrange(lo, hi) for _ in range(min(shared_prefix, length - 1))]
    firsts = rng.sample(range(lo, hi), count)
    rest = length - len(prefix) - 1
    return [prefix + [first] + [rng.randrange(lo, hi) for _ in range(rest)] for first in firsts]


async def one_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], timeout: float) -> RequestResult:
    """Stream one completion and time its chunks; any non-200, malformed frame or short answer is an error."""
    t0 = time.perf_counter()
    res = RequestResult(ok=False)
    last = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                now = time.perf_counter() - t0
                usage = msg.get("usage")
                if usage:
                    res.output_tokens = usage.get("completion_tokens", res.output_tokens)
                    res.prompt_tokens = usage.get("prompt_tokens", 0)
                text = "".join(c.get("text") or "" for c in msg.get("choices") or [])
                if not text:
                    continue
                chunks += 1
                if res.ttft is None:
                    res.ttft = now
                elif last is not None:
                    res.itl.append(now - last)
                last = now
            if not res.output_tokens:
                res.output_tokens = chunks  # a server without stream usage: one token per chunk
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.ok = res.ttft is not None
    if not res.ok:
        res.error = "no token in the answer"
    return res


def request_body(model: str, prompt: list[int], output_len: int, ban: list[int]) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True,
            "logit_bias": {str(t): -100 for t in ban}}


async def run_level(base: str, model: str, prompts: list[list[int]], concurrency: int, args: argparse.Namespace,
                    headers: dict[str, str]) -> tuple[list[RequestResult], float]:
    """Closed loop: `concurrency` workers take prompts in order until none are left."""
    todo = iter(prompts)
    results: list[RequestResult] = []
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(headers=headers, limits=limits) as client:
        async def worker() -> None:
            for prompt in todo:
                results.append(await one_request(client, url, request_body(model, prompt, args.output_len, args.ban_tokens),
                                                 args.request_timeout))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


def pct(values: list[float], p: float) -> float | None:
    """The p-th percentile (linear interpolation), None when there are no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall: float, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    series = {"ttft": [r.ttft for r in ok], "tpot": [r.tpot for r in ok if r.tpot is not None],
              "itl": [g for r in ok for g in r.itl], "e2e": [r.e2e for r in ok]}
    out_tokens = sum(r.output_tokens for r in ok)
    good = [r for r in ok
            if (args.slo_ttft_ms is None or r.ttft * 1000 <= args.slo_ttft_ms)
            and (args.slo_tpot_ms is None or (r.tpot or 0) * 1000 <= args.slo_tpot_ms)]
    level: dict[str, Any] = {
        "concurrency": concurrency, "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5], "wall_s": wall,
        "requests_per_s": len(ok) / wall, "output_tok_per_s": out_tokens / wall, "output_tokens": out_tokens,
        "mean_output_tokens": out_tokens / len(ok) if ok else 0.0,
        "goodput_requests_per_s": len(good) / wall, "goodput_fraction": len(good) / len(results) if results else 0.0,
    }
    for name, values in series.items():
        for p in PERCENTILES:
            v = pct(values, p)
            level[f"{name}_p{p}_ms"] = None if v is None else v * 1000
        level[f"{name}_mean_ms"] = statistics.fmean(values) * 1000 if values else None
    return level


METRIC_LINE = re.compile(r"^(imp_[a-zA-Z0-9_]+)(\{[^}]*\})?\s+([-+0-9.eEinfa]+)$")


async def scrape(client: httpx.AsyncClient, base: str) -> dict[str, float] | None:
    """The server's imp_* series (labels kept in the key), or None when it has no Prometheus /metrics."""
    try:
        r = await client.get(base + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    values = {}
    for line in r.text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return values or None


def metric_deltas(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float] | None:
    """Counters (and histogram sums and counts) that moved, plus the mean of each histogram over the level."""
    if before is None or after is None:
        return None
    def name(k: str) -> str:
        return k.split("{", 1)[0]

    deltas = {k: after[k] - before.get(k, 0.0) for k in after
              if name(k).endswith(("_total", "_sum", "_count")) and after[k] != before.get(k, 0.0)}
    for k in list(deltas):
        n, labels = name(k), k[len(name(k)):]
        count = deltas.get(n[:-4] + "_count" + labels) if n.endswith("_sum") else None
        if count:
            deltas[n[:-4] + "_mean" + labels] = deltas[k] / count
    return deltas


async def served_model(client: httpx.AsyncClient, base: str) -> str:
    r = await client.get(base + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def environment() -> dict[str, Any]:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "commit": commit,
            "machine": platform.machine(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "loadavg_start": os.getloadavg()}


def print_table(label: str, levels: list[dict[str, Any]]) -> None:
    cols = [("conc", "concurrency", "{:d}"), ("ok", "completed", "{:d}"), ("req/s", "requests_per_s", "{:.2f}"),
            ("out tok/s", "output_tok_per_s", "{:.1f}"),
            ("TTFT p50/p95/p99 ms", ("ttft_p50_ms", "ttft_p95_ms", "ttft_p99_ms"), "{:.0f}"),
            ("TPOT p50/p95/p99 ms", ("tpot_p50_ms", "tpot_p95_ms", "tpot_p99_ms"), "{:.1f}"),
            ("ITL p50/p95/p99 ms", ("itl_p50_ms", "itl_p95_ms", "itl_p99_ms"), "{:.1f}"),
            ("E2E p50/p95/p99 s", ("e2e_p50_ms", "e2e_p95_ms", "e2e_p99_ms"), "s"),
            ("goodput req/s", "goodput_requests_per_s", "{:.2f}")]

    def cell(level: dict[str, Any], key: Any, fmt: str) -> str:
        if isinstance(key, tuple):
            vals = [level[k] for k in key]
            if fmt == "s":
                return "/".join("-" if v is None else f"{v / 1000:.2f}" for v in vals)
            return "/".join("-" if v is None else fmt.format(v) for v in vals)
        return fmt.format(level[key])

    rows = [[name for name, _, _ in cols]] + [[cell(lv, k, f) for _, k, f in cols] for lv in levels]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    print(f"\n## {label}")
    for i, r in enumerate(rows):
        print("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    base = args.url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(headers=headers) as client:
        model = args.model or await served_model(client, base)
        result: dict[str, Any] = {"label": args.label or base, "url": base, "model": model, "env": environment(),
                                  "config": {k: v for k, v in vars(args).items() if k != "api_key"}, "levels": []}
        seed = args.seed
        if args.warmup:
            warm = make_prompts(args.warmup, args.input_len, 0, tuple(args.token_range), seed + 999)
            await run_level(base, model, warm, 1, argparse.Namespace(**{**vars(args), "output_len": 8}), headers)
        for c in args.concurrency:
            n = args.requests or max(8, 2 * c)
            prompts = make_prompts(n, args.input_len, args.shared_prefix, tuple(args.token_range), seed + c)
            before = await scrape(client, base)
            results, wall = await run_level(base, model, prompts, c, args, headers)
            after = await scrape(client, base)
            level = summarize(results, wall, c, args)
            level["metrics_delta"] = metric_deltas(before, after)
            result["levels"].append(level)
            print(f"# c={c}: {level['completed']}/{n} in {wall:.1f} s, {level['output_tok_per_s']:.1f} out tok/s, "
                  f"TTFT p50 {level['ttft_p50_ms'] or 0:.0f} ms" + (f"; errors {level['errors']}" if level["failed"] else ""),
                  file=sys.stderr, flush=True)
        result["env"]["loadavg_end"] = os.getloadavg()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/bench_serving.py", description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True, help="server base URL (loopback), e.g. http://127.0.0.1:8080")
    ap.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    ap.add_argument("--label", default=None, help="name of this run in the table and JSON")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default max(8, 2 x concurrency))")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens common to every prompt (the cached case)")
    ap.add_argument("--token-range", type=int, nargs=2, default=[1000, 30000],
                    help="prompt token ids are drawn from [lo, hi): ordinary tokens of the model's vocabulary")
    ap.add_argument("--ban-tokens", type=int, nargs="*", default=[],
                    help="token ids given a -100 logit_bias (EOS and end-of-turn ids) beside ignore_eos")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=1, help="short requests sent first, not counted")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=os.environ.get("IMP_JAX_API_KEY"))
    ap.add_argument("--out", default=None, help="JSON results file")
    args = ap.parse_args(argv)
    if args.input_len < 2 or args.output_len < 1 or min(args.concurrency) < 1:
        ap.error("--input-len >= 2, --output-len >= 1 and every --concurrency >= 1")
    result = asyncio.run(main_async(args))
    print_table(f"{result['label']} ({result['model']}), input {args.input_len}, output {args.output_len}"
                + (f", shared prefix {args.shared_prefix}" if args.shared_prefix else ""), result["levels"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"# wrote {args.out}", file=sys.stderr)
    return 1 if any(lv["failed"] for lv in result["levels"]) else 0


if __name__ == "__main__":
    sys.exit(main())
