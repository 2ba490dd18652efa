"""Where imp_jax keeps files on disk: one rule for every layer (models, kernels, compiled programs)."""
from __future__ import annotations

import os
from pathlib import Path


def imp_jax_home(home: str | os.PathLike[str] | None = None) -> Path:
    """`home`, else `$IMP_JAX_HOME` (an empty value counts as unset), else `~/.cache/imp_jax`."""
    return Path(home or os.environ.get("IMP_JAX_HOME") or "~/.cache/imp_jax").expanduser()


def models_dir(home: str | os.PathLike[str] | None = None) -> Path:
    """Fetched model aliases: `<home>/models/<alias>/`."""
    return imp_jax_home(home) / "models"


def kernels_dir() -> Path:
    """Built C++ CPU kernel libraries."""
    return imp_jax_home() / "kernels"


def compilation_cache_dir() -> Path:
    """JAX's persistent compilation cache."""
    return imp_jax_home() / "jax_cache"
