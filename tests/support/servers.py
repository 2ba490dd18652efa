"""Helpers for the server tests: a live `python -m imp_jax.server`, an in-process app, and a fake engine.

FakeEngine is an Engine (runtime/api.py), standing in for the real AsyncEngine for what the real engine
cannot do on demand: fail mid-stream (a prompt holding FAULT_MARKER), stay loading, or emit tokens
slowly enough for keepalive pings. It is not a model: it "generates" a fixed script of tokens, and
emits exactly the real engine's event contract (`check_event_contract`; test_engine_contract.py runs
one suite on both engines). It does not re-implement engine features (stop strings, logprobs, KV blocks):
a request that needs them is refused, so it must be tested on the real engine (see `live_server`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from loopback import free_port, wait_for
from support.otlp_receiver import OTLPReceiver

from imp_jax.errors import InvalidRequestError
from imp_jax.model.text.tokenizer import Tokenizer
from imp_jax.runtime.api import Capabilities, Engine, not_serving
from imp_jax.runtime.request import (EngineEvent, GenerationRequest, SamplingParams, Usage,
                                     check_context)

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
FAKE_SCRIPT = "The quick brown fox jumps over the lazy dog. "
FAULT_MARKER = "FAULT"  # a prompt containing this makes FakeEngine fail after two tokens


def fake_tokenizer(fim: bool = True) -> Tokenizer:
    """A small byte-level BPE with ChatML specials (and FIM tokens unless fim=False), trained here in ms."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (
        ["<fim_prefix>", "<fim_suffix>", "<fim_middle>"] if fim else [])
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([FAKE_SCRIPT * 3, "hello world, héllo wörld 🙂 def f(x): return x"] * 5,
                            trainers.BpeTrainer(vocab_size=320, special_tokens=specials, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fim_tokens = dict(prefix="<fim_prefix>", suffix="<fim_suffix>", middle="<fim_middle>") if fim else None
    return Tokenizer(tok, bos_token=None, eos_token="<|endoftext|>", add_bos=False, add_eos=False,
                     chat_template=CHATML, fim_tokens=fim_tokens)


class FakeEngine(Engine):
    """The Engine contract (runtime/api.py) over a scripted generator; see the module docstring for why it exists."""

    POOL_BLOCKS = 64  # what stats() reports: the fake holds no KV, so its pool is always at baseline
    # no LoRA, no KV to pin for sessions; suspend is the state alone; no request of its thinks
    capabilities = Capabilities(suspend=True, end_thinking=True)
    # the protocol's state and model facts, plain attributes here (the facts set in __init__)
    state = "loading"
    error: str | None = None
    idle_suspended = False
    served_name: str = ""
    tokenizer: Any = None
    max_model_len = vocab_size = max_num_seqs = 0
    default_params: Any = None
    dtype = device = ""

    def __init__(self, tokenizer: Tokenizer, *, served_name: str = "fake-model", max_model_len: int = 256,
                 token_delay: float = 0.0, load_delay: float = 0.0):
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.max_model_len = max_model_len
        self.vocab_size = tokenizer.vocab_size
        self.default_params = SamplingParams(temperature=0.6, top_p=0.95)
        self.max_num_seqs, self.dtype, self.device = 8, "float32", "cpu"
        self.steps_failed_total = 0   # what stats() reports (EngineCore.stats: steps that raised)
        self.token_delay = token_delay
        self._load_delay = load_delay
        self._running: set[str] = set()
        self._cancelled: set[str] = set()
        self.cancelled_ids: list[str] = []
        self._script = tokenizer.encode(FAKE_SCRIPT, add_special_tokens=False)

    def start(self) -> None:
        threading.Timer(self._load_delay, self._loaded).start()

    def _loaded(self) -> None:
        self.state = "ready"

    async def wait_ready(self) -> None:
        while self.state != "ready":
            await asyncio.sleep(0.01)

    def cancel(self, request_id: str) -> None:
        self.cancelled_ids.append(request_id)
        if request_id in self._running:
            self._cancelled.add(request_id)

    async def end_thinking(self, request_id: str) -> str:
        """The fake never thinks: its running requests are not thinking ones."""
        return "not_thinking" if request_id in self._running else "unknown"

    async def suspend(self) -> dict[str, Any]:
        """Nothing to park: the state alone, as the real engine's operator suspend shows it."""
        self.state = "suspended"
        return {"status": "suspended", "freed_bytes": 0}

    def prefix_key(self, req: GenerationRequest) -> Any:
        return req.cache_salt

    def holds_block(self, block_hash: bytes) -> bool:
        """Nothing is cached (a router sees no prefix affinity)."""
        return False

    async def resume(self) -> dict[str, Any]:
        if self.state != "suspended":
            return {"status": "not_suspended"}
        self.state = "ready"
        return {"status": "resumed"}

    def stats(self) -> dict[str, Any]:
        return {"num_free_blocks": self.POOL_BLOCKS, "baseline_free_blocks": self.POOL_BLOCKS,
                "num_running": len(self._running), "num_waiting": 0, "compilations_after_warmup": 0,
                "steps_failed_total": self.steps_failed_total}

    def shutdown(self) -> None:
        self.state = "stopped"

    def generate(self, req: GenerationRequest, limits: Any = None, on_stall: Any = None) -> AsyncIterator[EngineEvent]:
        """The scripted events; the reader limits of the real engine (event_buffer.py) do not apply here."""
        if self.state != "ready":
            raise not_serving(self.state, self.error)
        return self._run(req)

    async def _run(self, req: GenerationRequest) -> AsyncIterator[EngineEvent]:
        p = req.params
        p.validate(self.vocab_size)
        if (p.stop or p.stop_token_ids or p.logprobs is not None or p.prompt_logprobs is not None
                or p.raw_logprob_ids):
            raise InvalidRequestError("FakeEngine does not do stop strings, stop tokens or logprobs: "
                                      "test them on the real engine", param="stop")
        check_context(len(req.prompt_ids), p.max_tokens, self.max_model_len, "prompt")   # the real engine's rule
        max_tokens = p.max_tokens or self.max_model_len - len(req.prompt_ids)
        fault = FAULT_MARKER in self.tokenizer.decode(req.prompt_ids)
        admitted = time.monotonic()
        counts = [0] * p.n
        live = list(range(p.n))
        self._running.add(req.request_id)

        def last(ev: EngineEvent, i: int) -> EngineEvent:
            """As the real engine's _close: the request's last open choice carries usage and done."""
            live.remove(i)
            if not live:
                ev.done, ev.usage = True, Usage(len(req.prompt_ids), sum(counts), 0)
            return ev

        try:
            for step in range(max_tokens):
                await asyncio.sleep(self.token_delay)
                if req.request_id in self._cancelled:   # as EngineCore.cancel: each open choice ends cancelled
                    for i in list(live):
                        yield last(EngineEvent(req.request_id, i, finish_reason="cancelled", admitted_at=admitted), i)
                    return
                if fault and step == 2:  # a device fault: every open choice ends with an error event
                    for i in list(live):
                        yield last(EngineEvent(req.request_id, i, finish_reason="error", error="injected fault",
                                               admitted_at=admitted), i)
                    return
                for i in list(live):
                    tok = self._script[(step + i) % len(self._script)]
                    counts[i] += 1
                    ev = EngineEvent(req.request_id, index=i, token_ids=[tok], text=self.tokenizer.decode([tok]),
                                     admitted_at=admitted)
                    if step == max_tokens - 1:
                        ev.finish_reason = "length"
                        ev = last(ev, i)
                    yield ev
        finally:
            self._running.discard(req.request_id)
            self._cancelled.discard(req.request_id)


def check_event_contract(events: list[EngineEvent], req: GenerationRequest, tokenizer: Any,
                         ending: str | None = None) -> None:
    """The engine event contract (runtime/request.py EngineEvent), as the real engine keeps it.

    Per choice: events in order, each with at most one token; the last has a finish_reason: stop or
    length, or every choice's `ending` when given (error with a message on a fault, cancelled after
    cancel(); no token then); text deltas join to the choice's text. The request's very last event,
    and only it, has done=True and usage, whose completion tokens count every choice.
    """
    assert events, "no events"
    n = req.params.n
    assert all(ev.request_id == req.request_id for ev in events)
    assert [ev.done for ev in events] == [False] * (len(events) - 1) + [True]
    assert all(ev.usage is None for ev in events[:-1]) and events[-1].usage is not None
    finished: dict[int, EngineEvent] = {}
    ids: dict[int, list[int]] = {i: [] for i in range(n)}
    texts: dict[int, str] = {i: "" for i in range(n)}
    for ev in events:
        assert 0 <= ev.index < n and ev.index not in finished, f"event after choice {ev.index} finished"
        assert len(ev.token_ids) <= 1 and ev.admitted_at is not None
        ids[ev.index] += ev.token_ids
        texts[ev.index] += ev.text
        if ev.finish_reason is not None:
            finished[ev.index] = ev
    tokens = {i: len(v) for i, v in ids.items()}
    assert sorted(finished) == list(range(n)), f"choices without a finish: {sorted(finished)} of {n}"
    for ev in finished.values():
        if ending is not None:
            assert ev.finish_reason == ending and not ev.token_ids, (ev.finish_reason, ending)
            assert bool(ev.error) == (ending == "error")
        else:
            assert ev.finish_reason in ("stop", "length") and ev.error is None
            if ev.finish_reason == "length" and not req.params.stop:  # nothing held back or cut: all the text
                assert texts[ev.index] == tokenizer.decode(ids[ev.index]), (texts[ev.index], ids[ev.index])
    usage = events[-1].usage
    assert usage.prompt_tokens == len(req.prompt_ids) and usage.completion_tokens == sum(tokens.values())
    if ending is None and req.params.max_tokens:
        assert all(0 < t <= req.params.max_tokens for t in tokens.values())


def protocol_members(protocol: type) -> set[str]:
    """The names a Protocol (runtime/api.py) declares: its annotated attributes and its public methods."""
    names = set(protocol.__dict__.get("__annotations__", {}))
    return names | {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}


@contextlib.contextmanager
def app_in_thread(app: Any) -> Iterator[str]:
    """Serve a Quart app with hypercorn on a loopback port in a background thread; yields its base URL."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    port = free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 1
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    thread = threading.Thread(target=loop.run_until_complete,
                              args=(serve(app, config, shutdown_trigger=stop.wait),), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/health", 200, timeout=30)
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(timeout=10)


class LiveServer:
    """A `python -m imp_jax.server` subprocess on a loopback port, with its log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "imp_jax.server", "--host", "127.0.0.1", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int | None = None, timeout: float = 30) -> int:
        """Signal the server (SIGTERM by default) and wait; kills it if it does not exit."""
        import signal
        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


# --------------------------------------------------------------------------- shared fixtures
MODEL = "smollm2-135m-instruct"
# Small sizing (12 step programs), kept identical across runs so warm-up hits the persistent
# compilation cache; 16 concurrent clients still work, the surplus waits a step or two.
REAL_ENGINE_ARGS = ["--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--max-model-len", "1024",
                    "--num-kv-blocks", "256"]
READY_TIMEOUT_S = float(os.environ.get("IMP_JAX_TEST_READY_TIMEOUT", "1200"))  # a cold compile cache is slow
_live: dict[str, Any] = {}


def start_live_server(log_dir: Path) -> LiveServer:
    """The session's one real server (SmolLM2), started on first use; records what it answered while loading."""
    if "error" in _live:
        raise RuntimeError(f"the live server failed to start: {_live['error']}")
    if "server" in _live:
        return _live["server"]
    live = LiveServer([*REAL_ENGINE_ARGS, "--model", MODEL], log_dir / "server.log")
    _live["server"] = live
    try:
        wait_for(live.url + "/health", 200, timeout=60, proc=live.proc)
        live.early_health = httpx.get(live.url + "/health").json()
        early_ready = httpx.get(live.url + "/ready")
        live.early_ready = (early_ready.status_code, early_ready.json())
        wait_for(live.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=live.proc)
    except Exception as e:
        _live["error"] = f"{e}; log {live.log_path}:\n{live.log_text()[-3000:]}"
        raise RuntimeError(_live["error"]) from e
    return live


def stop_live_server() -> int | None:
    """SIGTERM the session's server once; its exit status (None when it was never started)."""
    live = _live.pop("server", None)
    if live is None:
        return None
    _live["returncode"] = live.stop()
    return _live["returncode"]


def engine_stats(url: str, key: str | None = None) -> dict[str, Any]:
    """/health's counters: a keyed server shows them to key holders only, so a key goes along (default the
    ops server's; a server without keys ignores it)."""
    return httpx.get(url + "/health", headers={"Authorization": f"Bearer {key or OPS_KEY}"}).json()


def probe_health(url: str, stop: threading.Event, latencies: list[float], every_s: float = 0.02) -> None:
    """GET /health every `every_s` until `stop` is set, appending each answer's latency (a thread's target:
    tests that one request cannot stall the event loop)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(every_s)


def wait_idle(url: str, timeout: float = 60, key: str | None = None) -> dict[str, Any]:
    """Poll /health until nothing runs or waits and the KV pool is back at its baseline."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(url, key)
        if (stats.get("num_running") == 0 and stats.get("num_waiting") == 0
                and stats.get("num_free_blocks") == stats.get("baseline_free_blocks")):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle after {timeout}s: {stats}")
        time.sleep(0.1)


def parse_sse(raw: str) -> list[tuple[str | None, str]]:
    """SSE text as (event, data) pairs, checking every frame is well formed."""
    frames = []
    assert raw.endswith("\n\n"), f"stream does not end with a complete frame: {raw[-80:]!r}"
    for block in raw.split("\n\n")[:-1]:
        event, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
            else:
                assert line.startswith(":"), f"malformed SSE line {line!r}"
        frames.append((event, "\n".join(data)))
    return frames


@pytest.fixture(scope="session")
def live_server(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real server on SmolLM2, one per session (test modules share it); SIGTERM must end it with 0."""
    yield start_live_server(tmp_path_factory.mktemp("live_server"))
    code = stop_live_server()
    assert code in (None, 0), f"the server exited with {code} on SIGTERM"


def openai_for(url: str) -> Any:
    """The official openai client on a server at `url` (no retries: a failure shows as it is)."""
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def anthropic_for(url: str) -> Any:
    """The official anthropic client on a server at `url` (no retries)."""
    import anthropic
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def openai_client(live_server: LiveServer) -> Any:
    return openai_for(live_server.url)


@pytest.fixture(scope="session")
def fake_server() -> Iterator[tuple[str, FakeEngine]]:
    """The app over a FakeEngine (tokens every 10 ms) on a loopback port: for faults and driver checks."""
    from imp_jax.server.app import create_app
    from imp_jax.server.config import ServerConfig

    engine = FakeEngine(fake_tokenizer(), token_delay=0.01)
    engine.start()
    with app_in_thread(create_app(engine, ServerConfig(client_priority=True))) as url:
        wait_for(url + "/ready", 200, timeout=30)
        yield url, engine


# --------------------------------------------------------------------------- the operations server
OPS_KEY = "key-main"                    # --api-key (granted 'inference' only)
OPS_ADMIN_KEY = "key-admin"             # --admin-key
OPS_FILE_KEYS = ("key-file", "key-rate")  # --api-key-file; key-rate is spent by the rate-limit test alone
OPS_FILE_GRANTS = {"key-file": "pins priority"}   # granted in the key file; --api-key OPS_KEY has none
OPS_RATE_LIMIT = 120                    # requests per minute per key
OPS_TIMEOUT_S = 8.0                     # --request-timeout
OPS_STALL_S = 1.5                       # --stream-stall-timeout
OPS_MAX_TOKENS = 5                      # --max-tokens (the default of requests that set none)
OPS_MAX_BYTES = 100_000                 # --max-request-bytes
OPS_MAX_QUEUED = 3                      # --max-queued-requests
OPS_MAX_QUEUED_TOKENS = 1500            # --max-queued-tokens
OPS_ORIGIN = "http://ui.example"        # --cors-origins


@dataclasses.dataclass
class OpsServer:
    """The real server with every operations flag set, its OTLP receiver and its request log."""

    live: LiveServer
    receiver: OTLPReceiver
    request_log: Path
    first_metrics: str   # /metrics before any generation request

    @property
    def url(self) -> str:
        return self.live.url

    @staticmethod
    def auth(key: str = OPS_KEY) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def metrics(self) -> str:
        r = httpx.get(self.url + "/metrics", headers=self.auth(), timeout=30)
        assert r.status_code == 200, r.text
        return r.text

    def log_lines(self) -> list[dict[str, Any]]:
        import json
        return [json.loads(line) for line in self.request_log.read_text().splitlines()]


@pytest.fixture(scope="session")
def ops_server(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpsServer]:
    """One real server (SmolLM2, the shared sizing: its programs come from the compile cache) for the
    metrics, tracing, access and limits tests; SIGTERM must end it with 0."""
    tmp = tmp_path_factory.mktemp("ops_server")
    (tmp / "keys.txt").write_text("# test keys\n" + "".join(f"{k} {OPS_FILE_GRANTS.get(k, '')}  # grants\n"
                                                             for k in OPS_FILE_KEYS))
    receiver = OTLPReceiver()
    args = [*REAL_ENGINE_ARGS, "--model", MODEL, "--api-key", OPS_KEY, "--admin-key", OPS_ADMIN_KEY, "--api-key-file", str(tmp / "keys.txt"),
            "--rate-limit", str(OPS_RATE_LIMIT), "--request-timeout", str(OPS_TIMEOUT_S),
            "--stream-buffer-events", "8", "--stream-stall-timeout", str(OPS_STALL_S),
            "--max-tokens", str(OPS_MAX_TOKENS), "--max-request-bytes", str(OPS_MAX_BYTES),
            "--max-queued-requests", str(OPS_MAX_QUEUED), "--max-queued-tokens", str(OPS_MAX_QUEUED_TOKENS),
            "--log-requests", str(tmp / "requests.jsonl"), "--otlp-endpoint", receiver.url,
            "--otlp-service-name", "imp-test", "--cors-origins", OPS_ORIGIN,
            "--auth-failures-per-minute", "0"]   # the key tests send ~40 wrong keys from loopback (see test_tenants)
    live = LiveServer(args, tmp / "server.log")
    ops = OpsServer(live, receiver, tmp / "requests.jsonl", first_metrics="")
    try:
        wait_for(live.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=live.proc)
        ops.first_metrics = httpx.get(live.url + "/metrics", headers=OpsServer.auth(), timeout=30).text
        yield ops
        code = live.stop()
        assert code == 0, f"the server exited with {code} on SIGTERM; log:\n{live.log_text()[-3000:]}"
    finally:
        live.stop()
        ops.receiver.stop()  # the tracing tests may have swapped in a new receiver on the same port


# --------------------------------------------------------------------------- the exact server
@pytest.fixture(scope="session")
def exact_server(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real server (the shared sizing) with `--gemm exact`, for tests that compare its numbers with
    transformers' or with another layout of the same arithmetic (tensor parallel, multi-host): the default
    runs this Q4_1 GGUF on int8 activations, whose rounding turns any difference in a row's bits (a sum
    split over devices) into visibly different logits. SIGTERM must end it with 0."""
    yield from _session_server([*REAL_ENGINE_ARGS, "--model", MODEL, "--gemm", "exact"],
                               tmp_path_factory.mktemp("exact_server"))


def _session_server(args: list[str], tmp: Path) -> Iterator[LiveServer]:
    """A session fixture's real server on `args`, ready; SIGTERM must end it with 0."""
    live = LiveServer(args, tmp / "server.log")
    try:
        wait_for(live.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=live.proc)
        yield live
        code = live.stop()
        assert code == 0, f"the server exited with {code} on SIGTERM; log:\n{live.log_text()[-3000:]}"
    finally:
        live.stop()


# --------------------------------------------------------------------------- the reliability server
RELIABILITY_MAX_TOKENS = 8       # --max-tokens: a fuzzed body that drops max_tokens stays short
RELIABILITY_TIMEOUT_S = 10.0     # --request-timeout: so does one that asks for many tokens


@pytest.fixture(scope="session")
def reliability_server(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The real server (the shared sizing) for the fuzz and soak tests: short default answers, a request
    timeout and a small responses store, so hostile traffic stays cheap; SIGTERM must end it with 0."""
    tmp = tmp_path_factory.mktemp("reliability_server")
    args = [*REAL_ENGINE_ARGS, "--model", MODEL, "--max-tokens", str(RELIABILITY_MAX_TOKENS),
            "--request-timeout", str(RELIABILITY_TIMEOUT_S), "--responses-store-max-bytes", "1000000"]
    yield from _session_server(args, tmp)
