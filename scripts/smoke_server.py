"""Server smoke test: start `python -m imp_jax.server` on loopback, wait for /ready, ask one chat
question through the `openai` package and one through the `anthropic` package, check both answers
are non-empty, optionally run scripts/bench_serving.py against it (--serving-concurrency), stop the
server with SIGTERM and check it exits cleanly.

    python scripts/smoke_server.py --model PATH [--log server.log] [--out server.json]
        [--serving-concurrency 1 128 --serving-out serving.json] [-- ENGINE FLAGS]

Engine flags after `--` go to the server (default: a small engine, few programs to compile).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_serving  # noqa: E402
from loopback import free_port  # noqa: E402

SMALL_ENGINE = ["--max-num-seqs", "2", "--max-num-batched-tokens", "32", "--max-model-len", "512",
                "--num-kv-blocks", "128"]
QUESTION = "What is the capital of France? Answer in one word."


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    """Seconds until GET /ready answers 200; raises if the server exits or the time runs out."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"/ready did not answer 200 within {timeout:.0f}s")


def ask_openai(url: str, model: str) -> str:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=16, temperature=0)
    return reply.choices[0].message.content or ""


def ask_anthropic(url: str, model: str) -> str:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)
    # anthropic 2.x has no sampling parameters of its own: they travel in extra_body
    reply = client.messages.create(model=model, max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
                                   extra_body={"temperature": 0})
    return "".join(b.text for b in reply.content if b.type == "text")


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then SIGKILL if the server has not exited within `timeout` s; its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def serving_benchmark(url: str, a: argparse.Namespace) -> bool:
    """bench_serving.py at each --serving-concurrency on the running server; True when no request failed."""
    argv = ["--url", url, "--concurrency", *map(str, a.serving_concurrency), "--input-len", str(a.serving_input_len),
            "--output-len", str(a.serving_output_len), "--token-range", *map(str, a.serving_token_range)]
    argv += ["--requests", str(a.serving_requests)] if a.serving_requests else []
    return bench_serving.main(argv + (["--out", a.serving_out] if a.serving_out else [])) == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model path (GGUF, HF or converted dir) or alias")
    p.add_argument("--log", default="server.log", help="the server's stdout and stderr")
    p.add_argument("--out", help="write the result as JSON here")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--serving-concurrency", type=int, nargs="*", default=[],
                   help="then run scripts/bench_serving.py at these concurrencies (none: skip it)")
    p.add_argument("--serving-requests", type=int, default=None, help="bench_serving's --requests")
    p.add_argument("--serving-input-len", type=int, default=128)
    p.add_argument("--serving-output-len", type=int, default=64)
    p.add_argument("--serving-token-range", type=int, nargs=2, default=[1000, 30000])
    p.add_argument("--serving-out", help="bench_serving's JSON results")
    p.add_argument("engine", nargs="*", help="engine flags for the server (after --)")
    a = p.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    result: dict = dict(model=a.model, url=url, ok=False)
    with open(a.log, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "imp_jax.server", "--host", "127.0.0.1",
                                 "--port", str(port), "--model", a.model, *(a.engine or SMALL_ENGINE)],
                                stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        try:
            result["ready_s"] = wait_ready(url, proc, a.ready_timeout)
            served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            for name, ask in (("openai", ask_openai), ("anthropic", ask_anthropic)):
                t0 = time.monotonic()
                result[f"{name}_answer"] = ask(url, served)
                result[f"{name}_s"] = time.monotonic() - t0
            # non-empty, not necessarily printable: random weights answer whitespace as readily as words
            result["ok"] = bool(result["openai_answer"] and result["anthropic_answer"])
            if a.serving_concurrency:
                result["serving_ok"] = serving_benchmark(url, a)
                result["ok"] = result["ok"] and result["serving_ok"]
        except Exception as e:  # noqa: BLE001 - reported in the result
            result["error"] = f"{type(e).__name__}: {str(e)[:500]}"
        finally:
            result["exit_code"] = stop(proc)
    result["ok"] = result["ok"] and result["exit_code"] == 0
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
