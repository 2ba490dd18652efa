"""Sampling defaults: the request, else generation_config.json, else imp's preset per architecture."""
from imp_jax.runtime.defaults import PRESET, model_defaults, resolve_params
from imp_jax.runtime.request import SamplingParams


def test_preset_without_generation_config():
    d = model_defaults({}, "LlamaForCausalLM")
    assert d == dict(temperature=0.6, top_p=0.95, top_k=50, min_p=0.0, typical_p=1.0, repetition_penalty=1.05)


def test_architecture_presets():
    assert model_defaults({}, "Qwen3ForCausalLM")["top_k"] == 20
    assert model_defaults({}, "Qwen2ForCausalLM")["top_k"] == 20
    gemma = model_defaults({}, "Gemma3ForCausalLM")
    assert (gemma["top_p"], gemma["top_k"]) == (0.9, 20)
    oss = model_defaults({}, "GptOssForCausalLM")
    assert (oss["temperature"], oss["top_p"]) == (1.0, 1.0)


def test_generation_config_wins_over_preset():
    d = model_defaults({"temperature": 0.3, "top_k": 7, "repetition_penalty": 1.0}, "Qwen3ForCausalLM")
    assert (d["temperature"], d["top_k"], d["repetition_penalty"], d["top_p"]) == (0.3, 7, 1.0, 0.95)
    assert model_defaults({"do_sample": False, "temperature": 0.7}, "LlamaForCausalLM")["temperature"] == 0.0


def test_request_values_win_and_neutral_values_stay():
    neutral = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, repetition_penalty=1.0)
    p = resolve_params(neutral, {"temperature": 0.2}, "LlamaForCausalLM")
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert p.min_p == PRESET["min_p"]
    q = resolve_params(SamplingParams(temperature=0.0), {}, "LlamaForCausalLM")
    assert (q.temperature, q.repetition_penalty, q.top_k) == (0.0, 1.05, 50)  # the preset's penalty at greedy too
