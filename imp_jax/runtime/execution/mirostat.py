"""Mirostat (Basu et al. 2020) v1 and v2, as llama.cpp samples them: a per-sequence target surprise.

Each mirostat row carries mu, its running maximum surprise (bits), initialised to 2 * tau. After
temperature the row is truncated by mirostat instead of top_k / top_p / min_p / typical_p (which
llama.cpp's chain leaves out when mirostat is on; the host sets them neutral for such rows):

- v2: keep the tokens whose surprise -log2 p is at most mu (at least the most likely one);
- v1: estimate the Zipf exponent s from the top M = 100 probabilities
  (s = sum t_i b_i / sum t_i^2, t_i = ln((i + 2) / (i + 1)), b_i = ln(p_i / p_(i+1))), then keep the
  top k = ((s - 1) 2^mu / (1 - V^(1 - s)))^(1 / s) tokens (at least 1, cut by value like top_k).

The token is drawn from what is left, renormalised, and mu moves by the error of its surprise:
mu <- mu - eta * (-log2 p(token) - tau). A greedy row (temperature <= 0) keeps one token, as
llama.cpp's temperature 0 does: its surprise is 0. The sampler returns the new mu per row; the
engine keeps it on the sequence for the next step (runtime/core/engine.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from imp_jax.runtime.execution.truncation import top_values

if TYPE_CHECKING:
    from imp_jax.runtime.execution.sampling import SamplingTensors

V1_CANDIDATES = 100      # llama.cpp's m: the top probabilities v1 estimates its exponent from
LN2 = 0.6931471805599453


def initial_mu(tau: float) -> float:
    """mu before the first token: twice the target surprise (llama.cpp)."""
    return 2.0 * tau


def v1_top_k(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Each row's top_k, with mirostat v1 rows' k from their mu (others keep theirs). `logits` are
    after temperature; -inf entries (masked tokens) give no estimate terms."""
    vocab = logits.shape[1]
    m = min(V1_CANDIDATES, vocab)
    top = top_values(logits, m)                                     # [R, m], largest first
    b = top[:, :-1] - top[:, 1:]                                    # ln(p_i / p_(i+1))
    i = jnp.arange(m - 1, dtype=jnp.float32)
    ti = jnp.log((i + 2) / (i + 1))
    ok = jnp.isfinite(b)
    s_hat = jnp.sum(jnp.where(ok, ti * b, 0.0), axis=-1) / jnp.maximum(jnp.sum(jnp.where(ok, ti * ti, 0.0), axis=-1),
                                                                     1e-30)
    eps = s_hat - 1
    k = jnp.power(eps * jnp.exp2(t.mirostat_mu) / (1 - jnp.power(jnp.float32(vocab), -eps)), 1 / s_hat)
    k = jnp.where(jnp.isfinite(k), jnp.clip(jnp.floor(k), 1, vocab), vocab).astype(jnp.int32)
    return jnp.where(t.mirostat == 1, k, t.top_k)


def v2_truncate(logits: jax.Array, t: SamplingTensors) -> jax.Array:
    """Mirostat v2 rows lose the tokens whose surprise exceeds their mu (the most likely stays)."""
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    log2p = (logits - jax.nn.logsumexp(logits, axis=-1, keepdims=True)) / LN2
    keep = (-log2p <= t.mirostat_mu[:, None]) | (logits == row_max)
    return jnp.where((t.mirostat[:, None] == 2) & ~keep, -jnp.inf, logits)


def next_mu(t: SamplingTensors, logprob: jax.Array) -> jax.Array:
    """Each row's mu after sampling a token of natural-log probability `logprob` (renormalised over
    what truncation left); rows without mirostat keep theirs."""
    surprise = jnp.where(t.temperature > 0, -logprob / LN2, 0.0)
    return jnp.where(t.mirostat != 0, t.mirostat_mu - t.mirostat_eta * (surprise - t.mirostat_tau), t.mirostat_mu)
