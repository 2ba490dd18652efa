"""Which exceptions in a step fault the engine (a device fault) and which fail only the step's requests."""
from __future__ import annotations

import jax


def is_device_fault(e: BaseException, multi_host: bool, oom_before: bool) -> bool:
    """A device fault: the runtime reports the device lost or broken, an out-of-memory that repeats (the step
    before failed the same way), or any failure while several processes must stay in lockstep. Anything
    else (a host-side bug, a bad input reaching the step, one out-of-memory) fails the step alone."""
    if multi_host:
        return True
    if not isinstance(e, jax.errors.JaxRuntimeError):
        return False
    if str(e).startswith("RESOURCE_EXHAUSTED"):
        return oom_before
    return True


def is_oom(e: BaseException) -> bool:
    return isinstance(e, jax.errors.JaxRuntimeError) and str(e).startswith("RESOURCE_EXHAUSTED")
