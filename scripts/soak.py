"""Soak: mixed, hostile traffic against an imp_jax server on this machine, then checks that nothing broke.

    python scripts/soak.py --duration 600                      # starts its own server (SmolLM2)
    python scripts/soak.py --url http://127.0.0.1:8080 --pid 1234 --duration 60

Traffic, from --concurrency clients plus one prober, for --warmup then --duration seconds (and at most
--max-requests): the three dialects on every route (chat and completions, Messages and count_tokens,
Responses with store, GET and previous_response_id, tokenize and detokenize), streamed and not, with
n > 1, stop strings, logprobs and echo; clients that disconnect mid-stream or before a whole answer
(cancellations); slow readers; invalid bodies and oversized prompts; /health, /ready, /metrics,
/v1/models, /props and /info alongside. It fails (exit 1) unless, at the end: no 5xx, no hung or
malformed stream, every valid request got a complete answer, the KV pool is back at its baseline
and nothing runs, no compilation happened after warm-up, and the server's resident memory grew
less than --max-rss-growth (5%) from the end of warm-up. Loopback addresses only.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

LOOPBACK = ("127.", "localhost", "::1", "[::1]")
WORDS = ("river stone lamp harbour winter orange quiet engine letter garden silver number paper cloud "
         "bridge candle forest violin market signal window planet circle mirror ladder").split()
STREAM_ENDS = {"messages": ("message_stop",), "responses": ("response.completed", "response.incomplete")}
GENERATION_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"]
HARD_TIMEOUT_S = 120.0  # a request with no answer by then is hung


@dataclass
class Tally:
    """What the soak saw; `problems` holds every failure found, each with its evidence."""

    counts: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    stored: list[str] = field(default_factory=list)  # ids of stored responses

    def problem(self, text: str) -> None:
        if len(self.problems) < 200:
            self.problems.append(text)
        self.counts["problems"] += 1


def parse_sse(raw: str) -> list[tuple[str | None, str]]:
    """SSE text as (event, data) frames; raises ValueError on anything malformed or cut short."""
    if not raw.endswith("\n\n"):
        raise ValueError(f"stream does not end with a complete frame: {raw[-80:]!r}")
    frames = []
    for block in raw.split("\n\n")[:-1]:
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line.startswith(":"):
                raise ValueError(f"malformed SSE line {line!r}")
        frames.append((event, "\n".join(data)))
    if not frames:
        raise ValueError("empty stream")
    return frames


def check_stream(dialect: str, raw: str) -> str:
    """The finish reason of a whole, well-formed stream; raises ValueError otherwise."""
    frames = parse_sse(raw)
    finish = None
    for event, data in frames:
        if event in ("error", "response.failed"):
            raise ValueError(f"error event: {data[:200]}")
        if data == "[DONE]":
            continue
        msg = json.loads(data)
        if msg.get("error"):
            raise ValueError(f"error frame: {data[:200]}")
        for c in msg.get("choices") or []:
            finish = c.get("finish_reason") or finish
        if event == "message_delta":
            finish = msg["delta"].get("stop_reason") or finish
        if event in ("response.completed", "response.incomplete"):
            finish = msg["response"]["status"]
            if msg["response"].get("store"):
                return f"stored:{msg['response']['id']}"
    last_event, last_data = frames[-1]
    if dialect in STREAM_ENDS:
        if last_event not in STREAM_ENDS[dialect]:
            raise ValueError(f"stream ends with {last_event}")
    elif last_data != "[DONE]":
        raise ValueError(f"stream ends with {last_data[:80]!r}")
    if finish is None:
        raise ValueError("no finish reason in the stream")
    return str(finish)


def check_json_answer(dialect: str, body: dict[str, Any]) -> str:
    """The finish reason of a whole JSON answer; raises ValueError when it is not one."""
    if dialect == "messages":
        if body.get("type") != "message" or not body.get("stop_reason"):
            raise ValueError(f"not a finished message: {str(body)[:200]}")
        return body["stop_reason"]
    if dialect == "responses":
        if body.get("status") not in ("completed", "incomplete") or not body.get("output"):
            raise ValueError(f"not a finished response: {str(body)[:200]}")
        return "stored:" + body["id"] if body.get("store") else body["status"]
    choices = body.get("choices") or []
    if not choices or any(not c.get("finish_reason") for c in choices):
        raise ValueError(f"choices without a finish reason: {str(body)[:200]}")
    return choices[0]["finish_reason"]


class Soak:
    def __init__(self, url: str, model: str, max_model_len: int, args: argparse.Namespace, pid: int | None = None):
        self.url, self.model, self.max_model_len, self.args, self.pid = url, model, max_model_len, args, pid
        self.rss_samples: list[tuple[float, float, int]] = []  # (seconds into the phase, MiB, requests sent)
        self.tally = Tally()
        self.rng = random.Random(args.seed)
        self.sent = 0

    # ------------------------------------------------------------------ request makers
    def text(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def knobs(self, openai: bool = True) -> dict[str, Any]:
        r = self.rng
        k: dict[str, Any] = {"max_tokens": r.randint(1, 12)}
        if r.random() < 0.5:
            k["temperature"] = r.choice([0.0, 0.7, 1.0])
        if r.random() < 0.3:
            k["stop" if openai else "stop_sequences"] = [r.choice(["the", "e", ".", "\n", "ing"])]
        if openai and r.random() < 0.25:
            k["n"] = r.randint(2, 3)
            k["seed"] = r.randint(0, 1000)
        if r.random() < 0.2:
            k["ignore_eos"] = True
        return k

    def valid(self) -> tuple[str, str, dict[str, Any], bool]:
        """(dialect, path, body, stream) of one valid generation or counting request."""
        r, stream = self.rng, self.rng.random() < 0.6
        kind = r.choice(["chat", "chat", "completions", "messages", "messages", "responses", "responses",
                         "count_tokens", "tokenize", "detokenize"])
        if kind == "chat":
            body = {"model": self.model, "messages": [{"role": "system", "content": self.text(4)},
                                                       {"role": "user", "content": self.text(r.randint(3, 40))}],
                    **self.knobs()}
            if r.random() < 0.2:
                body["logprobs"], body["top_logprobs"] = True, r.randint(0, 3)
            if stream and r.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            return "chat", "/v1/chat/completions", {**body, "stream": stream}, stream
        if kind == "completions":
            prompt: Any = self.text(r.randint(3, 60)) if r.random() < 0.7 else [r.randint(100, 20000) for _ in range(20)]
            body = {"model": self.model, "prompt": prompt, **self.knobs()}
            if not stream and r.random() < 0.2:
                body["echo"], body["logprobs"] = True, 2
            return "completions", "/v1/completions", {**body, "stream": stream}, stream
        if kind in ("messages", "count_tokens"):
            body = {"model": self.model, "messages": [{"role": "user", "content": self.text(r.randint(3, 40))}]}
            if r.random() < 0.3:
                body["system"] = self.text(5)
            if kind == "count_tokens":
                return "count", "/v1/messages/count_tokens", body, False
            return "messages", "/v1/messages", {**body, **self.knobs(openai=False), "stream": stream}, stream
        if kind == "responses":
            body = {"model": self.model, "input": self.text(r.randint(3, 30)), "max_output_tokens": r.randint(1, 12),
                    "store": r.random() < 0.3, "stream": stream}
            if self.tally.stored and r.random() < 0.3:
                body["previous_response_id"] = r.choice(self.tally.stored[-20:])
            return "responses", "/v1/responses", body, stream
        if kind == "tokenize":
            return "tokens", "/tokenize", {"content": self.text(r.randint(1, 30))}, False
        return "tokens", "/detokenize", {"tokens": [r.randint(0, 40000) for _ in range(r.randint(1, 20))]}, False

    def invalid(self) -> tuple[str, bytes]:
        """(path, raw body) of a request that must be refused with a 4xx."""
        r = self.rng
        path = r.choice(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses", "/tokenize",
                         "/v1/messages/count_tokens"])
        base: dict[str, Any] = {"model": self.model, "messages": [{"role": "user", "content": "hi"}],
                                "prompt": "hi", "input": "hi", "content": "hi", "max_tokens": 4}
        choice = r.randrange(9)
        if choice in (1, 2, 5, 8):  # fields only the generation routes read
            path = r.choice(GENERATION_PATHS + (["/v1/messages/count_tokens"] if choice == 5 else []))
        if choice == 0:
            return path, r.choice([b"{", b"", b"[1,2]", b"\xff\xfe", b'{"model": ', b"null"])
        if choice == 1:
            base["max_tokens"] = base["max_output_tokens"] = r.choice([-1, 0, "ten", 1.5, [4]])
        elif choice == 2:
            base["temperature"] = r.choice([-1, "hot", [1]])
            base["max_tokens"] = "x"
        elif choice == 3:
            base["messages"], base["prompt"], base["input"], base["content"] = 7, {}, 7, 7
        elif choice == 4:  # an oversized prompt: past the context, a 400 naming it
            big = self.text(self.max_model_len + 50)
            base["messages"], base["prompt"], base["input"], base["content"] = (
                [{"role": "user", "content": big}], big, big, None)
            path = r.choice(GENERATION_PATHS)
        elif choice == 5:
            base["model"] = "no-such-model"
            base["content"] = None
        elif choice == 6:
            return path, b'{"model": "%s", "prompt": "\\ud800", "input": "\\udfff", "content": "\\ud801", ' \
                         b'"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}' % self.model.encode()
        elif choice == 7:
            return path, b'{"a": ' + b"[" * 3000 + b"]" * 3000 + b"}"
        else:
            base["top_p"] = r.choice(["high", -1, 7, None, [0.5]]) or {"p": 1}
        return path, json.dumps(base).encode()

    # ------------------------------------------------------------------ clients
    async def send_valid(self, client: httpx.AsyncClient, behaviour: str) -> None:
        dialect, path, body, stream = self.valid()
        self.tally.counts[f"{behaviour}:{dialect}{':stream' if stream else ''}"] += 1
        what = f"{behaviour} {path} {json.dumps(body)[:160]}"
        try:
            if stream:
                await self.stream(client, dialect, path, body, behaviour, what)
            elif behaviour == "disconnect":  # a whole answer the client stops waiting for: a cancellation
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(client.post(self.url + path, json=body), self.rng.uniform(0.01, 0.5))
            else:
                resp = await asyncio.wait_for(client.post(self.url + path, json=body), HARD_TIMEOUT_S)
                self.tally.statuses[resp.status_code] += 1
                if self.previous_gone(body, resp.status_code, resp.text):
                    return
                if resp.status_code != 200:
                    self.tally.problem(f"{resp.status_code} for a valid request: {what}: {resp.text[:200]}")
                elif dialect in ("chat", "completions", "messages", "responses"):
                    self.record_finish(check_json_answer(dialect, resp.json()))
        except asyncio.TimeoutError:
            self.tally.problem(f"hung: no answer in {HARD_TIMEOUT_S} s: {what}")
        except (ValueError, KeyError, TypeError) as e:
            self.tally.problem(f"malformed answer ({e}): {what}")
        except httpx.HTTPError as e:
            self.tally.problem(f"transport error {type(e).__name__}: {e}: {what}")

    async def stream(self, client: httpx.AsyncClient, dialect: str, path: str, body: dict[str, Any],
                     behaviour: str, what: str) -> None:
        deadline = time.monotonic() + HARD_TIMEOUT_S
        async with client.stream("POST", self.url + path, json=body) as resp:
            self.tally.statuses[resp.status_code] += 1
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                if not self.previous_gone(body, resp.status_code, text):
                    self.tally.problem(f"{resp.status_code} for a valid stream: {what}: {text[:200]}")
                return
            chunks: list[str] = []
            cut = self.rng.randint(0, 3) if behaviour == "disconnect" else None
            async for piece in resp.aiter_text():
                chunks.append(piece)
                if cut is not None and len(chunks) > cut:
                    return  # leave mid-stream: closing the response drops the connection
                if behaviour == "slow":
                    await asyncio.sleep(self.rng.uniform(0.05, 0.3))
                if time.monotonic() > deadline:
                    self.tally.problem(f"hung stream: still open after {HARD_TIMEOUT_S} s: {what}")
                    return
        if cut is None:
            self.record_finish(check_stream(dialect, "".join(chunks)))

    def previous_gone(self, body: dict[str, Any], status: int, text: str) -> bool:
        """A 404 for a previous_response_id the store evicted (its byte cap) or another client deleted."""
        gone = status == 404 and "previous_response_id" in body and "response_not_found" in text
        if gone:
            self.tally.counts["previous_response_gone"] += 1
        return gone

    def record_finish(self, finish: str) -> None:
        if finish.startswith("stored:"):
            self.tally.stored.append(finish[7:])
            finish = "stored"
        self.tally.counts[f"finish:{finish}"] += 1

    async def send_invalid(self, client: httpx.AsyncClient) -> None:
        path, raw = self.invalid()
        self.tally.counts["invalid"] += 1
        try:
            resp = await asyncio.wait_for(client.post(self.url + path, content=raw,
                                                      headers={"Content-Type": "application/json"}), HARD_TIMEOUT_S)
        except asyncio.TimeoutError:
            self.tally.problem(f"hung on an invalid body to {path}: {raw[:120]!r}")
            return
        except httpx.HTTPError as e:
            self.tally.problem(f"transport error on an invalid body to {path}: {e}")
            return
        self.tally.statuses[resp.status_code] += 1
        if not 400 <= resp.status_code < 500:
            self.tally.problem(f"{resp.status_code} for an invalid body to {path}: {raw[:120]!r}: {resp.text[:200]}")
            return
        try:
            err = resp.json()["error"]
            assert isinstance(err["message"], str) and isinstance(err["type"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            self.tally.problem(f"malformed error envelope from {path}: {resp.text[:200]}")

    async def send_stored(self, client: httpx.AsyncClient) -> None:
        """GET (or now and then DELETE) a stored response; it may be gone (evicted, deleted): 404 is fine."""
        if not self.tally.stored:
            return
        rid = self.rng.choice(self.tally.stored[-50:])
        method = "DELETE" if self.rng.random() < 0.2 else "GET"
        resp = await client.request(method, f"{self.url}/v1/responses/{rid}")
        self.tally.statuses[resp.status_code] += 1
        self.tally.counts[f"{method.lower()}_response"] += 1
        if resp.status_code not in (200, 404):
            self.tally.problem(f"{method} /v1/responses/{rid}: {resp.status_code} {resp.text[:200]}")
        elif method == "DELETE" and rid in self.tally.stored:
            self.tally.stored.remove(rid)

    async def client(self, stop_at: float) -> None:
        limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
        async with httpx.AsyncClient(timeout=HARD_TIMEOUT_S, limits=limits) as client:
            while time.monotonic() < stop_at and self.sent < self.args.max_requests:
                self.sent += 1
                roll = self.rng.random()
                if roll < 0.55:
                    await self.send_valid(client, "normal")
                elif roll < 0.70:
                    await self.send_valid(client, "disconnect")
                elif roll < 0.78:
                    await self.send_valid(client, "slow")
                elif roll < 0.95:
                    await self.send_invalid(client)
                else:
                    await self.send_stored(client)

    async def prober(self, stop_at: float) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            while time.monotonic() < stop_at:
                path = self.rng.choice(["/health", "/ready", "/metrics", "/v1/models", "/props", "/info",
                                        f"/v1/models/{self.model}"])
                try:
                    resp = await client.get(self.url + path)
                except httpx.HTTPError as e:
                    self.tally.problem(f"probe {path}: transport error {e}")
                    continue
                self.tally.counts["probe"] += 1
                self.tally.statuses[resp.status_code] += 1
                if resp.status_code != 200:
                    self.tally.problem(f"probe {path}: {resp.status_code} {resp.text[:200]}")
                await asyncio.sleep(self.rng.uniform(0.05, 0.3))

    async def sample_rss(self, stop_at: float) -> None:
        """Resident memory every --rss-every seconds: a leak grows on, a warming allocator levels off."""
        t0 = time.monotonic()
        while self.pid and time.monotonic() < stop_at:
            self.rss_samples.append((round(time.monotonic() - t0, 1), round(rss_bytes(self.pid) / 2**20, 1),
                                     self.sent))
            await asyncio.sleep(self.args.rss_every)

    async def prime(self) -> None:
        """One request of each costly kind before the warm-up's random mix, so first-use allocations
        (the prompt-scoring program behind echo + logprobs holds ~55 MiB after its first run) all
        happen before the resident-memory baseline."""
        m, text = self.model, self.text(60)
        chat = {"model": m, "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        bodies = [("/v1/chat/completions", {**chat, "n": 3, "logprobs": True, "top_logprobs": 3, "temperature": 1.0}),
                  ("/v1/chat/completions", {**chat, "stream": True, "stream_options": {"include_usage": True}}),
                  ("/v1/completions", {"model": m, "prompt": text, "max_tokens": 4, "echo": True, "logprobs": 2}),
                  ("/v1/completions", {"model": m, "prompt": [101, 102, 103], "max_tokens": 4, "stream": True}),
                  ("/v1/messages", {**chat, "system": "be brief", "stream": True}),
                  ("/v1/responses", {"model": m, "input": text, "max_output_tokens": 4, "store": True}),
                  ("/v1/messages/count_tokens", {"model": m, "messages": chat["messages"]}),
                  ("/tokenize", {"content": text}), ("/detokenize", {"tokens": [101, 102]})]
        async with httpx.AsyncClient(timeout=HARD_TIMEOUT_S) as client:
            for path, body in bodies:
                resp = await client.post(self.url + path, json=body)
                self.tally.statuses[resp.status_code] += 1
                self.tally.counts["prime"] += 1
                if resp.status_code != 200:
                    self.tally.problem(f"{resp.status_code} for a valid request: {path} {json.dumps(body)[:120]}: "
                                       f"{resp.text[:200]}")

    async def phase(self, seconds: float) -> None:
        stop_at = time.monotonic() + seconds
        await asyncio.gather(self.prober(stop_at), self.sample_rss(stop_at),
                             *(self.client(stop_at) for _ in range(self.args.concurrency)))


# ---------------------------------------------------------------------- the server and its state
def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def health(url: str) -> dict[str, Any]:
    return httpx.get(url + "/health", timeout=30).json()


def wait_idle(url: str, timeout: float) -> dict[str, Any]:
    """/health once nothing runs or waits and the pool is at its baseline; the last reading on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(url)
        if h.get("num_running") == 0 and h.get("num_waiting") == 0 and h["num_free_blocks"] == h["baseline_free_blocks"]:
            return h
        if time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "imp_jax.server", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
           *args.server_args.split()]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}; see {log_path}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return proc, url
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not ready in {args.ready_timeout} s; see {log_path}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    proc = None
    log_path = Path(args.server_log) if args.server_log else None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
        host = urlparse(url).hostname or ""
        if not host.startswith(LOOPBACK) and host not in ("localhost", "::1"):
            raise SystemExit(f"refusing {url}: the soak sends traffic to loopback addresses only")
    else:
        log_path = log_path or Path("soak_server.log")
        proc, url = start_server(args, log_path)
        pid = proc.pid
    log_start = log_path.stat().st_size if log_path and log_path.exists() else 0
    try:
        card = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]
        soak = Soak(url, card["id"], card["max_model_len"], args, pid)
        t0 = time.monotonic()
        asyncio.run(soak.prime())
        asyncio.run(soak.phase(args.warmup))  # first-use allocations and any lazy paths happen here
        warm = wait_idle(url, args.idle_timeout)
        rss0 = rss_bytes(pid) if pid else None
        compiles0 = warm.get("compilations_after_warmup", 0)
        sent_warm = soak.sent
        soak.rss_samples = []
        asyncio.run(soak.phase(args.duration))
        end = wait_idle(url, args.idle_timeout)
        rss1 = rss_bytes(pid) if pid else None
        t = soak.tally
        if end.get("num_running") or end.get("num_waiting"):
            t.problem(f"requests still in the engine {args.idle_timeout} s after the load stopped: {end}")
        if end["num_free_blocks"] != end["baseline_free_blocks"]:
            t.problem(f"KV pool not back at its baseline: {end['num_free_blocks']} free of "
                      f"{end['baseline_free_blocks']}")
        if end.get("compilations_after_warmup", 0) != compiles0 or compiles0:
            t.problem(f"compilations after warm-up: {compiles0} then {end.get('compilations_after_warmup')}")
        growth = None
        if rss0 is not None:
            growth = rss1 / rss0 - 1
            if growth >= args.max_rss_growth:
                t.problem(f"resident memory grew {growth:.1%} ({rss0 >> 20} -> {rss1 >> 20} MiB)")
        elif not args.no_rss:
            t.problem("no --pid: the resident-memory check cannot run (pass --no-rss to skip it)")
        if log_path is not None:  # errors the client could not see (it had gone): the server logs them
            with open(log_path, "rb") as f:
                f.seek(log_start)
                lines = f.read().decode(errors="replace").splitlines()
            logged = [ln for ln in lines if " ERROR " in ln or ln.startswith("Traceback")]
            if logged:
                t.problem(f"{len(logged)} error lines in the server log, e.g. {logged[:3]}")
            # no client here pauses anywhere near --stream-stall-timeout: any such drop is a false one
            stalls = [ln for ln in lines if "the client read nothing" in ln]
            if stalls:
                t.problem(f"{len(stalls)} streams dropped as stalled though no client paused that long, "
                          f"e.g. {stalls[:2]}")
        server_errors = sum(n for s, n in t.statuses.items() if s >= 500)
        if server_errors:
            t.problem(f"{server_errors} answers were 5xx")
        summary = {
            "ok": not t.problems, "url": url, "seconds": time.monotonic() - t0, "requests": soak.sent,
            "requests_after_warmup": soak.sent - sent_warm, "statuses": dict(sorted(t.statuses.items())),
            "counts": dict(sorted(t.counts.items())), "rss_mib": [None if v is None else v / 2**20 for v in (rss0, rss1)],
            "rss_growth": growth, "rss_samples": soak.rss_samples, "compilations_after_warmup": end.get("compilations_after_warmup"),
            "kv_free_blocks": [end["num_free_blocks"], end["baseline_free_blocks"]], "problems": t.problems,
        }
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = "killed"
            if code != 0:
                print(f"# the server exited with {code} on SIGTERM", file=sys.stderr)
    if proc is not None and code != 0:
        summary["ok"] = False
        summary["problems"].append(f"the server exited with {code} on SIGTERM")
    return summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/soak.py", description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (loopback); default: start one with --model")
    ap.add_argument("--pid", type=int, help="the server's process id, for the resident-memory check (with --url)")
    ap.add_argument("--no-rss", action="store_true", help="skip the resident-memory check")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--server-args", default="--max-num-seqs 8 --max-num-batched-tokens 64 --max-model-len 1024 "
                    "--num-kv-blocks 256 --request-timeout 30 --max-tokens 16 --responses-store-max-bytes 1000000",
                    help="flags of the server this script starts")
    ap.add_argument("--server-log", default=None, help="the server's log: where a started server writes "
                    "(default soak_server.log); with --url, read for ERROR lines written during the soak")
    ap.add_argument("--ready-timeout", type=float, default=1200)
    ap.add_argument("--duration", type=float, default=600, help="seconds of load after warm-up")
    ap.add_argument("--warmup", type=float, default=60, help="seconds of the same load before the baselines")
    ap.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests in all")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--idle-timeout", type=float, default=90, help="seconds the engine has to drain at the end")
    ap.add_argument("--max-rss-growth", type=float, default=0.05)
    ap.add_argument("--rss-every", type=float, default=10, help="seconds between resident-memory samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="summary JSON file")
    args = ap.parse_args(argv)
    summary = run(args)
    text = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
