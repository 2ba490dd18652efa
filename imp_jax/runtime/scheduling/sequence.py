"""A sequence being generated: its tokens, KV block table, progress, and output bookkeeping."""
from __future__ import annotations

import dataclasses
import enum
import itertools
import time
from typing import Any

from imp_jax.model.text.detokenizer import IncrementalDetokenizer
from imp_jax.runtime.decoding.banned import BannedFilter
from imp_jax.runtime.kv.kv_blocks import BlockTable
from imp_jax.runtime.kv.kv_hash import ImageKeys
from imp_jax.runtime.replies.reasoning import ThinkTracker
from imp_jax.runtime.request import GenerationRequest, SamplingParams, TokenLogprob
from imp_jax.runtime.replies.stop import StopStringMatcher

_ids = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    """One choice of a request. `num_computed` tokens of `prompt_ids + output_ids` have KV written."""

    request: GenerationRequest
    index: int
    params: SamplingParams            # resolved: no None sampling knobs left
    max_tokens: int
    detok: IncrementalDetokenizer
    stops: StopStringMatcher
    prompt_ids: list[int]
    output_ids: list[int] = dataclasses.field(default_factory=list)
    table: BlockTable = dataclasses.field(default_factory=BlockTable)
    num_computed: int = 0
    status: SeqStatus = SeqStatus.WAITING
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_scheduled_at: float | None = None   # when the scheduler first put it into a batch
    seq_id: int = dataclasses.field(default_factory=lambda: next(_ids))
    parent: "Sequence | None" = None   # n > 1: siblings wait until the parent's prompt is in the cache
    cached_prompt_tokens: int | None = None
    num_preemptions: int = 0
    finish_reason: str | None = None
    pinned: bool = False
    pending_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    reasoning: ThinkTracker | None = None  # its think-block tracker, when the request splits reasoning
    lora_slot: int = 0                  # its LoRA adapter's slot (runtime/scheduling/lora.py), 0 = none
    lora_key: tuple[str, str] | None = None  # the adapter's (name, content digest): LoadedAdapter.cache_key
    # tokens sampled by launched steps the host has not read yet (asynchronous scheduling, engine.py):
    # they count in num_tokens (the scheduler plans with them), not in output_ids / all_ids
    pending: int = 0
    pending_row: int = -1                # the newest pending token's row in its step's output
    # classifier-free guidance (runtime/decoding/cfg.py): a main sequence's shadow, and a shadow's main
    shadow: "Sequence | None" = None
    main: "Sequence | None" = None
    banned: BannedFilter | None = None   # banned_strings / banned_regex: held tokens and bans (runtime/decoding/banned.py)
    # per-sequence host state of the decoding features (runtime/features/), by feature name
    ext: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def cache_key(self) -> Any:
        """Its prefix-cache extra key: the request's salt, with the adapter when it has one (blocks
        computed under one adapter are never served to another, or to the base model), and per block the
        digests of the images the block holds (kv_hash.ImageKeys)."""
        salt = self.request.cache_salt
        key = salt if self.lora_key is None else (salt, "lora", *self.lora_key)
        private = self.ext.get("private_cache")   # a feature's own blocks (prompt scoring): never shared
        key = key if private is None else ("private", private, key)
        spans = self.ext.get("image_spans")       # the images feature's (first, end, digest hex) per image
        return key if spans is None else ImageKeys(key, spans)

    def chunk_fit(self, start: int, n: int) -> int:
        """How many of the n tokens from `start` one prefill chunk may take: n, cut back to the start of the
        atomic span it would end strictly inside (`ext["atomic_spans"]`, token [lo, hi) ranges: an image whose
        tokens attend each other, runtime/features/images.py), 0 when that start is not past `start`. A chunk
        may start inside a span (its head's KV came from a pass that ran to the span's end) if it reaches
        the end."""
        end = start + n
        for lo, hi in self.ext.get("atomic_spans", ()):
            if lo < end < hi:
                return max(0, lo - start)
        return n

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Tokens so far, the pending ones included."""
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    @property
    def num_known(self) -> int:
        """Tokens the host has read (len(all_ids))."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefill(self) -> bool:
        """More than the one newest token still lacks KV."""
        return self.num_tokens - self.num_computed > 1

    @property
    def can_start(self) -> bool:
        """Siblings start once the parent's prompt KV is written (and so in the prefix cache)."""
        p = self.parent
        return p is None or p.status is SeqStatus.FINISHED or p.num_computed >= len(p.prompt_ids)
