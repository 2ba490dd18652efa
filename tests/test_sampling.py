"""The sampler against a NumPy reference of the same processing, plus its RNG contracts."""

from __future__ import annotations

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.runtime.execution.sampling import (
    DRAW_BLOCK,
    RowSpec,
    SamplingTensors,
    _unpack_mask,
    build_sampling_tensors,
    pack_allowed_tokens,
    sample,
)
from imp_jax.runtime.execution.truncation import FAST_TOP_K

V, R, H, B, K = 128, 8, 16, 4, 5
assert V > FAST_TOP_K  # so both the top_k fast path and the full sort are exercised


def _logits(seed: int, rows: int = R, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, V)) * scale).astype(np.float32)


def _tensors(specs: list[RowSpec], with_mask: bool = False) -> SamplingTensors:
    return build_sampling_tensors(
        specs, num_rows_bucket=R, vocab_size=V, history_len=H, max_bias=B, with_mask=with_mask
    )


def _run(logits: np.ndarray, specs: list[RowSpec], key: int = 0, mask: bool = False):
    """Two compiled programs in all: unmasked with K top logprobs, masked with none."""
    k = 0 if mask else K
    specs = [dataclasses.replace(s, wants_top_logprobs=True) for s in specs]
    out = sample(jnp.asarray(logits), _tensors(specs, mask), jax.random.key(key), num_top_logprobs=k)
    return jax.tree.map(np.asarray, out)


# ----------------------------------------------------------------------- reference


def _softmax(l: np.ndarray) -> np.ndarray:
    e = np.exp(l - l.max())
    return e / e.sum()


def ref_logprobs(logits: np.ndarray, s: RowSpec) -> np.ndarray:
    """Sequential, per-row NumPy version of the documented processing (float64)."""
    l = logits.astype(np.float64).copy()
    hist = list(s.history)[-H:]
    outputs = hist[len(hist) - min(s.num_output_tokens, len(hist)) :]
    for tok in set(hist):
        l[tok] = l[tok] / s.repetition_penalty if l[tok] > 0 else l[tok] * s.repetition_penalty
    for tok, count in Counter(outputs).items():
        l[tok] -= s.frequency_penalty * count + s.presence_penalty
    for tok, val in s.logit_bias.items():
        l[tok] += val
    if s.allowed_token_ids is not None:
        banned = np.ones(V, bool)
        banned[list(s.allowed_token_ids)] = False
        l[banned] = -np.inf
    if s.temperature > 0:
        l /= s.temperature
    if 0 < s.top_k < V:
        l[l < np.sort(l)[::-1][s.top_k - 1]] = -np.inf
    if s.top_p < 1:
        p, total = _softmax(l), 0.0
        for idx in np.argsort(-l, kind="stable"):
            cut, total = l[idx], total + p[idx]
            if total >= s.top_p:
                break
        l[l < cut] = -np.inf
    if s.min_p > 0:
        p = _softmax(l)
        l[p < s.min_p * p.max()] = -np.inf
    if s.typical_p < 1:  # transformers.TypicalLogitsWarper, min_tokens_to_keep=1
        with np.errstate(invalid="ignore"):
            logp = l - np.log(np.exp(l - l.max()).sum()) - l.max()
            ent = -np.nansum(logp * np.exp(logp))
        shifted = np.abs(-logp - ent)
        order = np.argsort(shifted, kind="stable")
        cum = np.cumsum(_softmax(l[order]))
        last = min(int((cum < s.typical_p).sum()), V - 1)
        l[shifted > shifted[order][last]] = -np.inf
    return l - l.max() - np.log(np.exp(l - l.max()).sum())


def assert_matches_reference(logits: np.ndarray, specs: list[RowSpec], out) -> None:
    for i, s in enumerate(specs):
        ref, k = ref_logprobs(logits[i], s), out.top_ids.shape[1]
        assert np.isfinite(out.logprob[i]), f"row {i} drew a removed token"
        np.testing.assert_array_equal(np.isneginf(ref[out.top_ids[i]]), np.isneginf(out.top_logprobs[i]))
        np.testing.assert_allclose(out.logprob[i], ref[out.tokens[i]], atol=1e-5, err_msg=f"row {i}")
        ref_top = np.sort(ref)[::-1][:k]
        np.testing.assert_allclose(out.top_logprobs[i], ref_top, atol=1e-5, err_msg=f"row {i}")
        if s.temperature <= 0:
            assert out.tokens[i] == np.argmax(ref), f"greedy row {i}"


HIST = [5, 9, 9, 40, 77, 9, 120, 3, 5, 64]
CASES = {
    "greedy": RowSpec(temperature=0.0),
    "temperature": RowSpec(temperature=0.7),
    "top_k_fast": RowSpec(top_k=10),
    "top_k_full": RowSpec(top_k=100),
    "top_p": RowSpec(top_p=0.8),
    "min_p": RowSpec(min_p=0.1, temperature=1.3),
    "typical_full": RowSpec(typical_p=0.6),
    "typical_fast": RowSpec(typical_p=0.7, top_k=20),
    "top_k_top_p": RowSpec(top_k=12, top_p=0.9, temperature=0.8),
    "top_k_full_top_p": RowSpec(top_k=100, top_p=0.7, temperature=1.5),
    "all_truncation": RowSpec(top_k=40, top_p=0.95, min_p=0.02, typical_p=0.9),
    "repetition": RowSpec(repetition_penalty=1.3, history=HIST, num_output_tokens=4),
    "presence_frequency": RowSpec(
        presence_penalty=1.5, frequency_penalty=0.7, history=HIST, num_output_tokens=6
    ),
    "bias": RowSpec(logit_bias={7: 4.0, 8: -3.0, 100: 2.5}),
    "greedy_everything": RowSpec(
        temperature=0.0, top_k=30, top_p=0.9, repetition_penalty=1.2, presence_penalty=0.5,
        frequency_penalty=0.3, logit_bias={1: 2.0}, history=HIST, num_output_tokens=3,
    ),
    "sampled_everything": RowSpec(
        temperature=0.9, top_k=50, top_p=0.85, min_p=0.05, repetition_penalty=1.1,
        frequency_penalty=0.4, logit_bias={2: 1.0, 3: -1.0}, history=HIST, num_output_tokens=5,
        seed=11, position=4,
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_knob_alone_matches_reference(name: str) -> None:
    logits = _logits(sorted(CASES).index(name))
    specs = [CASES[name]]
    assert_matches_reference(logits, specs, _run(logits, specs, key=3))


def test_mixed_batches_match_reference() -> None:
    names = sorted(CASES)
    for start in range(0, len(names), R):
        specs = [CASES[n] for n in names[start : start + R]]
        logits = _logits(100 + start)
        assert_matches_reference(logits, specs, _run(logits, specs, key=start))


@pytest.mark.parametrize("spec", [RowSpec(top_p=0.6), RowSpec(top_k=90), RowSpec(top_k=100, top_p=0.5),
                                  RowSpec(top_p=0.0), RowSpec(top_k=V - 1, top_p=0.999),
                                  RowSpec(typical_p=0.5), RowSpec(typical_p=0.9, top_k=100, temperature=0.7)])
def test_full_truncation_keeps_ties_and_matches_reference(spec: RowSpec) -> None:
    """The sort-free top_k / top_p / typical_p (bisection over value keys) on logits full of ties,
    negative and positive: tokens tied with the last kept one stay, as the sorted reference keeps them."""
    rng = np.random.default_rng(17)
    logits = rng.integers(-4, 5, (R, V)).astype(np.float32) / 2
    specs = [spec] * R
    out = _run(logits, specs)
    assert_matches_reference(logits, specs, out)
    assert np.isfinite(ref_logprobs(logits[0], spec)).sum() >= 1


def test_sampled_token_is_never_a_removed_one() -> None:
    specs = [CASES[n] for n in ("top_k_fast", "top_p", "min_p", "typical_full", "all_truncation")]
    logits = _logits(7)
    for key in range(20):
        out = _run(logits, specs, key=key)
        for i, s in enumerate(specs):
            assert np.isfinite(ref_logprobs(logits[i], s)[out.tokens[i]])


def test_seeded_row_ignores_its_neighbours_and_row_index() -> None:
    seeded = RowSpec(temperature=1.0, seed=1234, position=17)
    logits = np.tile(_logits(5, rows=1, scale=0.5), (R, 1))  # flat: the draw decides
    alone = _run(logits, [seeded], key=0).tokens[0]
    others = [CASES["typical_full"], CASES["presence_frequency"], CASES["top_p"]]
    moved = _run(logits, others + [seeded] + others, key=99).tokens[3]
    assert alone == moved
    draws = {int(_run(logits, [RowSpec(seed=1234, position=p)]).tokens[0]) for p in range(12)}
    assert len(draws) > 3  # the position really feeds the key


def test_unseeded_rows_differ_by_row_and_step_key() -> None:
    logits = np.tile(_logits(6, rows=1, scale=0.1), (R, 1))
    a = _run(logits, [RowSpec()] * R, key=1).tokens
    b = _run(logits, [RowSpec()] * R, key=2).tokens
    assert len(set(a.tolist())) > 1 and not np.array_equal(a, b)


def test_draws_follow_the_processed_distribution() -> None:
    spec = RowSpec(top_k=6, temperature=0.8)
    logits = np.tile(_logits(8, rows=1, scale=1.0), (R, 1))
    probs = np.exp(ref_logprobs(logits[0], spec))
    counts = np.zeros(V)
    for key in range(250):
        np.add.at(counts, _run(logits, [spec] * R, key=key).tokens, 1)
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support] * counts.sum()
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < 30, (chi2, counts[support], expected)  # 5 dof: p < 1e-5


def test_draws_across_blocks_of_a_large_vocabulary() -> None:
    """The two-level draw (blocks of DRAW_BLOCK tokens, then the token inside): a support spread
    over block edges and a partial last block, every other token at -inf, is drawn in proportion
    and nothing outside it ever is."""
    vocab = 3 * DRAW_BLOCK + 100
    support = np.array([0, DRAW_BLOCK - 1, DRAW_BLOCK, DRAW_BLOCK + 40, 2 * DRAW_BLOCK + 7, 2 * DRAW_BLOCK + 9,
                        vocab - 2, vocab - 1])
    probs = np.array([0.05, 0.15, 0.1, 0.15, 0.2, 0.1, 0.1, 0.15])
    logits = np.full((R, vocab), -np.inf, np.float32)
    logits[:, support] = np.log(probs)
    tensors = build_sampling_tensors([RowSpec(temperature=1.0)] * R, num_rows_bucket=R, vocab_size=vocab,
                                     history_len=H, max_bias=B, with_mask=False)
    draw = jax.jit(lambda key: sample(jnp.asarray(logits), tensors, key).tokens)
    tokens = np.concatenate([np.asarray(draw(jax.random.key(k))) for k in range(100)])
    assert np.isin(tokens, support).all()
    counts = np.array([(tokens == s).sum() for s in support])
    expected = probs * len(tokens)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 35, (chi2, counts, expected)  # 7 dof: p < 1e-5


def test_logit_bias_of_100_forces_the_token() -> None:
    spec = RowSpec(temperature=1.5, logit_bias={17: 100.0})
    for key in range(5):
        out = _run(_logits(key), [spec, RowSpec(temperature=0.0, logit_bias={99: 100.0})], key=key)
        assert out.tokens[:2].tolist() == [17, 99]


def test_allowed_mask_restricts_draws_and_logprobs_with_zero_top_logprobs() -> None:
    allowed = [3, 50, 77, 127]
    words = pack_allowed_tokens(allowed, V).view(np.int32)  # llguidance hands out int32
    specs = [
        RowSpec(allowed_token_ids=allowed),
        RowSpec(allowed_bitmask=words, temperature=0.0),
        RowSpec(allowed_token_ids=allowed, top_p=0.9, logit_bias={3: -5.0}),
        RowSpec(),  # unrestricted row in a masked batch
    ]
    for key in range(10):
        logits = _logits(20 + key)
        out = _run(logits, specs, key=key, mask=True)
        assert set(out.tokens[:3].tolist()) <= set(allowed)
        assert out.top_ids.shape == (R, 0) and out.top_logprobs.shape == (R, 0)
        assert out.tokens[1] == allowed[np.argmax(logits[1, allowed])]
        keep = [0, 2, 3]  # the reference knows token lists, not bitmasks
        picked = jax.tree.map(lambda x: x[keep], out)
        assert_matches_reference(logits[keep], [specs[i] for i in keep], picked)


def test_unpack_mask_handles_a_partial_last_word() -> None:
    ids = [0, 31, 32, 63, 64, 69]
    mask = np.asarray(_unpack_mask(jnp.asarray(pack_allowed_tokens(ids, 70)[None]), 70))
    assert mask.shape == (1, 70) and np.flatnonzero(mask[0]).tolist() == ids


def test_top_logprobs_sorted_and_greedy_token_first() -> None:
    logits = _logits(30)
    specs = [RowSpec(temperature=0.0), RowSpec(temperature=0.0, top_k=3), RowSpec(top_p=0.5)]
    out = _run(logits, specs)
    assert (out.top_logprobs[:, 1:] <= out.top_logprobs[:, :-1]).all()
    np.testing.assert_array_equal(out.tokens[:2], out.top_ids[:2, 0])
    np.testing.assert_allclose(out.logprob[:2], out.top_logprobs[:2, 0])
    assert np.isneginf(out.top_logprobs[1, 3:]).all()


def test_top_logprobs_computed_only_when_a_row_wants_them() -> None:
    """The top-K is skipped (zeros) when no row asks for it, and identical whenever one does."""
    logits = _logits(31)
    specs = [RowSpec(temperature=0.0), RowSpec(top_k=5)]
    want = _run(logits, specs)
    for wants in ([False, False], [False, True]):
        rows = [dataclasses.replace(s, wants_top_logprobs=w) for s, w in zip(specs, wants)]
        out = jax.tree.map(np.asarray, sample(jnp.asarray(logits), _tensors(rows), jax.random.key(0),
                                              num_top_logprobs=K))
        np.testing.assert_array_equal(out.tokens, want.tokens)
        if any(wants):
            np.testing.assert_array_equal(out.top_ids, want.top_ids)
            np.testing.assert_array_equal(out.top_logprobs, want.top_logprobs)
        else:
            assert not out.top_ids.any() and not out.top_logprobs.any()


def test_padding_rows_are_greedy_and_neutral() -> None:
    t = _tensors([RowSpec(seed=2**40 + 5, position=9, top_k=7)], with_mask=True)
    assert t.temperature.tolist() == [1.0] + [0.0] * (R - 1)
    assert t.seed[0] == 5 and t.has_seed.tolist() == [True] + [False] * (R - 1)
    assert (t.top_k[1:] == 0).all() and (t.top_p == 1).all() and (t.typical_p == 1).all()
    assert (t.repetition_penalty == 1).all() and (t.history == -1).all()
    assert (t.bias_ids == -1).all() and (t.allowed_mask == 0xFFFFFFFF).all()


def test_history_keeps_the_tail_and_flags_outputs() -> None:
    t = _tensors([RowSpec(history=list(range(20)), num_output_tokens=3), RowSpec(history=[4, 5])])
    assert t.history[0].tolist() == list(range(4, 20))
    assert np.flatnonzero(t.history_is_output[0]).tolist() == [13, 14, 15]
    assert t.history[1].tolist() == [4, 5] + [-1] * (H - 2) and not t.history_is_output[1].any()


@pytest.mark.parametrize(
    "spec",
    [
        RowSpec(logit_bias={i: 1.0 for i in range(B + 1)}),
        RowSpec(logit_bias={V: 1.0}),
        RowSpec(allowed_token_ids=[V]),
    ],
)
def test_builder_rejects_what_cannot_be_encoded(spec: RowSpec) -> None:
    with pytest.raises(ValueError):
        _tensors([spec], with_mask=True)



def test_repetition_alone_on_history_ids_equals_the_dense_penalty_bitwise() -> None:
    """The repetition-only path (values written at the history's ids) gives the very bits of the
    whole-vocabulary penalty: repeated ids, padding, logits of both signs, penalties above and below 1."""
    from imp_jax.runtime.execution.sampling import _apply_penalties, _apply_repetition

    rng = np.random.default_rng(7)
    specs = [RowSpec(repetition_penalty=1.05, history=list(rng.integers(0, 12, 14)), num_output_tokens=5),
             RowSpec(repetition_penalty=1.3, history=list(rng.integers(0, V, 40)), num_output_tokens=9),
             RowSpec(repetition_penalty=0.8, history=[3, 3, 3, 5]),
             RowSpec(repetition_penalty=1.7, history=[]),
             RowSpec()]
    t = _tensors(specs)
    for seed in range(4):
        logits = jnp.asarray(_logits(11 + seed))
        sparse, dense = (np.asarray(jax.jit(f)(logits, t)) for f in (_apply_repetition, _apply_penalties))
        np.testing.assert_array_equal(sparse.view(np.uint32), dense.view(np.uint32))
        assert not np.array_equal(sparse, np.asarray(logits))   # something was penalised


def test_first_argmax_is_argmax_with_ties_infinities_and_nans() -> None:
    from imp_jax.runtime.execution.sampling import first_argmax

    x = _logits(3)
    x[1, [5, 9]] = x[1].max() + 1          # a tie: the first wins
    x[2] = -np.inf                          # every token removed
    x[3, [7, 2]] = np.nan                   # NaN wins, the first one
    x[4, 11] = np.inf
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))), np.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))),
                                  np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))


def test_greedy_rows_without_logprobs_take_the_fast_path_to_the_same_tokens() -> None:
    """A batch of greedy rows that read no logprobs skips temperature and truncation: the same
    tokens as the full path (top_k, top_p, min_p keep the largest value, ties included), logprobs 0."""
    logits = _logits(5)
    logits[2, [9, 40]] = logits[2].max() + 2.0                      # a tie at the top: the first wins
    specs = [RowSpec(temperature=0.0, top_k=50, top_p=0.95, repetition_penalty=1.05, history=HIST,
                     num_output_tokens=3),
             RowSpec(temperature=0.0, top_k=3, min_p=0.5, presence_penalty=0.4, history=HIST, num_output_tokens=2),
             RowSpec(temperature=0.0, top_p=0.01, logit_bias={7: 1.5}),
             RowSpec(temperature=0.0, allowed_token_ids=[4, 11, 90]),
             RowSpec(temperature=0.0)]

    def run(wants: bool):
        rows = [dataclasses.replace(s, wants_top_logprobs=wants) for s in specs]
        return jax.tree.map(np.asarray, sample(jnp.asarray(logits), _tensors(rows, True), jax.random.key(0),
                                               num_top_logprobs=K))

    fast, full = run(False), run(True)
    np.testing.assert_array_equal(fast.tokens, full.tokens)
    assert not fast.logprob.any() and full.logprob[: len(specs)].all()   # the fast path computed none
    assert fast.tokens[2] == 9 and fast.tokens[3] in (4, 11, 90)
    for i, s in enumerate(specs):   # and the full path is the reference's argmax
        assert full.tokens[i] == int(np.argmax(ref_logprobs(logits[i], s)))
