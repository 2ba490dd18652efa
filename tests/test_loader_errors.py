"""Bad model inputs through load_model(): a ModelLoadError (an ImpError) naming the problem, never a traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from imp_jax.errors import ImpError, ModelLoadError
from imp_jax.model.formats.loader import load_model
from tiny_models import write_arch_only_gguf


def load_error(path: Path | str, **kwargs: Any) -> str:
    """The message of the ModelLoadError load_model raises (fails the test on success or another error)."""
    with pytest.raises(ModelLoadError) as info:
        load_model(path, dtype=kwargs.pop("dtype", "float32"), **kwargs)
    assert isinstance(info.value, ImpError) and info.value.status == 500
    return info.value.message


def edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))


def drop_tensor(path: Path, name: str) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))


def test_the_tiny_dir_itself_loads(tiny_hf_dir):
    assert load_model(tiny_hf_dir, dtype="float32").config.num_layers == 2


def test_missing_weight_file(tiny_hf_dir):
    (tiny_hf_dir / "model.safetensors").unlink()
    assert "no *.safetensors weight file found" in load_error(tiny_hf_dir)


def test_shard_listed_in_index_is_missing(tiny_hf_dir):
    (tiny_hf_dir / "model.safetensors").rename(tiny_hf_dir / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                            "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (tiny_hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "model-00002-of-00002.safetensors" in load_error(tiny_hf_dir)


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_a_weight_file_outside_the_model_folder_is_refused(tiny_hf_dir, how):
    """The index's shard names stay inside the folder: a valid weight file elsewhere (here: this model's
    own, moved out) is not read through `..` or an absolute name."""
    outside = tiny_hf_dir.parent / "elsewhere.safetensors"
    (tiny_hf_dir / "model.safetensors").rename(outside)
    name = "../elsewhere.safetensors" if how == "dotdot" else str(outside)
    keys = load_file(str(outside))
    (tiny_hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(keys, name)}))
    assert "not a file name inside the model folder" in load_error(tiny_hf_dir)


def test_a_hugging_face_cache_snapshot_of_links_loads(tiny_hf_dir, tmp_path):
    """A snapshot folder whose files link to ../../blobs (the Hugging Face cache's layout) is the
    operator's own and loads."""
    from imp_jax.model.formats.loader import open_checkpoint

    blobs, snapshot = tmp_path / "repo" / "blobs", tmp_path / "repo" / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in tiny_hf_dir.iterdir():
        (blobs / f.name).write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../../blobs") / f.name)
    ckpt = open_checkpoint(snapshot)
    assert "model.embed_tokens.weight" in ckpt.tensors


def test_corrupt_weight_file(tiny_hf_dir):
    (tiny_hf_dir / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    msg = load_error(tiny_hf_dir)
    assert "model.safetensors" in msg and "safetensors" in msg


def test_weight_missing_from_safetensors_is_named(tiny_hf_dir):
    drop_tensor(tiny_hf_dir, "model.layers.1.mlp.down_proj.weight")
    assert "weight 'model.layers.1.mlp.down_proj.weight' not found" in load_error(tiny_hf_dir)


def test_weight_of_wrong_shape(tiny_hf_dir):
    tensors = load_file(str(tiny_hf_dir / "model.safetensors"))
    tensors["model.norm.weight"] = np.ones(7, np.float32)
    save_file(tensors, str(tiny_hf_dir / "model.safetensors"))
    assert "shape (7,)" in load_error(tiny_hf_dir)


def test_unknown_architecture(tiny_hf_dir):
    edit_config(tiny_hf_dir, lambda c: c.update(architectures=["FancyForCausalLM"]))
    msg = load_error(tiny_hf_dir)
    assert "unknown architecture 'FancyForCausalLM'" in msg and "LlamaForCausalLM" in msg


def test_unsupported_gguf_architecture(tmp_path):
    write_arch_only_gguf(tmp_path / "mamba.gguf", "mamba")
    assert "GGUF architecture 'mamba' is not supported" in load_error(tmp_path / "mamba.gguf")


def test_config_that_is_not_json(tiny_hf_dir):
    (tiny_hf_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    assert "config.json: malformed JSON" in load_error(tiny_hf_dir)


@pytest.mark.parametrize("edit, expected", [
    (lambda c: c.pop("hidden_size"), "missing 'hidden_size'"),
    (lambda c: c.pop("architectures"), "'architectures' must be a non-empty list"),
    (lambda c: c.update(num_hidden_layers="two"), "'num_hidden_layers' must be int, got 'two'"),
    (lambda c: c.update(num_key_value_heads="x"), "bad value in the model config"),
    (lambda c: c.update(rms_norm_eps="small"), "'small'"),
    (lambda c: c.update(num_key_value_heads=3), "not a multiple of num_key_value_heads 3"),
    (lambda c: c.update(rope_scaling={"rope_type": "dynamic", "factor": 4.0}), "rope_scaling type 'dynamic'"),
], ids=["missing-field", "no-architectures", "wrong-type", "wrong-type-optional", "wrong-type-float",
        "bad-head-ratio", "unsupported-rope"])
def test_bad_config_field_is_named(tiny_hf_dir, edit, expected):
    edit_config(tiny_hf_dir, edit)
    msg = load_error(tiny_hf_dir)
    assert expected in msg and "config.json" in msg


def test_config_that_is_a_list(tiny_hf_dir):
    (tiny_hf_dir / "config.json").write_text("[1, 2]")
    assert "expected a JSON object" in load_error(tiny_hf_dir)


def test_missing_tokenizer_json(tiny_hf_dir):
    (tiny_hf_dir / "tokenizer.json").unlink()
    assert "tokenizer file not found" in load_error(tiny_hf_dir)


def test_malformed_generation_config(tiny_hf_dir):
    (tiny_hf_dir / "generation_config.json").write_text("{oops")
    assert "generation_config.json" in load_error(tiny_hf_dir)


def test_directory_without_a_model(tmp_path):
    assert "not a model directory" in load_error(tmp_path)


def test_unknown_model_name_lists_the_aliases(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = load_error("no-such-model-anywhere")
    assert "'no-such-model-anywhere'" in msg and "smollm2-135m-instruct" in msg


@pytest.mark.parametrize("dtype", ["float16", "fp32", ""])
def test_bad_dtype(tiny_hf_dir, dtype):
    assert f"--dtype {dtype!r}" in load_error(tiny_hf_dir, dtype=dtype)


def test_bad_model_class(tiny_hf_dir):
    assert "--model-class 'nomodule'" in load_error(tiny_hf_dir, model_class="nomodule")


def test_generate_cli_reports_a_missing_model_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "imp_jax.generate", "--model", "/nonexistent", "--prompt", "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "/nonexistent" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
