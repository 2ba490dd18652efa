"""The Pallas ragged paged attention kernel (Mosaic GPU interpreter on CPU) and the XLA backend against
the attention oracle, the oracle against float64 NumPy, and the choice of backend."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (CASES, KERNEL_CASES, REFERENCE_CASES, SPLIT_CASES, TOLERANCE, dense_attention,
                             make_batch)

from imp_jax.kernels_pallas import (AttentionMetadata, AttentionShape, Kernels, ragged_paged_attention,
                                    select_kernels)
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.kv_cache import write_kv
from imp_jax.kernels_pallas.pallas import split_kv
from imp_jax.kernels_pallas.pallas.ragged_paged_attention import (_kv_steps, auto_kv_splits,
                                                                  ragged_paged_attention_pallas, supports)
from imp_jax.kernels_pallas.pallas.shapes import SMEM_LIMIT, SMEM_RESERVE, smem_bytes
from imp_jax.kernels_pallas.xla.attention import ragged_paged_attention_xla
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle




@pytest.mark.parametrize("name", list(KERNEL_CASES))
def test_kernel_matches_the_oracle(name: str) -> None:
    case = KERNEL_CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    kw = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window,
              soft_cap=case.soft_cap)

    splits = case.kv_splits or auto_kv_splits(q, k_cache, meta, case.sliding_window)
    assert (splits > 1) == (case.kv_splits != 1), "cases with default splits must exercise split-KV"

    @jax.jit  # one program for both: interpret-mode compiles dominate the test time
    def both(q, k, v, k_cache, v_cache, meta, layer):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, layer)
        return (ragged_paged_attention_oracle(q, k_cache, v_cache, meta, layer, **kw),
                ragged_paged_attention_pallas(q, k_cache, v_cache, meta, layer, **kw, interpret=True,
                                              kv_splits=case.kv_splits))

    want, got = both(q, k, v, k_cache, v_cache, meta, jnp.int32(1))
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    real = int(meta.query_start_loc[meta.num_seqs])
    assert real < case.num_tokens, "every case carries padding rows"
    assert not np.asarray(got[real:], np.float32).any(), "padding rows must be zero"


SINK_CASES = {
    "decode_gqa": CASES["decode_only"],              # 8 heads a kv head, default (auto) splits: 2
    "mixed_window": CASES["mixed_window"],           # prefill + decodes + a window, one split
    "split_16_soft_cap": dataclasses.replace(SPLIT_CASES["split_long_decode"], kv_splits=16),
    # the first slice (the one holding the sinks) sees no key for the chunk's last rows
    "masked_rows_in_the_sink_slice": SPLIT_CASES["split_prefill_window"],
}


@pytest.mark.parametrize("name", list(SINK_CASES))
def test_kernel_with_sinks_matches_the_xla_backend(name: str) -> None:
    """gpt-oss's sinks: a logit per query head in each softmax's denominator, counted once across
    kv slices, never soft-capped; heads of one kv group get different sinks, one dominating."""
    case = SINK_CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case, seed=2)
    sinks = jnp.asarray(np.random.RandomState(4).permutation(np.linspace(-3, 6, q.shape[1])), jnp.float32)
    kw = {"sm_scale": case.head_dim ** -0.5, "sliding_window": case.sliding_window, "soft_cap": case.soft_cap}

    @jax.jit
    def run(q, k, v, k_cache, v_cache, meta, sinks):
        k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, 1)
        return (ragged_paged_attention_xla(q, k_cache, v_cache, meta, 1, **kw, sinks=sinks),
                ragged_paged_attention_oracle(q, k_cache, v_cache, meta, 1, **kw),
                ragged_paged_attention_pallas(q, k_cache, v_cache, meta, 1, **kw, interpret=True,
                                              kv_splits=case.kv_splits, sinks=sinks))

    want, plain, got = (np.asarray(x, np.float32) for x in run(q, k, v, k_cache, v_cache, meta, sinks))
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)
    assert np.abs(want - plain).max() > 10 * tol, "the sinks must change the output"
    real = int(meta.query_start_loc[meta.num_seqs])
    assert not got[real:].any(), "padding rows must be zero"


IMPLEMENTATIONS = {
    "oracle": ragged_paged_attention_oracle,
    "xla": ragged_paged_attention_xla,
    "xla_static": functools.partial(ragged_paged_attention_xla, dynamic_skips=False),   # GPU form
}


@pytest.mark.parametrize("impl", list(IMPLEMENTATIONS))
@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_xla_attention_and_the_oracle_match_dense_numpy(name: str, impl: str) -> None:
    case = REFERENCE_CASES[name]
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    k_cache, v_cache = write_kv(k_cache, v_cache, k, v, meta.slot_mapping, 1)
    got = jax.jit(lambda *a: IMPLEMENTATIONS[impl](*a, sm_scale=case.head_dim ** -0.5,
                                                   sliding_window=case.sliding_window, soft_cap=case.soft_cap))(
        q, k_cache, v_cache, meta, 1)
    want = dense_attention(case, q, k_cache, v_cache, meta, 1)
    tol = TOLERANCE[case.dtype]
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("kv_splits", [1, None, 16])
@pytest.mark.parametrize("group,head_dim,block_size,dtype,window,cap,sinks", [
    (1, 128, 16, jnp.bfloat16, None, None, False), (3, 64, 32, jnp.float16, 40, 5.0, True),
    (8, 128, 16, jnp.bfloat16, None, 30.0, False), (128, 64, 64, jnp.bfloat16, 100, None, False),
    (2, 256, 16, jnp.bfloat16, None, None, True),
    (8, 64, 16, jnp.bfloat16, 128, None, True)])    # gpt-oss: 64 heads / 8 kv heads, sinks, window 128
def test_kernel_lowers_to_mosaic_gpu(group: int, head_dim: int, block_size: int, dtype: type,
                                     window: int | None, cap: float | None, sinks: bool,
                                     kv_splits: int | None) -> None:
    """Cross-platform lowering runs the whole Pallas -> Mosaic GPU pipeline (layouts, TMA, wgmma
    shape rules) on CPU; only PTX compilation and the run itself need the GPU. Split-KV adds f32
    partial and lse tile stores in a second SMEM scope (head_dim 256: it must reuse the first's)."""
    t, s, kvh = 64, 8, 2
    q = jax.ShapeDtypeStruct((t, kvh * group, head_dim), dtype)
    cache = jax.ShapeDtypeStruct((2, 32, block_size, kvh, head_dim), dtype)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    meta = AttentionMetadata(i32(s + 1), i32(s), i32(s, 16), i32(t), i32())
    sink = jax.ShapeDtypeStruct((kvh * group,), jnp.float32) if sinks else None
    fn = jax.jit(lambda *a, sinks=None: ragged_paged_attention_pallas(
        *a, sm_scale=0.1, sliding_window=window, soft_cap=cap, kv_splits=kv_splits, sinks=sinks))
    text = fn.trace(q, cache, cache, meta, i32(), sinks=sink).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "wgmma.mma_async" in text


@pytest.mark.parametrize("window", [None, 1, 20, 64, 100, 1000])
def test_a_work_item_walks_only_the_kv_steps_its_rows_can_see(window: int | None) -> None:
    """`_kv_steps`: [lo, end) are exactly the block_kv steps holding a key some row of the item sees
    (keys pos0 - window + 1 .. pos0 + rows - 1), so pages wholly before the window are never fetched."""
    rng = np.random.RandomState(5)
    pos0 = rng.randint(0, 3000, 200)
    rows = rng.randint(0, 65, 200)
    work = _kv_steps(jnp.asarray(np.stack([np.zeros_like(pos0), pos0, rows], 1), jnp.int32), 64, window)
    for (p, n), (lo, end) in zip(zip(pos0, rows), np.asarray(work)[:, 3:5]):
        first = 0 if window is None else max(0, p - window + 1)
        seen = {k // 64 for k in range(first, p + n)} if n else set()   # empty items walk nothing
        assert set(range(lo, end)) == seen, (p, n, lo, end)


def test_default_kv_splits_fill_the_gpu_only_when_programs_are_few() -> None:
    """The static rule: about one wave of NUM_SMS programs, at most 16 slices, no more slices than
    kv steps; many work items (prefill buckets) keep one."""
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    meta = lambda t, s, pages: AttentionMetadata(i32(s + 1), i32(s), i32(s, pages), i32(t), i32())
    q = lambda t, heads, d=128: jax.ShapeDtypeStruct((t, heads, d), jnp.bfloat16)
    cache = lambda kvh, bs=16, d=128: jax.ShapeDtypeStruct((1, 64, bs, kvh, d), jnp.bfloat16)
    assert auto_kv_splits(q(1, 32), cache(8), meta(1, 1, 2048)) == 16            # batch-1 decode, 32k context
    assert auto_kv_splits(q(1, 32), cache(8), meta(1, 1, 12)) == 3               # 192 keys: 3 steps
    assert auto_kv_splits(q(1, 32), cache(8), meta(1, 1, 2048), sliding_window=100) == 3
    assert auto_kv_splits(q(16, 9, 64), cache(3, d=64), meta(16, 16, 512)) == 2  # SmolLM2, 16 decodes
    assert auto_kv_splits(q(512, 32), cache(8), meta(512, 32, 512)) == 1         # prefill bucket
    assert split_kv.default_kv_splits(66, 1, 100) == 2 and split_kv.default_kv_splits(67, 1, 100) == 1


def test_the_wave_is_the_devices_sm_count(monkeypatch) -> None:
    """A GPU's own SM count (jax's core_count) sizes the wave: an H100 PCIe's 114, not the SXM's 132."""
    pcie = SimpleNamespace(platform="gpu", core_count=114)
    monkeypatch.setattr(split_kv.jax, "devices", lambda *a: [pcie])
    split_kv.num_sms.cache_clear()
    try:
        assert split_kv.num_sms() == 114
        assert split_kv.default_kv_splits(57, 1, 100) == 2 and split_kv.default_kv_splits(58, 1, 100) == 1
    finally:
        monkeypatch.undo()
        split_kv.num_sms.cache_clear()
    assert split_kv.num_sms() == split_kv.NUM_SMS   # this CPU: the default


def shape(dtype, head_dim: int = 128, block_size: int = 16, cache=None) -> AttentionShape:
    return AttentionShape(jnp.dtype(dtype), jnp.dtype(cache or dtype), 32, 8, head_dim, block_size)


def test_supports_only_what_the_compiled_kernel_takes() -> None:
    assert supports(shape(jnp.bfloat16))
    assert supports(shape(jnp.float16, head_dim=64, block_size=32))
    assert not supports(shape(jnp.float32))                      # tf32 wgmma: not wired
    assert not supports(shape(jnp.bfloat16, cache=jnp.float32))
    assert not supports(shape(jnp.bfloat16, head_dim=80))
    assert not supports(shape(jnp.bfloat16, block_size=12))      # pages off the 8-row tile
    assert supports(dataclasses.replace(shape(jnp.bfloat16, head_dim=64), sinks=True))   # gpt-oss


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("heads, kv_heads", [(32, 8), (64, 8), (128, 1)])
def test_no_accepted_shape_overflows_shared_memory(head_dim: int, block_size: int, heads: int, kv_heads: int) -> None:
    """Every shape supports() accepts fits Hopper's 227 KiB a block may use: the shapes that measured
    over it when lowered for CUDA (head 256 with 128-key pages or more: 314408 bytes and up; head 128
    with 256-key pages) are refused, the usual ones (head 64/128 with 16-key pages) taken."""
    s = AttentionShape(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), heads, kv_heads, head_dim, block_size)
    used = smem_bytes(s)
    assert supports(s) == (used <= SMEM_LIMIT)
    if (head_dim, block_size) in ((256, 128), (256, 256), (128, 256)):
        assert not supports(s) and used > 314408 - SMEM_RESERVE
    if block_size == 16 and head_dim <= 128:
        assert supports(s)


def test_auto_picks_pallas_on_hopper_for_gpt_oss() -> None:
    """`auto` on a Hopper GPU takes the Pallas kernel for gpt-oss's shape (bf16, 64 heads / 8 kv
    heads of 64, sinks); a Blackwell GPU stays on XLA. Devices stand in by the attributes read."""
    gpt_oss = AttentionShape(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), 64, 8, 64, 16, sinks=True)
    gpu = lambda cc: SimpleNamespace(platform="gpu", compute_capability=cc, device_kind=f"sm_{cc}")
    assert select_kernels(gpu("9.0"), gpt_oss).attention == "pallas"
    assert select_kernels(gpu("9.0"), gpt_oss, attention="pallas").attention == "pallas"
    assert select_kernels(gpu("10.0"), gpt_oss).attention == "xla"


def test_backends_are_chosen_once_and_pallas_needs_a_hopper_gpu() -> None:
    cpu = jax.local_devices()[0]
    auto = select_kernels(cpu, shape(jnp.float32, head_dim=64))
    assert auto.attention in ("cpu", "xla") and auto.dynamic_skips   # a CPU: its kernel where it builds
    assert select_kernels(cpu, shape(jnp.float32), attention="xla", gemm="xla") == Kernels()
    with pytest.raises(ValueError, match="Hopper"):
        select_kernels(cpu, shape(jnp.bfloat16), attention="pallas")
    with pytest.raises(ValueError, match="expected one of"):
        select_kernels(cpu, shape(jnp.float32), attention="bogus")


def test_entry_point_dispatch() -> None:
    """The one entry point writes K/V and runs the backend `kernels` names, with equal results."""
    case = CASES["mixed_soft_cap"]
    q, k, v, k_cache, v_cache, meta = make_batch(case, seed=1)
    outs = {}
    for name, kernels in {"xla": Kernels(), "pallas": Kernels(attention="pallas", pallas_interpret=True)}.items():
        fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=0.125, soft_cap=case.soft_cap, kernels=kernels))
        outs[name] = fn(q, k, v, k_cache, v_cache, meta, 0)
    for want, got in zip(outs["xla"], outs["pallas"]):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_tiny_model_greedy_tokens_match(tmp_path: Path) -> None:
    from paged import PagedRunner
    from tiny_models import write_tiny_hf

    from imp_jax.model.base import ModelOptions
    from imp_jax.model.config import ModelConfig
    from imp_jax.model.formats.loader import SafetensorsDir, build_from_tensors
    from imp_jax.model.registry import get_model_class
    from imp_jax.model.weights import WeightSource

    write_tiny_hf("LlamaForCausalLM", tmp_path)
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    backends = {"xla": Kernels(), "xla_static": Kernels(dynamic_skips=False),
                "pallas": Kernels(attention="pallas", pallas_interpret=True)}
    if cpu_attention.available():
        backends["cpu"] = Kernels(attention="cpu", gemm="exact")
    prompt = np.random.RandomState(3).randint(0, cfg.vocab_size, size=11).tolist()
    tokens = {}
    for name, kernels in backends.items():
        model = build_from_tensors(get_model_class(cfg.architecture), cfg, WeightSource(SafetensorsDir(tmp_path)),
                                   ModelOptions(kernels=kernels))
        table = [3, 1, 4]   # deliberately not in order
        tokens[name] = PagedRunner(model).greedy(prompt, 9, table, num_tokens=16, num_seqs=2)[1]
    assert all(t == tokens["xla"] for t in tokens.values()), tokens
