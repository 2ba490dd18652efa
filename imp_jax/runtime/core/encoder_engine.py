"""EncoderEngine: the second, simpler core beside the generative one, for embeddings and rerank.

No KV cache, no sampler. Requests from every client go into one inbox; the engine thread takes
all that is waiting, sorts the inputs by length and runs them in padded (batch x sequence)
buckets, each one program compiled at start-up (so serving compiles nothing: a counter proves
it). A program returns the pooled vectors of an embedding model or the logits of a cross-encoder;
truncation to `dimensions` and normalisation happen on the host, per row.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from imp_jax.errors import EngineError, ModelLoadError
from imp_jax.model.architectures.bert import EncoderConfig
from imp_jax.model.config import read_json
from imp_jax.model.formats.encoder_loader import LoadedEncoder, load_encoder
from imp_jax.model.formats.hub import resolve_model
from imp_jax.model.formats.loader import resolve_dtype
from imp_jax.runtime.api import Encoder, not_serving
from imp_jax.runtime.execution.batch import pow2_buckets
from imp_jax.runtime.core.commands import Command, Encode
from imp_jax.runtime.core.engine_thread import EngineThread
from imp_jax.runtime.vectors import finish_embeddings

log = logging.getLogger("imp_jax.encoder")
Item = tuple[list[int], list[int]]   # (token ids, token type ids) of one input
MIN_SEQ_BUCKET = 16


@dataclasses.dataclass(frozen=True)
class EncoderEngineConfig:
    model: str
    max_batch: int = 32              # inputs in one program call at most
    max_batch_tokens: int = 8192     # padded tokens (batch x sequence bucket) in one call at most
    dtype: str = "auto"
    compilation_cache_dir: str | None = None


CALL_COST_TOKENS = 64   # what one more program call costs, in padded tokens (the batcher's split, _plan)


def encoder_buckets(max_len: int, max_batch: int, max_batch_tokens: int) -> list[tuple[int, int]]:
    """(batch, seq) shapes: sequences in powers of two and the 1.5x between them from 32 up (less
    padding: sentences are short), batches in powers of four (the batcher fills them: 5 inputs run
    as 4 + 1), both capped, every pair within the token budget."""
    pow2 = pow2_buckets(MIN_SEQ_BUCKET, max_len)
    seqs = sorted({s for s in pow2 + [p * 3 // 2 for p in pow2 if p >= 32] if s <= max_len})
    batches = [b for b in pow2_buckets(1, max_batch) if b & (b - 1) or b.bit_length() % 2 == 1 or b == max_batch]
    out = [(b, s) for s in seqs for b in batches if b * s <= max_batch_tokens]
    if not any(s == max_len for _, s in out):
        out.append((1, max_len))   # one input of the full length always fits
    return sorted(out)


def check_encoder(model: str) -> str:
    """The served name of the encoder `model` names, after the checks that need no weights (an HF
    directory whose config.json names an encoder architecture, or a BERT GGUF file's header); a
    ModelLoadError otherwise, so a wrong --embedding-model stops the server at start-up instead of
    faulting later."""
    resolved = resolve_model(model)
    if resolved.kind == "gguf":
        from imp_jax.model.formats.gguf_encoder import gguf_wordpiece, read_gguf_encoder

        reader, _, _, _ = read_gguf_encoder(resolved.path)
        gguf_wordpiece(reader.fields, resolved.path)
        return resolved.served_name
    if resolved.kind != "hf_dir":
        raise ModelLoadError(f"{resolved.path}: an embedding or rerank model must be an HF directory "
                             "(config.json, *.safetensors, tokenizer.json) or a BERT GGUF file; converted "
                             "encoders are not supported")
    config = resolved.path / "config.json"
    EncoderConfig.from_hf(read_json(config), str(config))
    return resolved.served_name


class EncoderEngine(EngineThread, Encoder):
    """Start with `start()`; `run()` / `embed()` from asyncio; `shutdown()` with the server."""

    def __init__(self, config: EncoderEngineConfig, loaded: LoadedEncoder | None = None):
        self.config = config
        self._loaded = loaded
        self.served_name = loaded.served_name if loaded else check_encoder(config.model)
        super().__init__(f"imp-encoder-{self.served_name}", f"encoder {self.served_name}", log)
        self._jobs: list[Encode] = []   # taken from the inbox, run together by the next _serve_jobs
        self._exec: dict[tuple[int, int], Any] = {}
        self._warm = False
        self._task: str | None = None
        self.compilations_after_warmup = 0
        self.batches = self.inputs = self.real_tokens = self.padded_tokens = 0
        self.in_flight = 0   # requests submitted and not yet answered (the server's drain waits for them)

    # -------------------------------------------------------------------- facts
    @property
    def loaded(self) -> LoadedEncoder:
        if self._loaded is None or self.state in ("loading", "warming_up"):
            raise EngineError(f"the model {self.served_name} is still loading", code="loading", status=503)
        return self._loaded

    @property
    def task(self) -> str:
        """'embed' or 'score' (a cross-encoder); known before the weights are (from config.json)."""
        if self._loaded is not None:
            return self._loaded.settings.task
        if self._task is None:
            resolved = resolve_model(self.config.model)
            if resolved.kind == "gguf":
                self._task = "embed"   # GGUF cross-encoders are refused (model/formats/gguf_encoder.py)
            else:
                config = EncoderConfig.from_hf(read_json(resolved.path / "config.json"))
                self._task = "score" if config.num_labels else "embed"
        return self._task

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.loaded.settings.max_len

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def dimensions(self) -> int:
        return self.loaded.config.hidden_size

    @property
    def normalize(self) -> bool:
        return self.loaded.settings.normalize

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return sorted(self._exec)

    def stats(self) -> dict[str, Any]:
        return {"state": self.state, "task": self.task if self._loaded else None,
                "compilations_after_warmup": self.compilations_after_warmup, "programs": len(self._exec),
                "in_flight": self.in_flight,
                "batches": self.batches, "inputs": self.inputs, "real_tokens": self.real_tokens,
                "padded_tokens": self.padded_tokens}

    # ----------------------------------------------------------------- requests
    async def run(self, items: list[Item]) -> np.ndarray:
        """The program's rows for `items`: pooled vectors [n, hidden] or logits [n, num_labels]."""
        if self.state != "ready":
            raise not_serving(self.state, self.error, f"the model {self.served_name}")
        too_long = [i for i, (ids, _) in enumerate(items) if not 0 < len(ids) <= self.max_model_len]
        if too_long:   # the server checks first; this guards the engine's own contract
            raise EngineError(f"input {too_long[0]} has {len(items[too_long[0]][0])} tokens", status=400,
                              code="invalid_request_error")
        self.in_flight += 1   # on the event loop's thread only
        try:
            return await self._ask(Encode(list(items)))
        finally:
            self.in_flight -= 1

    async def embed(self, items: list[Item], dimensions: int | None = None) -> np.ndarray:
        """Embeddings [n, dimensions or hidden] (float32), truncated then normalised if the model normalises."""
        vectors = await self.run(items)
        return finish_embeddings(vectors, dimensions, self.normalize)

    # ------------------------------------------------------------ engine thread
    def _serve(self) -> None:
        """Each wake-up takes every job waiting and runs them as one set of batches (those taken before
        a Stop too, so no caller waits)."""
        serving = True
        while serving:
            serving = self._drain(block=True)
            jobs, self._jobs = self._jobs, []
            if not jobs:
                continue
            try:
                self._serve_jobs(jobs)
            except Exception as e:
                log.exception("encoder %s: a batch failed", self.served_name)
                for j in jobs:
                    j.answer(EngineError(f"the encoder failed: {e}"))

    def _apply(self, command: Command) -> None:
        if not isinstance(command, Encode):
            raise TypeError(f"the encoder has no command {type(command).__name__}")
        self._jobs.append(command)

    def _load(self) -> None:
        from imp_jax.runtime.core.builder import enable_compilation_cache
        from imp_jax.runtime.config import EngineConfig

        enable_compilation_cache(EngineConfig(compilation_cache_dir=self.config.compilation_cache_dir))
        platform = jax.devices()[0].platform
        if self._loaded is None:
            self._loaded = load_encoder(self.config.model, resolve_dtype(self.config.dtype, platform))
        self.state = "warming_up"
        loaded = self._loaded
        graphdef, state = nnx.split(loaded.model)
        self._leaves, treedef = jax.tree.flatten(state)
        pooling, classify = loaded.settings.pooling, loaded.settings.task == "score"

        def program(leaves, ids, types, lengths):
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
            hidden = model(ids, types, lengths)
            return model.classify(hidden) if classify else model.pool(hidden, lengths, pooling)

        self._jit = jax.jit(program)
        self._leaf_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self._leaves]
        buckets = encoder_buckets(loaded.settings.max_len, self.config.max_batch, self.config.max_batch_tokens)
        t0 = time.perf_counter()
        for bucket in buckets:
            self._program(bucket)
            self._call(bucket, [([0], [0])])   # a program's first run costs more: pay it here
        self._warm = True
        log.info("encoder %s: %d programs compiled and run in %.1fs", self.served_name, len(buckets),
                 time.perf_counter() - t0)

    def _program(self, bucket: tuple[int, int]) -> Any:
        exe = self._exec.get(bucket)
        if exe is None:
            B, S = bucket
            spec = jax.ShapeDtypeStruct((B, S), jnp.int32)
            exe = self._jit.lower(self._leaf_specs, spec, spec, jax.ShapeDtypeStruct((B,), jnp.int32)).compile()
            self._exec[bucket] = exe
            if self._warm:
                self.compilations_after_warmup += 1
                log.warning("encoder %s: compiled a program for batch=%d seq=%d after warm-up", self.served_name, B, S)
        return exe

    def _bucket(self, n: int, longest: int) -> tuple[int, int] | None:
        """The smallest compiled bucket holding n inputs of at most `longest` tokens (None if none does)."""
        fits = [(b * s, b, s) for b, s in self._exec if b >= n and s >= longest]
        return min(fits)[1:] if fits else None

    def _call(self, bucket: tuple[int, int], items: list[Item]) -> np.ndarray:
        B, S = bucket
        ids = np.zeros((B, S), np.int32)
        types = np.zeros((B, S), np.int32)
        lengths = np.zeros(B, np.int32)
        ids[:, :] = self._loaded.config.pad_token_id
        for r, (tok, typ) in enumerate(items):
            ids[r, :len(tok)] = tok
            types[r, :len(typ)] = typ
            lengths[r] = len(tok)
        out = self._program(bucket)(self._leaves, ids, types, lengths)
        return np.asarray(out)[:len(items)]

    def _serve_jobs(self, jobs: list[Encode]) -> None:
        """Every input of `jobs`, sorted by length, in calls that fill their bucket's rows: each call takes
        the largest compiled batch size that what is left fills (5 inputs run as 4 + 1, not as 16 rows
        with 11 of padding); each job is answered when its last input is done."""
        work = []
        for j in jobs:
            j.left = len(j.items)
            work += [(len(item[0]), j, k) for k, item in enumerate(j.items)]
        work.sort(key=lambda w: w[0])
        start = 0
        for n in self._plan([length for length, _, _ in work]):
            chunk = work[start:start + n]
            end = start + n
            bucket = self._bucket(n, chunk[-1][0])
            rows = self._call(bucket, [j.items[k] for _, j, k in chunk])
            self.batches += 1
            self.inputs += len(chunk)
            self.real_tokens += sum(length for length, _, _ in chunk)
            self.padded_tokens += bucket[0] * bucket[1]
            for row, (_, j, k) in zip(rows, chunk):
                if j.out is None:
                    j.out = np.zeros((len(j.items), row.shape[0]), np.float32)
                j.out[k] = row
                j.left -= 1
                if j.left == 0:
                    j.answer(j.out)
            start = end

    def _plan(self, lengths: list[int]) -> list[int]:
        """How many of the length-sorted inputs each call takes, in order: the split with the fewest padded
        tokens, counting CALL_COST_TOKENS for each call. Every call fills its bucket's rows, so each takes a
        compiled batch size; short inputs then run in short buckets instead of padding up to the longest
        (32 sentences of 7 to 50 tokens: 16 x 32 + 16 x 64 rather than 32 x 64)."""
        sizes = sorted({b for b, _ in self._exec})
        total = len(lengths)
        cost = [0.0] * (total + 1)   # cost[i]: the cheapest plan for inputs i.. (by dynamic programming)
        take = [0] * (total + 1)
        for i in range(total - 1, -1, -1):
            cost[i] = float("inf")
            for n in sizes:
                if n > total - i:
                    break
                bucket = self._bucket(n, lengths[i + n - 1])
                if bucket is None:
                    continue
                c = bucket[0] * bucket[1] + CALL_COST_TOKENS + cost[i + n]
                if c < cost[i]:
                    cost[i], take[i] = c, n
        plan, i = [], 0
        while i < total:
            plan.append(take[i])
            i += take[i]
        return plan
