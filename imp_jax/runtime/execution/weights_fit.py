"""On a GPU, whether a GGUF's quantised matrices are widened at load (`--quantized-weights auto`).

Kept as blocks, every step dequantises each matrix inside the program: about 4.6 bytes of memory
traffic per weight (the blocks read, the widened copy written and read again) against 2 for a bf16
matrix, so decode, which is bound by the weights' bytes, runs 2-3x slower. Widened at load they take
2 bytes per weight for good. The rule: widen when the widened weights and the KV cache of
`KV_RESERVE_CONTEXTS` full-length sequences fit in the device's free memory (at the
`DEFAULT_GPU_KV_FRACTION` the KV budget itself uses); keep the blocks where they do not, which is
what lets a model that only fits quantised run at all.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from imp_jax.runtime.config import DEFAULT_GPU_KV_FRACTION

FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
KV_RESERVE_CONTEXTS = 2   # full-length sequences whose KV must still fit beside the widened weights


@dataclasses.dataclass(frozen=True)
class WeightsFit:
    choice: str        # "dequantize" | "keep"
    why: str           # one line for the start-up log


def quantized_weights(tensors: Mapping[str, Any]) -> tuple[int, int]:
    """(weights stored quantised, weights in all) of a GGUF's tensors, read from its header only
    (`GGUFTensors.shape`/`qtype`); (0, 0) for tensors that do not say their storage type."""
    if not (hasattr(tensors, "qtype") and hasattr(tensors, "shape")):
        return 0, 0
    quantised = total = 0
    for name in tensors:
        n = math.prod(tensors.shape(name))
        total += n
        if tensors.qtype(name) not in FLOAT_TYPES:
            quantised += n
    return quantised, total


def fit_on_gpu(tensors: Mapping[str, Any], *, itemsize: int, free_bytes: int | None, kv_bytes_per_token: int,
               max_model_len: int, devices: int = 1) -> WeightsFit | None:
    """The choice for a GPU with `free_bytes` free before the weights load (per device; the weights split
    over `devices` with tensor parallelism); None where there are no quantised matrices to decide for."""
    quantised, total = quantized_weights(tensors)
    if not quantised:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB"   # noqa: E731
    widened = total * itemsize // devices
    reserve = KV_RESERVE_CONTEXTS * max_model_len * kv_bytes_per_token
    if free_bytes is None:
        return WeightsFit("keep", "the device does not report its free memory")
    budget = int(free_bytes * DEFAULT_GPU_KV_FRACTION)
    if widened + reserve <= budget:
        return WeightsFit("dequantize", f"widened they take {gib(widened)}, leaving room for the KV cache of "
                          f"{KV_RESERVE_CONTEXTS} x {max_model_len} tokens in {gib(free_bytes)} free: 2 bytes "
                          "read per weight per step instead of dequantising every matrix in every step")
    return WeightsFit("keep", f"widened they would take {gib(widened)}, which with the KV cache of "
                      f"{KV_RESERVE_CONTEXTS} x {max_model_len} tokens ({gib(reserve)}) exceeds "
                      f"{gib(budget)} of {gib(free_bytes)} free; each matrix is dequantised inside the step")
