"""The start-up kernel self-test (kernels_pallas/self_test.py): a failing non-XLA backend that `auto`
chose falls back to XLA with one warning, one asked for by name stops start-up, and the real CPU kernels
pass it here. And the fallback on a GPU, XLA attention without dynamic skips, reads only its step's
context bucket of block-table columns (runtime/execution/step.py), with the same results."""
from __future__ import annotations

import dataclasses
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.kernels_pallas import AttentionShape, Kernels, self_test
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.kernels_pallas.xla.attention import ragged_paged_attention_xla
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle
from imp_jax.runtime.execution import step as step_module

CPU = jax.local_devices()[0]
F32 = AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), 9, 3, 64, 16)
needs_kernels = pytest.mark.skipif(not (cpu_attention.available() and cpu_gemm.available()),
                                   reason="CPU kernels not built")


@pytest.fixture(autouse=True)
def fresh_verdicts():
    """The self-test remembers its verdicts per process: these tests break backends on purpose, so each
    starts and leaves with none remembered (a failure kept would fail every later engine over to XLA)."""
    self_test._tested.cache_clear()
    yield
    self_test._tested.cache_clear()


def broken(*args, **kwargs):
    raise RuntimeError("Mosaic lowering failed: no such instruction\n(a long trace follows)")


def wrong(q, *args, **kwargs):
    return q + 1.0   # the right shape and dtype, the wrong numbers


def fallback_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "imp_jax.kernels" and r.levelno == logging.WARNING]


@needs_kernels
@pytest.mark.parametrize("fault,reason", [(broken, "RuntimeError: Mosaic lowering failed: no such instruction"),
                                          (wrong, "max abs error")])
def test_auto_falls_back_to_xla_with_one_line_when_the_backend_fails(monkeypatch, caplog, fault, reason):
    monkeypatch.setattr("imp_jax.kernels_pallas.attention.ragged_paged_attention_cpu", fault)
    with caplog.at_level(logging.WARNING, logger="imp_jax.kernels"):
        kernels = self_test.select_tested_kernels(CPU, F32)
    assert kernels.attention == "xla" and kernels.gemm == "exact"
    [line] = fallback_lines(caplog)
    assert line.startswith("attention self-test: cpu failed on this device (") and reason in line
    assert line.endswith("); falling back to xla") and "\n" not in line


@needs_kernels
def test_a_failing_gemm_falls_back_alone(monkeypatch, caplog):
    monkeypatch.setattr(cpu_gemm, "matmul_wt_cpu", lambda x, w, int8_activations=False: x @ w.T.astype(x.dtype) + 1)
    with caplog.at_level(logging.WARNING, logger="imp_jax.kernels"):
        kernels = self_test.select_tested_kernels(CPU, F32)
    assert (kernels.attention, kernels.gemm) == ("cpu", "xla")
    [line] = fallback_lines(caplog)
    assert line.startswith("gemm self-test: exact failed on this device (float32 weights: max abs error")


@needs_kernels
def test_a_backend_named_by_the_operator_that_fails_stops_start_up(monkeypatch):
    monkeypatch.setattr("imp_jax.kernels_pallas.attention.ragged_paged_attention_cpu", broken)
    with pytest.raises(ValueError, match=r"--attention cpu: the start-up self-test failed .*Mosaic lowering"):
        self_test.select_tested_kernels(CPU, F32, attention="cpu")


@needs_kernels
@pytest.mark.parametrize("shape", [F32, AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.uint16), 8, 2, 128, 8,
                                                       sinks=True)], ids=["f32", "bf16_bits_cache_sinks"])
def test_the_cpu_kernels_pass_here(shape, caplog):
    with caplog.at_level(logging.WARNING, logger="imp_jax.kernels"):
        kernels = self_test.select_tested_kernels(CPU, shape)
    assert (kernels.attention, kernels.gemm) == ("cpu", "exact") and not fallback_lines(caplog)
    assert self_test.attention_error(CPU, kernels, shape) is None
    assert self_test.gemm_error(CPU, kernels) is None


KEY_LIMITS = dataclasses.replace(F32, key_limits=True)


@needs_kernels
def test_a_bidirectional_models_self_test_checks_key_limits(monkeypatch):
    """A model with bidirectional image spans (Gemma 3) tests its backend on a batch with key limits: the
    span changes the oracle's answer, the CPU kernel passes, and a kernel that ignores the limits (causal
    only) fails where it passes the causal batch."""
    q, k_cache, v_cache, meta, _ = self_test.tiny_batch(KEY_LIMITS)
    assert np.asarray(meta.key_limit).tolist() == [-1, 6, 6, 6, -1, -1, -1, -1]   # positions 4-6 of the prefill
    oracle = lambda m: np.asarray(ragged_paged_attention_oracle(q, k_cache, v_cache, m, 0, sm_scale=0.125))
    assert np.abs(oracle(meta) - oracle(dataclasses.replace(meta, key_limit=None))).max() > 1e-3
    kernels = Kernels(attention="cpu", gemm="exact")
    assert self_test.attention_error(CPU, kernels, KEY_LIMITS) is None
    real = cpu_attention.ragged_paged_attention_cpu
    causal_only = lambda q, kc, vc, meta, *a, **kw: real(q, kc, vc, dataclasses.replace(meta, key_limit=None), *a, **kw)
    monkeypatch.setattr("imp_jax.kernels_pallas.attention.ragged_paged_attention_cpu", causal_only)
    assert self_test.attention_error(CPU, kernels, F32) is None
    assert "max abs error" in self_test.attention_error(CPU, kernels, KEY_LIMITS)


def test_xla_is_never_tested(monkeypatch):
    """XLA is the reference, and the fallback: choosing it costs no self-test."""
    monkeypatch.setattr(self_test, "attention_error", broken)
    monkeypatch.setattr(self_test, "gemm_error", broken)
    assert self_test.select_tested_kernels(CPU, F32, attention="xla", gemm="xla") == Kernels()


def test_the_tiny_batch_has_a_prefill_decodes_and_padding():
    q, k_cache, _, meta, sinks = self_test.tiny_batch(F32)
    assert q.shape == (8, 9, 64) and k_cache.shape[2:] == (16, 3, 64) and sinks is None
    assert np.asarray(meta.seq_lens).tolist() == [8, 22, 1, 0] and int(meta.num_seqs) == 3
    assert np.asarray(meta.slot_mapping)[7] == -1


def test_context_buckets_are_powers_of_two_only_where_the_attention_walks_a_static_table():
    assert step_module.context_buckets(512, bucketed=True) == [16, 32, 64, 128, 256, 512]
    assert step_module.context_buckets(40, bucketed=True) == [16, 32, 40]
    assert step_module.context_buckets(8, bucketed=True) == [8]
    assert step_module.context_buckets(512, bucketed=False) == [512]   # one program per (T, S), as ever
    assert Kernels(dynamic_skips=False).bucketed_context
    assert not Kernels().bucketed_context and not Kernels(attention="pallas", dynamic_skips=False).bucketed_context


SMALL_PAGES = AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), 4, 2, 32, 4, sinks=True)
MAX_BLOCKS = 64   # the engine's table width (max_model_len 256 in pages of 4)


@pytest.mark.parametrize("seqs,window,soft_cap,sinks,context", [
    (((63, 1), (10, 1)), None, None, False, 16),        # the longest ends on the first bucket's edge
    (((64, 1), (3, 5)), 20, None, False, 32),           # one key past it
    (((100, 28), (0, 1)), None, 5.0, True, 32),         # a prefill chunk up to the second edge
    (((128, 1), (40, 9)), 50, 3.0, True, 64)])          # past it: the whole table
def test_static_xla_attention_over_the_context_bucket_matches_the_oracle(seqs, window, soft_cap, sinks, context):
    """Given only its bucket's columns, the GPU form walks ceil(context / blocks per step) steps, not the
    whole table's, and gives the oracle's output over the whole table."""
    q, k_cache, v_cache, meta, sink_logits = self_test.tiny_batch(SMALL_PAGES, seqs, num_tokens=32, num_slots=4)
    need = -(-int(np.asarray(meta.seq_lens).max()) // 4)   # blocks the longest sequence reaches
    assert min(c for c in step_module.context_buckets(MAX_BLOCKS, True) if c >= need) == context
    table = jnp.pad(meta.block_tables, ((0, 0), (0, MAX_BLOCKS - meta.block_tables.shape[1])))
    full, sliced = (dataclasses.replace(meta, block_tables=t) for t in (table, table[:, :context]))
    kw = dict(sm_scale=32 ** -0.5, sliding_window=window, soft_cap=soft_cap,
              sinks=sink_logits if sinks else None)
    static = lambda *a: ragged_paged_attention_xla(*a, 0, dynamic_skips=False, **kw)
    got = jax.jit(static)(q, k_cache, v_cache, sliced)
    want = jax.jit(lambda *a: ragged_paged_attention_oracle(*a, 0, **kw))(q, k_cache, v_cache, full)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    blocks_per_step = 8   # xla/attention.py's per-row walk for a tile of 32 rows over pages of 4
    assert scan_lengths(jax.make_jaxpr(static)(q, k_cache, v_cache, sliced).jaxpr) == [context // blocks_per_step]


def scan_lengths(jaxpr) -> list[int]:
    """The trip counts of the static loops (scans) in `jaxpr`, nested ones included."""
    return [int(n) for n in re.findall(r"\blength=(\d+)", str(jaxpr))]



def test_an_engine_without_dynamic_skips_reads_context_buckets_and_decodes_greedily_alike(tiny_hf_dir, monkeypatch):
    """The GPU form on this CPU (XLA attention, no dynamic skips) in pages of 4 up to 128 tokens: context
    buckets of 16 and 32 blocks; a 60-token prompt's steps run the 16-block programs up to 64 tokens and
    the whole table past them, and decode the greedy tokens of the model's forward with dynamic skips."""
    from paged import PagedRunner

    from imp_jax import LLM, SamplingParams
    from imp_jax.model.formats.loader import load_model

    prompt = np.random.RandomState(0).randint(0, 256, 60).tolist()
    runner = PagedRunner(load_model(tiny_hf_dir, dtype="float32", kernels=Kernels()).model, num_blocks=24,
                         block_size=4, max_blocks=32)
    _, want = runner.greedy(prompt, 8, table=list(range(1, 18)), num_tokens=64, num_seqs=1)

    contexts = []
    program_key = step_module.CompiledStep._program_key

    def spy(self, T, S, longest):
        key = program_key(self, T, S, longest)
        contexts.append((longest, key[2]))
        return key

    monkeypatch.setattr(step_module.CompiledStep, "_program_key", spy)
    monkeypatch.setattr("imp_jax.runtime.core.builder.select_tested_kernels",
                        lambda *a, **kw: Kernels(dynamic_skips=False))
    llm = LLM(str(tiny_hf_dir), max_num_seqs=1, max_num_batched_tokens=16, max_model_len=128, block_size=4,
              num_kv_blocks=32)
    step = llm.core.step_fn
    assert step.context_buckets == [16, 32] and len(step.buckets) == 2 * len(step_module.step_buckets(16, 1))
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0, max_tokens=8, ignore_eos=True)
    [out] = llm.generate([prompt], params)
    assert out.outputs[0].token_ids == want and step.compilations_after_warmup == 0
    assert {c for longest, c in contexts if longest <= 64} == {16}
    assert {c for longest, c in contexts if longest > 64} == {32}


@needs_kernels
def test_the_verdict_is_remembered_per_device_kernels_and_shape(monkeypatch):
    calls = []
    monkeypatch.setattr(self_test, "attention_error", lambda *a: calls.append(a) or None)
    monkeypatch.setattr(self_test, "gemm_error", lambda *a: None)
    for shape in (F32, F32, dataclasses.replace(F32, head_dim=128)):
        assert self_test.select_tested_kernels(CPU, shape).attention == "cpu"
    assert len(calls) == 2
