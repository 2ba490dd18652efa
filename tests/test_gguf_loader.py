"""GGUF loading: config mapping, dequantisation, llama Q/K un-permutation, tokenizer, errors."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf.quants import dequantize, quantize

from imp_jax.errors import ModelLoadError
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.gguf_loader import _llama3_factors, load_gguf, permute_rotary, unpermute_rotary
from support.gguf_models import (CHATML, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, LAYERS, storage_type,
                                 write_gguf)
from tiny_gguf import byte_level_vocab, write_named_gguf
from tiny_models import write_arch_only_gguf

TEXTS = ["Hello world", "the lazy dog jumps", " 2024 café\n\n\tx", "<|im_start|>user\nhi<|im_end|>",
         "日本語 🙂 <think>why</think>", ""]
# worst-case error of a storage type relative to the largest |value| of the tensor
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.15, Q.Q4_1: 0.1}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    return path, write_gguf(path)


def test_config_maps_llama_metadata(tiny):
    path, _ = tiny
    cfg = load_gguf(path).hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (HIDDEN, FFN, LAYERS)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, HEAD_DIM)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 256 and cfg["tie_word_embeddings"] is False
    assert cfg["vocab_size"] == len(byte_level_vocab()[0])
    parsed = ModelConfig.from_hf(cfg)
    assert parsed.num_kv_heads == KV_HEADS and not parsed.attention_bias


def test_tensors_have_hf_names_and_shapes(tiny):
    path, originals = tiny
    tensors = load_gguf(path).tensors
    assert set(tensors) == set(originals)
    for name, x in originals.items():
        assert tensors.shape(name) == x.shape
    assert tensors.qtype("model.layers.0.self_attn.o_proj.weight") == "Q4_1"


def test_dequantised_tensors_match_originals_within_quantisation_error(tiny):
    path, originals = tiny
    tensors = load_gguf(path).tensors
    for name, x in originals.items():
        got = tensors[name]
        assert got.dtype == np.float32 and got.shape == x.shape and got.flags.c_contiguous
        qtype = storage_type(name)
        np.testing.assert_allclose(got, x, rtol=0, atol=TOLERANCE[qtype] * np.abs(x).max() + 1e-7,
                                   err_msg=f"{name} ({qtype.name})")
        if qtype not in (Q.F32, Q.F16):  # quantisation is row-wise, so it commutes with the row permutation
            np.testing.assert_array_equal(got, dequantize(quantize(x, qtype), qtype), err_msg=name)


def test_quantised_matrices_stay_ggml_blocks_with_the_dequantised_logits(tiny):
    """Where the CPU GEMM kernel runs, a float32 model keeps each matrix whose parts share a format
    it reads (Q8_0, Q4_0, Q4_1) as the file's blocks, and computes what the dequantised model does."""
    import jax.numpy as jnp

    from imp_jax.kernels_pallas import ggml_blocks
    from imp_jax.model.architectures.llama import DecoderLM
    from imp_jax.model.formats.loader import load_model
    from imp_jax.model.weights import WeightSource
    from imp_jax.runtime.execution.batch import SeqChunk
    from paged import PagedRunner

    path, _ = tiny
    kept = load_model(path, dtype="float32", gemm="exact").model   # bit for bit: the exact GEMM
    formats = {name: [ggml_blocks.format_of(w) for w in ws] for name, ws in kept.layers.matrices().items()}
    if not kept.options.kernels.reads_narrow_weights:
        assert all(f is None for fs in formats.values() for f in fs)
        pytest.skip("no CPU GEMM kernel here: every matrix is dequantised")
    # layer 0: q Q8_0 | k Q4_0 | v F16 and gate Q8_0 | up BF16 mix formats; layer 1 is all F32
    assert formats == {"qkv_proj": [None, None], "o_proj": ["Q4_1", None],
                       "gate_up_proj": [None, None], "down_proj": ["Q4_0", None]}
    assert ggml_blocks.format_of(kept.embed[...]) == "Q8_0" and kept.lm_head[...].dtype == jnp.float32
    ckpt = load_gguf(path)
    cfg = ModelConfig.from_hf(ckpt.hf_config, source=str(path))
    plain = DecoderLM.from_hf_tensors(cfg, WeightSource(ckpt.tensors), kept.options)   # no narrow formats
    assert all(w.ndim == 2 for ws in plain.layers.matrices().values() for w in ws)
    chunks = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5], 0, [1])]   # 9 rows: the same summation order
    np.testing.assert_array_equal(PagedRunner(kept).run(chunks, 16, 1)[0], PagedRunner(plain).run(chunks, 16, 1)[0])


def test_llama_qk_permutation_round_trips(tiny):
    path, originals = tiny
    tensors = load_gguf(path).tensors
    for proj in ("q_proj", "k_proj"):  # layer 1 stores F32: exact
        name = f"model.layers.1.self_attn.{proj}.weight"
        np.testing.assert_array_equal(tensors[name], originals[name])
    x = np.arange(HEADS * HEAD_DIM * 3, dtype=np.float32).reshape(HEADS * HEAD_DIM, 3)
    assert not np.array_equal(permute_rotary(x, HEADS), x)
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(x, HEADS), HEADS), x)
    np.testing.assert_array_equal(unpermute_rotary(permute_rotary(x[:32], KV_HEADS), KV_HEADS), x[:32])


def test_tied_embeddings_have_no_lm_head(tmp_path):
    write_gguf(tmp_path / "tied.gguf", tied=True)
    ckpt = load_gguf(tmp_path / "tied.gguf")
    assert ckpt.hf_config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in ckpt.tensors


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_tensors_are_not_permuted_and_keep_biases_and_qk_norms(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    originals = write_gguf(path, arch=arch)
    ckpt = load_gguf(path)
    assert ckpt.hf_config["architectures"] == [f"Qwen{arch[-1]}ForCausalLM"]
    assert ckpt.hf_config["attention_bias"] is (arch == "qwen2")
    assert set(ckpt.tensors) == set(originals)
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(ckpt.tensors[name], originals[name])
    assert ModelConfig.from_hf(ckpt.hf_config).head_dim == HEAD_DIM


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    hf_scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=64)
    path = tmp_path / "llama3.gguf"
    write_gguf(path, rope_freqs=_llama3_factors(hf_scaling, 10000.0, HEAD_DIM))
    ckpt = load_gguf(path)
    assert ckpt.hf_config["rope_scaling"]["rope_type"] == "llama3"
    assert "rope_freqs.weight" not in ckpt.tensors
    want = ModelConfig.from_hf({**ckpt.hf_config, "rope_scaling": hf_scaling}).rope_inv_freq()
    np.testing.assert_allclose(ModelConfig.from_hf(ckpt.hf_config).rope_inv_freq(), want, rtol=1e-5)


def test_byte_level_tokenizer_keeps_specials_whole(tiny):
    path, _ = tiny
    ckpt = load_gguf(path)
    tok = ckpt.tokenizer
    tokens = byte_level_vocab()[0]
    ids = tok.encode("<|im_start|>user\nhello world<|im_end|>")
    assert ids[0] == tokens.index("<|im_start|>") and ids[-1] == tokens.index("<|im_end|>")
    assert tok.add_bos is False and tok.eos_id == tokens.index("<|im_end|>")
    assert tokens.index("<|endoftext|>") in tok.eos_ids  # llama.cpp's end-of-generation heuristic
    assert tok.encode("<think>") == [tokens.index("<think>")]
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    assert tok.decode(tok.encode("<|im_start|>hi<think>")) == "hi<think>"  # user-defined: not special
    assert tok.chat_template == CHATML
    assert ckpt.generation_config["bos_token_id"] == tokens.index("<|im_start|>")


@pytest.mark.parametrize("vocab", ["gpt2", "llama"])
def test_tokenizer_matches_transformers_gguf_tokenizer(tmp_path, vocab):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / f"{vocab}.gguf"
    write_gguf(path, vocab=vocab)
    ours = load_gguf(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS + ["hello the world", "  leading spaces", "unknown ✓ chars"]:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == \
                theirs.encode(text, add_special_tokens=special), (text, special)
        ids = theirs.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_sentencepiece_vocab_adds_bos_by_default(tmp_path):
    write_gguf(tmp_path / "spm.gguf", vocab="llama")
    tok = load_gguf(tmp_path / "spm.gguf").tokenizer
    assert tok.add_bos and tok.encode("hello world")[0] == 1
    assert tok.decode(tok.encode("hello world!")) == "hello world!"


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    write_arch_only_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ModelLoadError, match=r"'gpt2'.*llama.*qwen2"):
        load_gguf(tmp_path / "gpt2.gguf")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("content", [b"not a gguf at all" * 10, b"GGUF\x03\x00\x00\x00garbage"])
def test_garbage_file_is_a_model_load_error(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load_gguf(path)


def _llama_header(path: Path, **metadata: object) -> Path:
    """A llama GGUF of metadata only (plus one tensor), `metadata` written over the defaults as given."""
    values = {"llama.block_count": 1, "llama.context_length": 64, "llama.embedding_length": 8,
              "llama.feed_forward_length": 16, "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1,
              **metadata}
    write_named_gguf(path, "llama", {key: (value, V.STRING if isinstance(value, str) else V.UINT32)
                                     for key, value in values.items()},
                     {"blk.0.attn_q.weight": np.zeros((8, 8), np.float32)})
    return path


@pytest.mark.parametrize("metadata", [{"llama.attention.head_count": 0}, {"llama.embedding_length": "eight"}],
                         ids=["zero-heads", "a-string-for-a-number"])
def test_metadata_no_writer_makes_is_a_model_load_error_naming_the_file(tmp_path, metadata):
    """Not a ZeroDivisionError or TypeError from inside the config mapping."""
    with pytest.raises(ModelLoadError, match=r"odd\.gguf: unusable GGUF metadata"):
        load_gguf(_llama_header(tmp_path / "odd.gguf", **metadata))


def _raw_gguf(path: Path, value: bytes) -> Path:
    """A GGUF v3 header of no tensors and one field, 'x', of the raw typed `value` bytes."""
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + value)
    return path


def test_a_string_array_longer_than_the_file_is_refused_before_it_is_built(tmp_path):
    """A billion strings claimed: refused from the count, not after reading (8 bytes a string at least)."""
    path = _raw_gguf(tmp_path / "huge.gguf", struct.pack("<IIQ", 9, 8, 10**9) + struct.pack("<Q", 0) * 1000)
    with pytest.raises(ModelLoadError, match="an array of 1000000000 items cannot fit in the rest of the file"):
        load_gguf(path)


def test_arrays_nested_past_the_limit_are_refused(tmp_path):
    """Arrays of arrays 10,000 deep: refused at depth MAX_ARRAY_DEPTH, not by exhausting the stack."""
    path = _raw_gguf(tmp_path / "deep.gguf", struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 10_000)
    with pytest.raises(ModelLoadError, match="arrays nested deeper than 4"):
        load_gguf(path)


# --- the real SmolLM2-135M-Instruct Q4_1 file, against transformers' own GGUF loading ---

SMOLLM2_TEXTS = ["Hello world", " 2024 is 12345", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                 "héllo 日本語 🙂 — ünïcödé", "<repo_name>x<file_sep>  \n\n\t end<|endoftext|>", "def f(x):\n    return x"]


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_path):
    return load_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_gguf_path):
    """transformers' GGUF config and state dict (layers 0-1 only: their name map is slow for 30)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=2))
    return load_gguf_checkpoint(str(smollm2_gguf_path), return_tensors=True, model_to_load=model)


@pytest.mark.real_model
def test_smollm2_config(smollm2, smollm2_transformers):
    cfg = smollm2.hf_config
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (30, 576, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"], cfg["tie_word_embeddings"]) == (49152, 8192, True)
    theirs = smollm2_transformers["config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert cfg[key] == theirs[key], key
    assert cfg["rope_theta"] == pytest.approx(theirs["rope_theta"])
    assert cfg["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"])


@pytest.mark.real_model
def test_smollm2_tensors_equal_transformers_state_dict(smollm2, smollm2_transformers):
    theirs = smollm2_transformers["tensors"]
    names = ["model.embed_tokens.weight"] + [f"model.layers.{i}.{leaf}" for i in (0, 1) for leaf in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight")]
    for name in names:
        np.testing.assert_allclose(smollm2.tensors[name], theirs[name].float().numpy(), rtol=0, atol=1e-6,
                                   err_msg=name)


@pytest.mark.real_model
def test_smollm2_tokenizer_equals_transformers(smollm2, smollm2_gguf_path):
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent),
                                                        gguf_file=smollm2_gguf_path.name)
    tok = smollm2.tokenizer
    for text in SMOLLM2_TEXTS:
        assert tok.encode(text) == theirs.encode(text), text
        assert tok.decode(tok.encode(text)) == theirs.decode(theirs.encode(text), skip_special_tokens=True)
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
