"""The linter over the package, the tests and the scripts: pyflakes' checks (unused imports and variables,
undefined names) and syntax errors, with pyproject.toml's [tool.ruff] settings, find nothing; and the type
checker over the runtime's API ([tool.mypy]'s files: the server-engine contract, the request types, the engine
settings, the offline LLM) finds nothing."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "imp_jax", "tests", "scripts"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_finds_nothing_in_the_runtime_api() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental"], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
