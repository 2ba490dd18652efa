"""Converted checkpoints: bit-identical logits to the source, tokenizer round-trip, the CLI, bad markers."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from imp_jax.convert import main, save_converted
from imp_jax.errors import ModelLoadError
from imp_jax.kernels_pallas import AttentionMetadata
from imp_jax.model.formats.hub import CONVERTED_MARKER, classify_path
from imp_jax.model.formats.loader import load_model
from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch
from support.models import same_params
from tiny_models import ARCHS, write_tiny_hf, write_tiny_tokenizer

TEXTS = ["hello world", "the quick brown fox <|im_end|> jumps", "", " 12345!"]


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, kv, input_ids, positions, meta):
    model = nnx.merge(graphdef, state)
    hidden, _ = model(input_ids, positions, kv, meta)
    return model.logits(hidden)


def prefill_logits(model, ids: list[int], num_tokens: int = 16) -> np.ndarray:
    """Logits [len(ids), vocab] of one prefill through a fresh paged cache (jit shared by equal models)."""
    block_size, max_blocks = 16, 4
    b = build_step_batch([SeqChunk(ids, 0, [1, 2, 3])], num_tokens=num_tokens, num_seqs=1,
                         max_blocks=max_blocks, block_size=block_size)
    shape = model.kv_cache_shape(8, block_size)
    kv = (jnp.zeros(shape, model.dtype), jnp.zeros(shape, model.dtype))
    meta = AttentionMetadata(jnp.asarray(b.query_start_loc), jnp.asarray(b.seq_lens),
                             jnp.asarray(b.block_tables), jnp.asarray(b.slot_mapping), jnp.asarray(b.num_seqs))
    graphdef, state = nnx.split(model)
    out = _forward(graphdef, state, kv, jnp.asarray(b.input_ids), jnp.asarray(b.positions), meta)
    return np.asarray(out)[:len(ids)]


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_converted_model_gives_identical_logits(arch, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_tiny_hf(arch, src)
    write_tiny_tokenizer(src)
    assert main([str(src), str(dst)]) == 0
    assert classify_path(dst) == "converted"
    ours, theirs = load_model(dst, dtype="float32"), load_model(src, dtype="float32")
    assert ours.config == theirs.config
    same_params(ours.model, theirs.model)
    ids = [5, 17, 33, 2, 99, 140, 7]
    assert np.array_equal(prefill_logits(ours.model, ids), prefill_logits(theirs.model, ids))


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
def test_bfloat16_load_is_identical_to_bfloat16_source(stored, tiny_hf_dir, tmp_path):
    dst = tmp_path / "dst"
    assert main([str(tiny_hf_dir), str(dst), "--dtype", stored]) == 0
    assert json.loads((dst / CONVERTED_MARKER).read_text())["dtype"] == stored
    ours, theirs = load_model(dst, dtype="bfloat16"), load_model(tiny_hf_dir, dtype="bfloat16")
    same_params(ours.model, theirs.model)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    assert np.array_equal(prefill_logits(ours.model, ids), prefill_logits(theirs.model, ids))


def test_a_bf16_source_converts_with_its_bf16_matrices_kept(tiny_hf_dir, tmp_path):
    """A bf16 checkpoint loaded in float32 keeps its matrices bf16 on a CPU with the GEMM kernel
    (model/weights.py); its conversion restores to the same mixed-dtype parameters and logits."""
    from ml_dtypes import bfloat16
    from safetensors.numpy import load_file, save_file

    weights = tiny_hf_dir / "model.safetensors"
    save_file({k: v.astype(bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    dst = tmp_path / "dst"
    assert main([str(tiny_hf_dir), str(dst)]) == 0
    ours, theirs = load_model(dst, dtype="float32"), load_model(tiny_hf_dir, dtype="float32")
    same_params(ours.model, theirs.model)
    ids = [2, 7, 1, 8, 2, 8, 1]
    assert np.array_equal(prefill_logits(ours.model, ids), prefill_logits(theirs.model, ids))


def test_layer_loop_is_chosen_at_load_time(tiny_hf_dir, tmp_path):
    save_converted(load_model(tiny_hf_dir, dtype="float32"), tmp_path / "dst")
    scan = load_model(tmp_path / "dst", dtype="float32", layer_loop="scan")
    unroll = load_model(tmp_path / "dst", dtype="float32", layer_loop="unroll")
    assert (scan.model.options.layer_loop, unroll.model.options.layer_loop) == ("scan", "unroll")
    ids = [8, 6, 7, 5, 3, 0, 9]
    np.testing.assert_allclose(prefill_logits(scan.model, ids), prefill_logits(unroll.model, ids),
                               rtol=1e-5, atol=1e-5)


def test_tokenizer_and_generation_config_round_trip(tiny_hf_dir, tmp_path):
    src = load_model(tiny_hf_dir, dtype="float32")
    save_converted(src, tmp_path / "dst")
    got = load_model(tmp_path / "dst", dtype="float32")
    a, b = src.tokenizer, got.tokenizer
    for text in TEXTS:
        assert b.encode(text) == a.encode(text), text
        assert b.encode(text, add_special_tokens=False) == a.encode(text, add_special_tokens=False)
        assert b.decode(a.encode(text)) == a.decode(a.encode(text))
    assert (b.bos_token, b.eos_token, b.pad_token, b.unk_token) == (a.bos_token, a.eos_token, a.pad_token,
                                                                    a.unk_token)
    assert (b.add_bos, b.add_eos, b.eos_ids, b.special_ids) == (a.add_bos, a.add_eos, a.eos_ids, a.special_ids)
    assert b.add_bos and b.eos_ids == {1, 3}
    assert b.chat_templates == a.chat_templates and set(b.chat_templates) == {"default", "tool_use"}
    chat = [{"role": "user", "content": "hi"}]
    assert b.apply_chat_template(chat) == a.apply_chat_template(chat)
    assert got.generation_config == src.generation_config


@pytest.mark.real_model
def test_smollm2_gguf_tokenizer_round_trips(smollm2_loaded, tmp_path):
    """GGUF tokenizers are built in code; the converted tokenizer.json must reproduce them."""
    from imp_jax.convert import write_tokenizer
    from imp_jax.model.text.tokenizer import Tokenizer

    write_tokenizer(smollm2_loaded.tokenizer, tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps(smollm2_loaded.generation_config))
    a, b = smollm2_loaded.tokenizer, Tokenizer.from_hf_dir(tmp_path)
    for text in ["Hello world", "héllo 日本語 🙂", "<|im_start|>user\nhi<|im_end|>\n", "def f(x):\n    return x"]:
        assert b.encode(text) == a.encode(text), text
    assert (b.bos_id, b.eos_id, b.eos_ids, b.add_bos, b.has_fim) == (a.bos_id, a.eos_id, a.eos_ids, a.add_bos,
                                                                     a.has_fim)
    assert b.chat_templates == a.chat_templates



def test_cli_refuses_a_non_empty_destination(tiny_hf_dir, tmp_path, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("x")
    assert main([str(tiny_hf_dir), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "Traceback" not in err
    assert (dst / "keep.txt").exists()


def test_cli_reports_a_bad_source_in_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: model '") and "Traceback" not in "".join(err)
    assert not (tmp_path / "dst" / CONVERTED_MARKER).exists()


@pytest.fixture
def converted(tiny_hf_dir, tmp_path) -> Path:
    save_converted(load_model(tiny_hf_dir, dtype="float32"), tmp_path / "dst")
    return tmp_path / "dst"


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.update(format_version=99), "format version 99"),
    (lambda m: m.update(format="other"), "not an imp_jax converted checkpoint"),
    (lambda m: m.update(dtype="float16"), "'dtype'"),
    (lambda m: m["model_config"].update(num_layers="many"), "'num_layers' must be int"),
    (lambda m: m["model_config"].pop("hidden_size"), "bad 'model_config'"),
    (lambda m: m.update(quantized={"embed": "Q3"}), "'quantized' must map"),
])
def test_bad_marker_is_a_model_load_error(converted, edit, match):
    marker_file = converted / CONVERTED_MARKER
    marker = json.loads(marker_file.read_text())
    edit(marker)
    marker_file.write_text(json.dumps(marker))
    with pytest.raises(ModelLoadError, match=match):
        load_model(converted, dtype="float32")


def test_malformed_marker_json_is_a_model_load_error(converted):
    (converted / CONVERTED_MARKER).write_text("{not json")
    with pytest.raises(ModelLoadError, match="malformed JSON"):
        load_model(converted, dtype="float32")


def test_missing_or_mismatched_weights_are_model_load_errors(converted):
    marker_file = converted / CONVERTED_MARKER
    marker = json.loads(marker_file.read_text())
    marker["model_config"]["hidden_size"] = 32  # the stored arrays no longer fit the model
    marker_file.write_text(json.dumps(marker))
    with pytest.raises(ModelLoadError, match=r"weights do not fit the model \(\['embed'\] stored \(256, 64\), "
                                             r"model expects \(256, 32\)"):
        load_model(converted, dtype="float32")
    import shutil

    shutil.rmtree(converted / "state")
    with pytest.raises(ModelLoadError, match="weights directory missing"):
        load_model(converted, dtype="float32")


@pytest.mark.real_model
def test_smollm2_gguf_converted_gives_identical_logits(smollm2_loaded, tmp_path):
    save_converted(smollm2_loaded, tmp_path / "smollm2", source="smollm2-135m-instruct")
    got = load_model(tmp_path / "smollm2", dtype="float32", gemm="exact")   # as smollm2_loaded
    assert got.config == smollm2_loaded.config
    ids = smollm2_loaded.tokenizer.encode("The capital of France is")
    assert np.array_equal(prefill_logits(got.model, ids), prefill_logits(smollm2_loaded.model, ids))


@pytest.mark.parametrize("quantize, fmt, tol", [("int8", "Q8_0", 0.02), ("int4", "Q4_1", 0.2)])
def test_weight_only_quantised_checkpoint(quantize, fmt, tol, tiny_hf_dir, tmp_path):
    """`--quantize int8|int4` stores every projection matrix (embedding and LM head too) as Q8_0 / Q4_1
    blocks of 32-weight groups: the CPU GEMM kernel keeps them (a quarter / an eighth of float32's
    bytes) and computes exactly what the dequantised matrices give; XLA's dot on a CPU dequantises
    them at load; the logits stay near the float model's."""
    from imp_jax.kernels_pallas import Kernels, ggml_blocks

    dst = tmp_path / quantize
    assert main([str(tiny_hf_dir), str(dst), "--quantize", quantize]) == 0
    marker = json.loads((dst / CONVERTED_MARKER).read_text())
    assert set(marker["quantized"].values()) == {fmt} and "lm_head" in marker["quantized"]
    kept = load_model(dst, dtype="float32", kernels=Kernels(gemm="exact")).model
    matrices = [w for ws in kept.layers.matrices().values() for w in ws] + [kept.embed[...], kept.lm_head[...]]
    assert {ggml_blocks.format_of(w) for w in matrices} == {fmt}
    plain = load_model(dst, dtype="float32", kernels=Kernels(gemm="exact", quantized="dequantize")).model
    assert ggml_blocks.format_of(plain.lm_head[...]) is None
    ids = [5, 17, 99, 3, 42, 7]
    want = prefill_logits(plain, ids)
    assert np.array_equal(prefill_logits(kept, ids), want)
    assert ggml_blocks.format_of(load_model(dst, dtype="float32", kernels=Kernels(gemm="xla")).model.lm_head[...]) is None
    source = prefill_logits(load_model(tiny_hf_dir, dtype="float32").model, ids)
    assert 0 < np.abs(want - source).max() <= tol * np.ptp(source)


def test_cli_refuses_an_unknown_quantisation(tiny_hf_dir, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tiny_hf_dir), str(tmp_path / "q"), "--quantize", "int3"])
    assert "--quantize" in capsys.readouterr().err
