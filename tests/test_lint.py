"""The linter over the package, the tests and the scripts: pyflakes' checks (unused imports and variables,
undefined names) and syntax errors, with pyproject.toml's [tool.ruff] settings, find nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "imp_jax", "tests", "scripts"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
