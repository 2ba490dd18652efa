"""Which implementation runs each kernel, chosen once when the engine is built, for its device.

`select_kernels` turns the operator's choice (`--attention`, `--gemm`; `auto` by default) into a
`Kernels` value; the model holds it and passes it to every kernel call, so a compiled program
never looks at the environment. A backend asked for by name where it cannot run is an error. The engine
calls it through `self_test.select_tested_kernels`, which first runs each non-XLA choice against XLA.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax.numpy as jnp

from imp_jax.kernels_pallas.choices import ATTENTION_BACKENDS, CPU_GEMMS, GEMM_BACKENDS, QUANTIZED_CHOICES
from imp_jax.kernels_pallas.cpu import attention as cpu_attention
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.kernels_pallas.metadata import AttentionShape
from imp_jax.kernels_pallas.pallas import shapes as pallas_attention

log = logging.getLogger("imp_jax.kernels")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The kernel implementations a model's programs call; hashable, a static part of the model.

    attention: "xla" (any platform), "cpu" (x86-64 C++ kernel) or "pallas" (Hopper GPU kernel).
    gemm: "xla", "exact" (the x86-64 C++ kernel; it also reads bf16 and GGML-block weights, exactly:
        transformers' float32 products bit for bit) or "cpu_q8" (the same kernel, but GGML blocks meet
        activations rounded to int8 per 32-wide block, llama.cpp's arithmetic: faster, not exact;
        cpu/gemm.py). `auto` picks cpu_q8 for a model whose matrices stay GGML blocks, exact otherwise.
    dynamic_skips: whether programs skip unneeded work with data-dependent branches and loop
        bounds (`lax.cond`, `fori_loop` to a traced bound). A win on a CPU; on XLA:GPU each such
        branch or loop iteration waits for the device to tell the host its predicate.
    pallas_interpret: run the Pallas kernel in the Mosaic GPU interpreter (tests on a CPU;
        `select_kernels` never sets it).
    quantized: what becomes of a GGUF's quantised matrices: "keep" (stored as the file's blocks;
        the CPU GEMM kernel reads them, XLA's dot dequantises each inside the program, so only the
        matrix a step is multiplying is ever widened), "dequantize" (at load) or "auto" (keep where
        the CPU GEMM kernel reads them; `select_kernels` resolves it to "keep" on a GPU).
    """

    attention: str = "xla"
    gemm: str = "xla"
    dynamic_skips: bool = True
    pallas_interpret: bool = False
    quantized: str = "auto"

    def __post_init__(self) -> None:
        if self.gemm not in ("xla", *CPU_GEMMS):   # a stale name would otherwise silently mean XLA
            raise ValueError(f"Kernels.gemm {self.gemm!r}: expected xla, {' or '.join(CPU_GEMMS)}")

    @property
    def cpu_gemm(self) -> bool:
        """Whether projections go to the x86-64 C++ GEMM kernel (exact or cpu_q8), where it takes them."""
        return self.gemm in CPU_GEMMS

    @property
    def reads_narrow_weights(self) -> bool:
        """Whether bf16 matrices pay: only the CPU GEMM kernel reads them as they are; XLA's dot
        would widen them on every call."""
        return self.cpu_gemm

    @property
    def bucketed_context(self) -> bool:
        """Whether step programs come per context length (runtime/execution/step.py): XLA attention without dynamic
        skips walks its block tables to a static bound, so each program hands it only the columns its
        step's longest sequence can reach, not the whole table."""
        return self.attention == "xla" and not self.dynamic_skips

    @property
    def keeps_blocks(self) -> bool:
        """Whether a GGUF's quantised matrices stay as its blocks (`quantized`)."""
        return self.quantized == "keep" or (self.quantized == "auto" and self.reads_narrow_weights)

    def describe(self) -> str:
        return (f"attention={self.attention} gemm={self.gemm} dynamic_skips={self.dynamic_skips} "
                f"quantized={'keep' if self.keeps_blocks else 'dequantize'}")


XLA = Kernels()   # portable: runs anywhere, the default for code that is not handed a choice


def is_hopper(device: Any) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.x), where the Pallas kernel's TMA and
    wgmma run; Blackwell (10.x+) replaced wgmma with tcgen05."""
    if device.platform != "gpu":
        return False
    try:
        return 9.0 <= float(device.compute_capability) < 10.0
    except (AttributeError, TypeError, ValueError):
        return False


def select_kernels(device: Any, shape: AttentionShape, *, attention: str = "auto",
                   gemm: str = "auto", quantized: str = "auto", ggml_blocks: bool = False) -> Kernels:
    """The kernels for a model of attention `shape` on `device` (a jax Device); `ggml_blocks`: the
    checkpoint stores matrices as GGML blocks (a quantised GGUF, or a checkpoint converted from one).

    auto: the Pallas kernel on a Hopper GPU and the C++ kernels on an x86-64 CPU, each where it
    takes the shape (and, for the C++ ones, where they build); XLA everywhere else. The CPU GEMM is
    `cpu_q8` (llama.cpp's int8 arithmetic) where the model's matrices stay GGML blocks, `exact` for
    float weights (`_gemm`; one log line says which and why). Quantised GGUF matrices (`quantized`
    auto): kept as blocks where the CPU GEMM reads them and on GPUs (dequantised inside the program,
    matrix by matrix), dequantised at load by a CPU running XLA's dot.
    """
    if quantized not in QUANTIZED_CHOICES:
        raise ValueError(f"--quantized-weights {quantized!r}: expected one of {', '.join(QUANTIZED_CHOICES)}")
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention {attention!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if gemm not in GEMM_BACKENDS:
        raise ValueError(f"--gemm {gemm!r}: expected one of {', '.join(GEMM_BACKENDS)} (cpu: exact)")
    on_cpu = device.platform == "cpu"
    # on a CPU whose C++ GEMM runs, a float32 model keeps the blocks unless told to dequantise them
    # (model/weights.py WeightFormats): then, and only then, int8 activations have blocks to meet
    blocks_kept = ggml_blocks and quantized != "dequantize" and jnp.dtype(shape.q_dtype) == jnp.float32
    return Kernels(attention=_attention(attention, device, shape, on_cpu), gemm=_gemm(gemm, device, blocks_kept),
                   dynamic_skips=on_cpu, quantized="keep" if quantized == "auto" and not on_cpu else quantized)


def _attention(asked: str, device: Any, shape: AttentionShape, on_cpu: bool) -> str:
    if asked == "pallas":
        if not is_hopper(device):
            raise ValueError(f"--attention pallas needs a Hopper GPU (sm_90); this device is "
                             f"{getattr(device, 'device_kind', device.platform)}")
        if not pallas_attention.supports(shape):
            raise ValueError(f"--attention pallas: the kernel does not take {shape} (it needs 16-bit "
                             f"queries and caches, head_dim a multiple of 64 up to 256, pages of 8k tokens)")
        return "pallas"
    if asked == "cpu":
        if not (on_cpu and cpu_attention.available()):
            raise ValueError("--attention cpu needs an x86-64 CPU with AVX2/FMA/F16C and a C++ compiler "
                             "(see the log for why the kernel did not build)")
        if not cpu_attention.supports(shape):
            raise ValueError(f"--attention cpu: the kernel does not take {shape} (it needs float32 "
                             f"queries and head_dim a multiple of 8)")
        return "cpu"
    if asked == "auto":
        if is_hopper(device) and pallas_attention.supports(shape):
            return "pallas"
        if on_cpu and cpu_attention.supports(shape) and cpu_attention.available():
            return "cpu"
    return "xla"


def _gemm(asked: str, device: Any, blocks_kept: bool) -> str:
    """The GEMM backend for `asked` on `device`; one log line says which and why (a warning where
    the int8 kernel `auto` wanted did not build)."""
    name, why = _gemm_choice(asked, device, blocks_kept)
    fell_back = asked == "auto" and blocks_kept and name != "cpu_q8"
    log.log(logging.WARNING if fell_back else logging.INFO, "gemm: %s (%s)", name, why)
    return name


def _gemm_choice(asked: str, device: Any, blocks_kept: bool) -> tuple[str, str]:
    on_cpu = device.platform == "cpu"
    if asked in CPU_GEMMS:
        if not (on_cpu and cpu_gemm.available(int8_activations=asked == "cpu_q8")):
            raise ValueError(f"--gemm {asked} needs an x86-64 CPU with AVX2/FMA/F16C and a C++ compiler "
                             "(see the log for why the kernel did not build)")
        return asked, f"--gemm {asked}"
    if asked == "xla":
        return "xla", "--gemm xla"
    if not on_cpu:
        return "xla", f"auto: XLA's dot on a {device.platform} device"
    if not cpu_gemm.available():
        return "xla", "auto: the C++ GEMM kernel is not available on this CPU, see the log"
    if not blocks_kept:
        return "exact", "auto: float weights on an x86-64 CPU: transformers' float32 products bit for bit"
    if not cpu_gemm.available(int8_activations=True):
        return "exact", ("auto: the int8-activation kernel for quantised GGUF matrices did not build, see the "
                         "log; the exact products instead")
    return "cpu_q8", "auto: quantised GGUF matrices on an x86-64 CPU; --gemm exact for bit-parity"
