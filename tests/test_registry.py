"""The families' declarations (model/family.py) as the registry collects them: every registered architecture's
config class, every GGUF architecture's names (and the test writer's inverse of them), and ModelConfig's raw
HF dict, which a family reads a new hyperparameter from."""
from __future__ import annotations

import dataclasses
import json

import pytest

from imp_jax.errors import ModelLoadError
from imp_jax.model import registry
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.converted import FORMAT, FORMAT_VERSION, read_converted
from imp_jax.model.formats.gguf_loader import ARCHITECTURES, GGUF_NAMES, layer_names
from imp_jax.model.formats.hub import CONVERTED_MARKER
from tiny_gguf import gguf_name


def hf_config(arch: str, **extra) -> dict:
    return {"architectures": [arch], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 2, **extra}


@pytest.mark.parametrize("arch", registry.supported_architectures())
def test_every_registered_architecture_declares_a_family_with_a_model_config(arch):
    family = registry.family(arch)
    assert family is not None and issubclass(family.config, ModelConfig)
    assert family in registry.families()


def test_an_unregistered_architecture_has_no_family_and_parses_to_the_common_fields():
    assert registry.family("MyOwnForCausalLM") is None
    cfg = ModelConfig.from_hf(hf_config("MyOwnForCausalLM"))
    assert type(cfg) is ModelConfig and cfg.num_layers == 2


def test_a_family_config_holds_its_own_fields_only():
    mixtral = ModelConfig.from_hf(hf_config("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2))
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (4, 2, True)
    llama = ModelConfig.from_hf(hf_config("LlamaForCausalLM", num_local_experts=4))
    assert not hasattr(llama, "num_experts") and not llama.attention_sinks
    assert ModelConfig.from_hf(hf_config("GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2)).attention_sinks


def test_every_gguf_architecture_loads_as_a_registered_one_whose_family_declares_it():
    for names in GGUF_NAMES:
        assert names in registry.family(names.architecture).gguf
    assert ARCHITECTURES["llama"] == "LlamaForCausalLM"   # the file without experts; with them: Mixtral
    assert {n.architecture for n in GGUF_NAMES if n.arch == "llama"} == {"LlamaForCausalLM", "MixtralForCausalLM"}


@pytest.mark.parametrize("names", GGUF_NAMES, ids=lambda n: f"{n.arch}-{n.architecture}")
def test_the_test_writer_names_every_hf_tensor_as_the_loader_reads_it_back(names):
    leaves = layer_names(names)
    for leaf in set(leaves.values()):
        if leaf in (leaves[g] for g in names.bare):
            assert gguf_name(f"model.layers.3.{leaf}", names.arch, names.architecture) == \
                f"blk.3.{next(g for g in names.bare if leaves[g] == leaf)}.weight"
            continue
        written = gguf_name(f"model.layers.3.{leaf}.weight", names.arch, names.architecture)
        block, layer, gguf_leaf, suffix = written.split(".")
        assert (block, layer, suffix) == ("blk", "3", "weight") and leaves[gguf_leaf] == leaf


def test_raw_keeps_the_hf_dict_and_stays_out_of_equality_and_hash():
    cfg = ModelConfig.from_hf(hf_config("LlamaForCausalLM", my_new_knob=3))
    assert cfg.raw["my_new_knob"] == 3 and cfg.raw["hidden_size"] == 16
    other = ModelConfig.from_hf(hf_config("LlamaForCausalLM"))
    assert cfg == other and hash(cfg) == hash(other)


def test_image_text_raw_is_the_decoders_text_config():
    cfg = ModelConfig.from_hf({"architectures": ["Idefics3ForConditionalGeneration"],
                               "text_config": hf_config("LlamaForCausalLM", my_new_knob=3)})
    assert cfg.raw["my_new_knob"] == 3 and cfg.raw["rms_norm_eps"] == 1e-5


def test_every_declared_image_text_architecture_is_registered_to_its_family_and_refuses_a_foreign_decoder():
    declared = {arch: fam for fam in registry.families() for arch in fam.text_configs}
    assert set(declared) == {"Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
                             "SmolVLMForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"}
    assert all(registry.family(arch) is fam for arch, fam in declared.items())
    gemma = ModelConfig.from_hf({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": {}})
    assert (gemma.hidden_size, gemma.num_layers) == (2304, 26)   # Gemma3TextConfig's defaults, from its family
    with pytest.raises(ModelLoadError, match="text model_type 'mistral' is not supported"):
        ModelConfig.from_hf({"architectures": ["SmolVLMForConditionalGeneration"],
                             "text_config": hf_config("MistralForCausalLM", model_type="mistral")})


def write_marker(path, fields):
    path.mkdir()
    (path / CONVERTED_MARKER).write_text(json.dumps(
        {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": "float32", "model_config": fields}))
    return path


def test_a_converted_marker_reads_back_as_its_familys_config(tmp_path):
    cfg = ModelConfig.from_hf(hf_config("Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                        my_new_knob=3))
    _, got = read_converted(write_marker(tmp_path / "m", dataclasses.asdict(cfg)))
    assert got == cfg and type(got) is type(cfg) and got.raw["my_new_knob"] == 3


def test_a_marker_listing_every_familys_fields_reads_back_as_its_own(tmp_path):
    """A marker written before the families held their own fields lists all of them, with their defaults."""
    cfg = ModelConfig.from_hf(hf_config("LlamaForCausalLM"))
    old = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "raw"}
    old.update(num_experts=0, query_pre_attn_scalar=None, attention_sinks=False, router="softmax_topk")
    _, got = read_converted(write_marker(tmp_path / "m", old))
    assert got == cfg and type(got) is ModelConfig


def test_a_marker_without_the_common_fields_is_a_model_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="bad 'model_config'"):
        read_converted(write_marker(tmp_path / "m", {"architecture": "LlamaForCausalLM"}))
