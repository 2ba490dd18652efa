"""The server-engine contract: what the server may ask of a generation engine and of an encoder engine.

AsyncEngine, EngineReplicas (data parallel), the server's NoModel slot and the tests' FakeEngine all
subclass `Engine` explicitly (so the abstract methods are enforced, and nothing probes a loading engine's
model facts, which raise); the server reads `engine.capabilities` instead of probing for methods. An
engine without a capability keeps the method, which answers 400 `not_supported` (the defaults below).
No jax here: the server imports this module.
"""
from __future__ import annotations

import abc
import dataclasses
from typing import Any, AsyncIterator, Callable, Protocol

from imp_jax.errors import EngineError, InvalidRequestError
from imp_jax.runtime.replies.harmony import ReplyMarkers, reply_markers
from imp_jax.runtime.request import EngineEvent, GenerationRequest, ImageInput, StreamLimits

# loading -> warming_up -> ready <-> suspended; any -> faulted | stopped. no_model: a --models-dir slot.
ENGINE_STATES = ("no_model", "loading", "warming_up", "ready", "suspended", "faulted", "stopped")


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """The optional features an engine offers, fixed when it is made (before its model loads)."""

    lora: bool = False           # load_lora / unload_lora / lora_adapters (LoRA slots: --max-loras)
    sessions: bool = False       # close_session releases a session's pinned KV blocks
    suspend: bool = False        # suspend / resume park and restore the weights and KV cache
    end_thinking: bool = False   # end_thinking closes a running request's think block
    replicas: bool = False       # data parallel: replica_states lists each replica's state


def not_supported(feature: str) -> InvalidRequestError:
    """The 400 an engine answers for a capability it does not have."""
    return InvalidRequestError(f"this engine does not support {feature}", code="not_supported")


def not_serving(state: str, error: str | None, what: str = "engine") -> EngineError:
    """The 503 a request gets from an engine in `state` (not ready): loading, suspended or its error."""
    code = {"loading": "loading", "warming_up": "loading", "suspended": "suspended", "no_model": "no_model",
            "stopped": "engine_stopped"}.get(state, "engine_error")
    return EngineError(f"{what} is {state}" + (f": {error}" if error else ""), code=code, status=503)


class Engine(Protocol):
    """A generation engine as the server sees it. Model facts raise a 503 EngineError while it loads."""

    capabilities: Capabilities

    # its state, read-only to the server (an engine keeps them as attributes; replicas derive them)
    @property
    @abc.abstractmethod
    def state(self) -> str:
        """One of ENGINE_STATES."""

    @property
    @abc.abstractmethod
    def error(self) -> str | None:
        """Why it faulted (internal text: the server shows a public message)."""

    @property
    @abc.abstractmethod
    def idle_suspended(self) -> bool:
        """Parked for idleness: still "ready", the next request resumes it."""

    # model facts, read-only (the real engines raise a 503 EngineError for them while the model loads)
    @property
    @abc.abstractmethod
    def served_name(self) -> str: ...

    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any: ...

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int: ...

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abc.abstractmethod
    def default_params(self) -> Any:
        """The model's generation defaults (runtime/defaults.py)."""

    @property
    @abc.abstractmethod
    def max_num_seqs(self) -> int:
        """Sequences run at once (/props total_slots)."""

    @property
    @abc.abstractmethod
    def dtype(self) -> str:
        """The weights' dtype as loaded."""

    @property
    @abc.abstractmethod
    def device(self) -> str:
        """cpu, gpu or tpu."""

    @abc.abstractmethod
    def start(self) -> None:
        """Load and warm up in the background; returns at once."""

    @abc.abstractmethod
    async def wait_ready(self) -> None:
        """Return once it serves; an EngineError if it failed to start."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop; whatever was submitted and not taken is answered 503 engine_stopped."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and sizes (EngineCore.stats); {} while it has none."""

    @abc.abstractmethod
    def generate(self, req: GenerationRequest, limits: StreamLimits = StreamLimits(),
                 on_stall: Callable[[], None] | None = None) -> AsyncIterator[EngineEvent]:
        """Stream `req`'s events (runtime/request.py EngineEvent); an ImpError before the first for bad input."""

    @abc.abstractmethod
    def cancel(self, request_id: str) -> None:
        """End the request's open choices as `cancelled` (their last event carries usage); unknown ids: no-op."""

    @property
    def vision(self) -> bool:
        """A model fact: whether the loaded model has a vision encoder (takes image parts)."""
        return False

    @property
    def reply_markers(self) -> ReplyMarkers | None:
        """A model fact: how the model's replies split into reasoning and answer (harmony's markers or a <think>
        block's, runtime/replies), None when they do not. The engines find it once, at load; this default reads
        the tokenizer each time it is asked."""
        return reply_markers(self.tokenizer)

    @property
    def thinks(self) -> bool:
        """A model fact: whether the model thinks (the engine splits its reasoning from the answer)."""
        return self.reply_markers is not None

    def image_prompt(self, image: ImageInput) -> str:
        """The prompt text that stands for one image (with vision): the model's image special tokens, laid out
        for this image's size. A request's prompt holds each of its images' text, in `GenerationRequest.images`
        order; the engine puts the image's embedding rows on its image tokens."""
        raise not_supported("image input")

    # ---------------------------------------------------------------- capabilities
    async def end_thinking(self, request_id: str) -> str:
        """capabilities.end_thinking: "ending", "already_closed", "not_thinking" or "unknown"."""
        raise not_supported("ending a think block")

    async def suspend(self) -> dict[str, Any]:
        """capabilities.suspend: {"status": suspended | already_suspended | faulted, ...}."""
        raise not_supported("suspend")

    async def resume(self) -> dict[str, Any]:
        """capabilities.suspend: {"status": resumed | not_suspended | faulted}."""
        raise not_supported("resume")

    async def close_session(self, session_id: str) -> bool:
        """capabilities.sessions: release the session's pinned blocks; whether it was open."""
        raise not_supported("sessions")

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        """capabilities.lora: the loaded adapter's description."""
        raise not_supported("LoRA adapters")

    async def unload_lora(self, name: str, timeout_s: float | None = None) -> dict[str, Any] | None:
        """capabilities.lora: the unloaded adapter's description, or None when no adapter has that name."""
        raise not_supported("LoRA adapters")

    def lora_adapters(self) -> list[dict[str, Any]]:
        """The loaded adapters (name, id, path, ...); [] without capabilities.lora."""
        return []

    def replica_states(self) -> list[str]:
        """capabilities.replicas: each replica's state; one engine: its own."""
        return [self.state]


class Encoder(Protocol):
    """An encoder engine (runtime/core/encoder_engine.py) as the server sees it: embeddings and rerank scores."""

    state: str
    error: str | None
    served_name: str
    in_flight: int       # requests submitted and not yet answered (a drain waits for them)
    task: str            # "embed" or "score" (a cross-encoder); known before the weights are
    # model facts (raise a 503 EngineError while the model loads)
    tokenizer: Any
    max_model_len: int
    vocab_size: int      # token ids a caller may send
    dimensions: int      # the embedding size
    normalize: bool      # whether embeddings are L2-normalised

    @abc.abstractmethod
    def start(self) -> None: ...

    @abc.abstractmethod
    async def wait_ready(self) -> None: ...

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None: ...

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]: ...

    @abc.abstractmethod
    async def run(self, items: list[tuple[list[int], list[int]]]) -> Any:
        """The program's rows for (token ids, token type ids) inputs: pooled vectors [n, hidden] or logits."""
