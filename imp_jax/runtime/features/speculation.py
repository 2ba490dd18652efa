"""Speculative decoding (runtime/decoding/speculative.py) as a feature: a drafting state per sequence, the scheduler's
drafter, the verify of a read chunk's drafts, and the request's imp_spec_* usage."""
from __future__ import annotations

from typing import Any, Callable

from imp_jax.runtime.features.base import Accepted, Feature
from imp_jax.runtime.scheduling.sequence import Sequence, SeqStatus
from imp_jax.runtime.decoding.speculative import MAX_DRAFT, SpecState, accepted_prefix, ngram_draft


def spec_state(seq: Sequence) -> SpecState | None:
    return seq.ext.get(SpeculationFeature.name)


class SpeculationFeature(Feature):
    name = "speculation"

    def start(self, seq, state) -> None:
        """A drafting state when the request may speculate: the request's `speculative` or else --speculative,
        at its n-gram depth or --speculative-max-draft, capped so a verify chunk fits a step's sampled rows."""
        req, cfg = state.request, self.s.config
        on = req.speculative if req.speculative is not None else cfg.speculative == "on"
        depth = req.spec_ngram_k if req.spec_ngram_k is not None else cfg.speculative_max_draft
        depth = min(depth, MAX_DRAFT, cfg.max_num_seqs - 1, cfg.max_num_batched_tokens - 1)
        if on and depth > 0 and state.drafts_ok and self.s.step_fn.leader is None and seq.main is None:
            seq.ext[self.name] = SpecState(max_k=depth)

    def draft(self, seq: Sequence, limit: int, held: bool) -> list[int]:
        """Scheduler hook: up to `limit` drafts for a decoding sequence (none while `held`, or past
        max_tokens and the context)."""
        spec = spec_state(seq)
        if spec is None or seq.status is not SeqStatus.RUNNING or held:
            return []
        room = min(limit, seq.max_tokens - len(seq.output_ids) - 1, self.s.max_model_len - seq.num_tokens - 1)
        k = spec.depth()
        if k <= 0 or room <= 0:
            return []
        # a chunk of 1 + k tokens runs padded to a power of two: drafts that fill the padding cost nothing
        # more (alone in its step) and may be accepted
        return ngram_draft(seq.all_ids, min(2 ** (k + 1).bit_length() - 1 if k & (k + 1) else k, room, spec.max_k))

    def needs_newest(self, seq) -> bool:
        """Whether the sequence would draft at its next step (its known tokens end in an n-gram seen before,
        and the batch has sampled rows to spare): then that step waits for its newest token."""
        spec = spec_state(seq)
        if spec is None or spec.depth() <= 0 or seq.status is not SeqStatus.RUNNING:
            return False
        sched = self.s.scheduler
        rows_spare = len(sched.running) + len(sched.waiting) < self.s.config.max_num_seqs
        return rows_spare and bool(ngram_draft(seq.all_ids, 1))

    def accepted(self, seq, tok: Accepted) -> None:
        spec = spec_state(seq)
        if spec is not None and not tok.verified:
            spec.plain_step()

    def verify(self, chunk, out, row: int, extra: int, advance: Callable[[Sequence, int, bool], None]) -> None:
        """A read verify chunk: accept the drafts that equal the tokens sampled at their rows, drop the rest's
        KV (KVBlockPool.truncate), then `advance` the accepted drafts and the token sampled after them, one by
        one, as plain steps would have."""
        seq, drafts = chunk.seq, chunk.drafts
        if seq.status is SeqStatus.FINISHED:
            return
        rows = [row, *range(extra, extra + len(drafts))]
        accepted = accepted_prefix(drafts, [int(out.tokens[r]) for r in rows])
        spec_state(seq).record(len(drafts), accepted)
        c = self.s.counters
        c.spec_drafted += len(drafts)
        c.spec_accepted += accepted
        c.spec_emitted += accepted + 1
        c.spec_verify_rows += 1
        c.spec_miss_rows += accepted == 0
        seq.num_computed -= len(drafts) - accepted   # the newest token and the accepted drafts keep their KV
        if seq.status is SeqStatus.RUNNING and self.s.pool.truncate(seq.table, seq.num_computed) is not None:
            raise RuntimeError(f"sequence {seq.seq_id}: a verify chunk wrote into a shared block")
        for j in range(accepted + 1):
            advance(seq, rows[j], j == 0)
            if seq.status is SeqStatus.FINISHED:
                break

    def usage(self, state, usage: dict[str, Any]) -> None:
        """The request's imp_spec_* usage: its choices' verify counters when a verify step ran, and a decline
        when it asked for an MTP head (this server has none)."""
        specs = [spec_state(s) for s in state.seqs if spec_state(s) is not None]
        spec: dict = {}
        if any(sp.verify_steps for sp in specs):
            spec = {key: sum(sp.usage()[key] for sp in specs) for key in specs[0].usage()}
        if state.request.spec_mtp_k:
            spec = {"imp_spec_drafted": 0, "imp_spec_accepted": 0, "imp_spec_emitted": 0,
                    "imp_spec_verify_steps": 0, **spec, "imp_spec_declined": 1,
                    "imp_spec_declined_detail": "no_mtp_head"}
        usage["spec"] = spec or None
