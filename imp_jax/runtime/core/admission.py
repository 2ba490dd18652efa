"""Admission: a request is checked against the model, the pool and every feature, then its sequences are
made. All checks run before anything is taken, so a refused request holds nothing; what features
take (`Feature.acquire`) is released if a later one refuses."""
from __future__ import annotations

import dataclasses

from imp_jax.errors import InvalidRequestError
from imp_jax.model.text.detokenizer import IncrementalDetokenizer
from imp_jax.runtime.defaults import resolve_params
from imp_jax.runtime.features import Feature, Services
from imp_jax.runtime.request import GenerationRequest, check_context, check_reply_size
from imp_jax.runtime.core.request_state import Emit, RequestState
from imp_jax.runtime.scheduling.sequence import Sequence
from imp_jax.runtime.core.step_inputs import base_bias
from imp_jax.runtime.replies.stop import StopStringMatcher


def admit(services: Services, features: list[Feature], req: GenerationRequest, emit: Emit) -> RequestState:
    """Validate `req` (InvalidRequestError naming the field when it can never run) and make its state."""
    s = services
    vocab = s.vocab_size
    req.params.validate(vocab)
    n_prompt = len(req.prompt_ids)
    params = resolve_params(req.params, s.generation_config, s.architecture)
    check_context(n_prompt, params.max_tokens, s.max_model_len, "prompt")
    if any(not 0 <= t < vocab for t in req.prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if s.pool.num_blocks_for(n_prompt + 1) > s.baseline_free_blocks:
        s.counters.kv_pressure_rejections += 1
        raise InvalidRequestError(
            f"the prompt needs {s.pool.num_blocks_for(n_prompt + 1)} KV blocks but the pool has only "
            f"{s.baseline_free_blocks}; raise --num-kv-blocks or --kv-cache-memory",
            code="context_length_exceeded")
    if len(base_bias(params, 0, s.tokenizer.eos_ids)) > s.step_fn.shapes.max_bias:
        raise InvalidRequestError(
            f"at most {s.step_fn.shapes.max_bias} logit_bias entries (stop_token_ids and EOS count "
            f"while min_tokens are out)", param="logit_bias")
    max_tokens = params.max_tokens or s.max_model_len - n_prompt
    check_reply_size(params, n_prompt, max_tokens)
    for f in features:
        params = f.check(req, params)
    state = RequestState(req, params, max_tokens, emit,
                         drafts_ok=req.speculative is not False
                         and all(f.drafts_ok or not f.active(req, params) for f in features))
    try:
        for f in features:
            f.acquire(state)
        for i in range(params.n):
            p = params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
            seq = Sequence(
                request=req, index=i, params=p, max_tokens=max_tokens,
                detok=IncrementalDetokenizer(s.tokenizer, skip_special_tokens=p.skip_special_tokens),
                stops=StopStringMatcher(p.stop, p.include_stop_str_in_output),
                prompt_ids=list(req.prompt_ids), parent=state.seqs[0] if state.seqs else None)
            for f in features:
                f.start(seq, state)
            state.seqs.append(seq)
    except BaseException:
        for f in features:
            f.release(state)
        raise
    state.num_open = len(state.seqs)
    return state
