"""Where imp_jax keeps files on disk: one rule for every layer (models, kernels, compiled programs)."""
from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafePathError(OSError):
    """A file or directory the server would load code or data from that another user could have written."""


def unsafe_reason(path: Path, allow_root: bool = False) -> str | None:
    """Why `path` must not be trusted (owned by another user, or writable by group or others), or None.

    Native code (kernel libraries, the JAX compilation cache) and model files are loaded from
    `$IMP_JAX_HOME`; a file another local user can write or own could be code they planted. A model
    the operator names by path may also be root's (`allow_root`: a system-wide model directory).
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    if hasattr(os, "getuid") and st.st_uid != os.getuid() and not (allow_root and st.st_uid == 0):
        owners = f"this server's user (uid {os.getuid()})" + (" or root" if allow_root else "")
        return f"{path} is owned by uid {st.st_uid}, not by {owners}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX):
        return f"{path} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def check_safe(path: Path, allow_root: bool = False) -> Path:
    """`path`, or UnsafePathError saying why it must not be loaded."""
    reason = unsafe_reason(path, allow_root)
    if reason is not None:
        raise UnsafePathError(f"refusing {reason}; fix its owner or mode (docs/SECURITY.md)")
    return path


def check_tree(path: Path, allow_root: bool = False) -> Path:
    """`path` and everything under it checked with check_safe (symlinks are checked where they lead)."""
    check_safe(path, allow_root)
    if path.is_dir():
        for entry in sorted(path.rglob("*")):
            check_safe(entry, allow_root)
    return path


def private_dir(path: Path) -> Path:
    """`path` created (with its missing parents) as 0700, then checked with check_safe."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for p in reversed(missing):
        p.mkdir(mode=0o700, exist_ok=True)
    return check_safe(path)


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


# The compilation cache's bound (least recently used entries go first). A bound also makes JAX hold a file lock
# around each entry's write and read: unbounded, a process reading an entry another is still writing (two
# servers or replicas sharing the directory, the test suite's workers) gets a torn executable and crashes.
COMPILATION_CACHE_MAX_BYTES = 8 * 2**30
