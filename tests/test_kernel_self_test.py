"""The start-up kernel self-test (kernels_pallas/self_test.py): a failing non-XLA backend that `auto`
chose falls back to XLA with one warning, one asked for by name stops start-up, and the real CPU kernels
pass it here."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from imp_jax.kernels_pallas import AttentionShape, Kernels, self_test
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm

CPU = jax.local_devices()[0]
F32 = AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), 9, 3, 64, 16)
needs_kernels = pytest.mark.skipif(not (cpu_attention.available() and cpu_gemm.available()),
                                   reason="CPU kernels not built")


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
    assert kernels.attention == "xla" and kernels.gemm == "cpu"
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
    assert line.startswith("gemm self-test: cpu failed on this device (float32 weights: max abs error")


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
    assert (kernels.attention, kernels.gemm) == ("cpu", "cpu") and not fallback_lines(caplog)
    assert self_test.attention_error(CPU, kernels, shape) is None
    assert self_test.gemm_error(CPU, kernels) is None


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
