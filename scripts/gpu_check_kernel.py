"""The Pallas attention kernel against the attention oracle: compiled on a Hopper GPU, interpreted
(Mosaic GPU interpreter, a small subset) on a CPU with --interpret.

Runs the kernel test cases of tests/test_pallas_attention.py (float32 ones as bfloat16: the compiled
kernel takes 16-bit caches only) plus GPU-sized ones (batch-1 decode at 32k, a batch of 8 long decodes,
a windowed prefill) and gpt-oss's layout with attention sinks (cases named `+sinks`: a logit per
head, one of them dominating), each at kv_splits 1, the default rule's count and a forced count, and
checks the error against the case's dtype tolerance and that padding rows are zero. A failing variant
is run again under the other Mosaic GPU lowering mode (Lane / Warpgroup) when the kernel takes one,
so the output says whether pinning the mode fixes it. Exit status 1 on any failure.

    python scripts/gpu_check_kernel.py --out kernel.json            # on an H100/H200
    python scripts/gpu_check_kernel.py --interpret --out kernel.json  # CPU dry run
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_cases import KERNEL_CASES, TOLERANCE, Case, make_batch  # noqa: E402

from imp_jax.kernels_pallas.backends import is_hopper  # noqa: E402
from imp_jax.kernels_pallas.kv_cache import write_kv  # noqa: E402
from imp_jax.kernels_pallas.pallas.ragged_paged_attention import (  # noqa: E402
    auto_kv_splits, ragged_paged_attention_pallas)
from imp_jax.kernels_pallas.xla.oracle import ragged_paged_attention_oracle  # noqa: E402

GPU_CASES = {
    # 16 splits by default: 2048 kv steps of 64 keys, 128 per slice
    "gpu_decode_32k": Case(((32767, 1),), group=4, head_dim=128, block_size=16, dtype=jnp.bfloat16,
                           num_tokens=2, num_slots=2, kv_heads=8),
    # 16 work items x 8 kv heads: the rule keeps 1 split; the forced count checks split-KV at scale
    "gpu_decode_batch8": Case(((8191, 1), (4000, 1), (100, 1), (0, 1), (2047, 1), (16383, 1), (5, 1),
                               (12000, 1)), group=4, head_dim=128, block_size=16, dtype=jnp.bfloat16,
                              num_tokens=16, num_slots=16, kv_heads=8, soft_cap=30.0),
    "gpu_prefill_window": Case(((2000, 512), (0, 300), (700, 1)), group=4, head_dim=128, block_size=16,
                               dtype=jnp.float16, num_tokens=832, num_slots=4, kv_heads=8,
                               sliding_window=1024),
}
# gpt-oss-20b's attention: 64 heads over 8 kv heads of 64, sinks, window 128 on every other layer
GPT_OSS = {"group": 8, "head_dim": 64, "block_size": 16, "dtype": jnp.bfloat16, "kv_heads": 8}
SINK_CASES = {
    "gpt_oss_decode_batch8+sinks": Case(((8191, 1), (100, 1), (0, 1), (2047, 1), (16383, 1), (5, 1), (700, 1),
                                         (4000, 1)), num_tokens=16, num_slots=16, **GPT_OSS),
    "gpt_oss_mixed_window+sinks": Case(((1000, 300), (0, 40), (5000, 1), (130, 1)), num_tokens=352, num_slots=4,
                                       sliding_window=128, **GPT_OSS),
    "split_prefill_window+sinks": KERNEL_CASES["split_prefill_window"],
}
INTERPRETED = ("decode_only", "split_prefill_window+sinks")   # CPU dry run: seconds each
FORCED_SPLITS = 5


def lowering_keyword() -> tuple[str, object, object] | None:
    """(keyword, default mode, the other mode) of the kernel's lowering-mode parameter, None when this
    build of the kernel has none. Found by name, so the check runs before and after the kernel grows it."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    modes = list(plgpu.LoweringSemantics)
    for name, param in inspect.signature(ragged_paged_attention_pallas).parameters.items():
        if "lowering" not in name and "semantics" not in name:
            continue
        if isinstance(param.default, str):   # a keyword that takes the mode's name
            return name, param.default, next(m.name.lower() for m in modes if m.name.lower() != param.default.lower())
        default = param.default if param.default in modes else plgpu.LoweringSemantics.Lane   # Pallas' default
        return name, default, next(m for m in modes if m != default)
    return None


def run_variant(args: tuple, kw: dict, kv_splits: int | None, interpret: bool, want: np.ndarray, real: int,
                tol: float) -> dict:
    """One compiled (or interpreted) variant against the oracle: error, padding rows, finiteness, timings."""
    row: dict = {}
    try:
        kernel = jax.jit(lambda *a: ragged_paged_attention_pallas(*a, **kw, interpret=interpret, kv_splits=kv_splits))
        t0 = time.perf_counter()
        got = jax.block_until_ready(kernel(*args))
        row["first_call_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        jax.block_until_ready(kernel(*args))
        row["call_ms"] = (time.perf_counter() - t0) * 1e3
        got = np.asarray(got, np.float32)
    except Exception as e:  # noqa: BLE001 - a failing variant is a result
        return dict(row, ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
    diff = np.abs(got[:real] - want[:real])
    row.update(max_abs_err=float(diff.max()), tolerance=tol, padding_zero=not got[real:].any(),
               finite=bool(np.isfinite(got).all()))
    row["ok"] = row["finite"] and row["padding_zero"] and bool((diff <= tol + tol * np.abs(want[:real])).all())
    return row


def other_mode(args: tuple, kw: dict, kv_splits: int | None, interpret: bool, want: np.ndarray, real: int,
               tol: float) -> dict:
    """A failing variant rerun under the other lowering mode: does pinning the mode fix it?"""
    keyword = lowering_keyword()
    if keyword is None:
        return dict(mode=None, note="other mode: not available in this build")
    name, default, other = keyword
    row = run_variant(args, {**kw, name: other}, kv_splits, interpret, want, real, tol)
    return dict(row, mode=str(getattr(other, "name", other)), default_mode=str(getattr(default, "name", default)))


def check_case(name: str, case: Case, splits: list[int | None], interpret: bool,
               force_other_mode: bool = False) -> list[dict]:
    """One case against the oracle at each kv_splits (None: the default rule; a count the default
    already chose is not run twice); a failing variant (every one with `force_other_mode`) also
    under the other lowering mode."""
    q, k, v, k_cache, v_cache, meta = make_batch(case)
    kw = dict(sm_scale=case.head_dim ** -0.5, sliding_window=case.sliding_window, soft_cap=case.soft_cap)
    if name.endswith("+sinks"):
        heads = q.shape[1]
        kw["sinks"] = jnp.asarray(np.random.RandomState(4).permutation(np.linspace(-3, 6, heads)), jnp.float32)
    auto = auto_kv_splits(q, k_cache, meta, case.sliding_window)
    k_cache, v_cache = jax.jit(write_kv)(k_cache, v_cache, k, v, meta.slot_mapping, 1)
    args = (q, k_cache, v_cache, meta, jnp.int32(1))
    want = np.asarray(jax.jit(lambda *a: ragged_paged_attention_oracle(*a, **kw))(*args), np.float32)
    real = int(meta.query_start_loc[meta.num_seqs])
    tol = TOLERANCE[case.dtype]
    rows: list[dict] = []
    for kv_splits in splits:
        used = auto if kv_splits is None else kv_splits
        if any(r["kv_splits"] == used for r in rows):
            continue
        row = dict(case=name, dtype=jnp.dtype(case.dtype).name, kv_splits=used, default=kv_splits is None,
                   tokens=case.num_tokens, max_context=max(s + n for s, n in case.seqs))
        row.update(run_variant(args, kw, kv_splits, interpret, want, real, tol))
        if not row["ok"] or force_other_mode:
            row["other_mode"] = other_mode(args, kw, kv_splits, interpret, want, real, tol)
        rows.append(row)
    return rows


def describe(row: dict) -> str:
    """A variant's error (or exception), padding check and call time, for one line of output."""
    return row.get("error") or (f"err {row['max_abs_err']:.2e} (tol {row['tolerance']:.0e}) "
                                f"padding {'zero' if row['padding_zero'] else 'NONZERO'} {row['call_ms']:.3f} ms")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--interpret", action="store_true", help="CPU: the Mosaic GPU interpreter, a small subset")
    p.add_argument("--other-mode-always", action="store_true",
                   help="rerun every variant under the other lowering mode, not only failing ones (the dry run)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args()
    device = jax.local_devices()[0]
    if not a.interpret and not is_hopper(device):
        print(f"no Hopper GPU here ({device.device_kind}); pass --interpret for the CPU dry run", file=sys.stderr)
        return 2
    if a.interpret:
        cases = {n: {**KERNEL_CASES, **SINK_CASES}[n] for n in INTERPRETED}
    else:  # the compiled kernel takes 16-bit caches: float32 cases run as bfloat16
        cases = {n: c if c.dtype != jnp.float32 else dataclasses.replace(c, dtype=jnp.bfloat16)
                 for n, c in {**GPU_CASES, **SINK_CASES, **KERNEL_CASES}.items()}
    how = "interpreted" if a.interpret else "compiled"
    print(f"device {device.device_kind}; jax {jax.__version__}; kernel {how}")
    rows = []
    for name, case in cases.items():
        splits = [None] if a.interpret else [1, None, FORCED_SPLITS]   # dry run: the default rule's count only
        for row in check_case(name, case, splits, a.interpret, a.other_mode_always):
            rows.append(row)
            print(f"{'ok  ' if row['ok'] else 'FAIL'} {name:28s} {row['dtype']:8s} splits {row['kv_splits']:2d}"
                  f"{' (default)' if row['default'] else '          '} {describe(row)}", flush=True)
            if "other_mode" in row:
                o = row["other_mode"]
                print(f"     {'':28s} other lowering mode {o['mode']}: "
                      f"{o['note'] if o['mode'] is None else ('ok, ' if o['ok'] else 'FAIL, ') + describe(o)}")
        if a.out:  # after every case, so a run stopped part way keeps what it checked
            Path(a.out).write_text(json.dumps(dict(device=device.device_kind, jax=jax.__version__,
                                                   interpret=a.interpret, rows=rows), indent=1))
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
