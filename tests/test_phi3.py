"""Phi-3 / Phi-4 (`Phi3ForCausalLM`) on tiny random checkpoints, against transformers: fused
qkv / gate_up tensors, a sliding window used beyond its length, partial rotary, longrope with its
short and its long factors, GGUF, the chat template and `<|end|>`, the engine without recompiles."""
from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from imp_jax.errors import ModelLoadError
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.loader import SafetensorsDir, load_model, open_checkpoint
from imp_jax.model.architectures.phi3 import Phi3LM
from imp_jax.runtime.execution.batch import SeqChunk
from paged import PagedRunner
from support.models import build
from tiny_models import TINY

ORIGINAL = 64   # original_max_position_embeddings of the longrope checkpoint (max_position_embeddings 512)
_rng = np.random.default_rng(7)
VARIANTS = {
    # Phi-3-mini-4k-like: full rotary, a sliding window the tests go beyond, untied head
    "phi3-window": dict(sliding_window=24),
    # Phi-4-mini-like: 3/4 of each head rotated, longrope, tied embeddings
    "phi4mini-longrope": dict(
        partial_rotary_factor=0.75, tie_word_embeddings=True, original_max_position_embeddings=ORIGINAL,
        rope_scaling=dict(type="longrope", short_factor=np.round(_rng.uniform(1, 1.5, 6), 3).tolist(),
                          long_factor=np.round(np.geomspace(1, 12, 6), 3).tolist())),
}
PHI_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}"
                "{% endif %}")
PHI_SPECIALS = ["<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def write_tiny_phi3(path: Path, seed: int = 0, **config):
    """A tiny random Phi3ForCausalLM HF dir (1-D weights jittered); returns the transformers model."""
    import transformers

    cfg = transformers.Phi3Config(**{**TINY, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **config})
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("qkv_proj.weight"):
                p.mul_(8.0)   # sharp attention: positions (RoPE, the window) then move the logits a lot
    model.save_pretrained(path, safe_serialization=True)
    return model


def hf_variant(model, **config):
    """The same weights under a changed config (transformers' own forward, another rope or window)."""
    import transformers

    cfg = transformers.Phi3Config(**{**model.config.to_dict(), **config})
    other = transformers.Phi3ForCausalLM(cfg).float().eval()
    other.load_state_dict(model.state_dict())
    return other


def hf_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def _prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, TINY["vocab_size"], n).tolist() for n in lengths]


def _close(got, want, tol=1e-3):
    assert got.shape == want.shape
    err = np.max(np.abs(got - want)) / max(np.ptp(want), 1e-6)
    assert err <= tol, err


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def phi(request, tmp_path_factory):
    """(name, config, {regime: (runner, transformers reference)}) for one tiny Phi checkpoint. The
    longrope one runs in both regimes: short factors (a served context <= the original, against
    transformers on sequences that short) and long factors (against transformers forced long by
    giving it the long factors as its short ones too)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = write_tiny_phi3(path, **VARIANTS[request.param])
    cfg = ModelConfig.from_file(path / "config.json")
    tensors = SafetensorsDir(path)
    if cfg.rope_scaling.rope_type != "longrope":
        return request.param, cfg, {"plain": (PagedRunner(build(cfg, tensors)), hf)}
    rope = dict(hf.config.rope_parameters)
    forced_long = hf_variant(hf, rope_parameters={**rope, "short_factor": rope["long_factor"]})
    short_cfg = cfg.for_context(ORIGINAL)
    return request.param, cfg, {"long": (PagedRunner(build(cfg, tensors)), forced_long),
                                "short": (PagedRunner(build(short_cfg, tensors)), hf)}


def test_config_reads_phi3_fields(phi):
    name, cfg, _ = phi
    assert cfg.architecture == "Phi3ForCausalLM"
    if name == "phi3-window":
        assert cfg.sliding_window == 24 and cfg.rotary_dim == cfg.head_dim == 16
    else:
        rs = cfg.rope_scaling
        assert cfg.rotary_dim == 12 and len(cfg.rope_inv_freq()) == 6
        assert rs.use_long_factor and not cfg.for_context(ORIGINAL).rope_scaling.use_long_factor
        assert cfg.for_context(ORIGINAL + 1).rope_scaling.use_long_factor
        # transformers' default: sqrt(1 + ln(max_pos / original) / ln(original))
        assert rs.attention_factor == pytest.approx(math.sqrt(1 + math.log(512 / 64) / math.log(64)))


def test_ragged_chunked_prefill_and_decode_match_transformers(phi):
    """Three sequences in one ragged batch, one prefilled in two chunks, then decode steps: every
    token's logits equal transformers' whole-sequence forward (40 tokens: past the window)."""
    _, cfg, regimes = phi
    for regime, (runner, hf) in regimes.items():
        a, b, c = _prompts([40, 22, 5], seed=1)
        ta, tb, tc = [10, 11, 12], [13, 14], [15]   # non-contiguous pages
        first = runner.run([SeqChunk(a[:13], 0, ta), SeqChunk(b[:18], 0, tb), SeqChunk(c, 0, tc)])
        second = runner.run([SeqChunk(a[13:35], 13, ta), SeqChunk([b[18]], 18, tb)])
        steps = [runner.run([SeqChunk([a[i]], i, ta), SeqChunk([b[i - 16]], i - 16, tb)]) for i in range(35, 38)]
        got_a = np.concatenate([first[0], second[0]] + [s[0] for s in steps])
        got_b = np.concatenate([first[1], second[1]] + [s[1] for s in steps])
        _close(got_a, hf_logits(hf, a[:38]))
        _close(got_b, hf_logits(hf, b[:22]))
        _close(first[2], hf_logits(hf, c))


def test_greedy_tokens_match_transformers(phi):
    _, cfg, regimes = phi
    prompt = _prompts([12], seed=2)[0]
    for regime, (runner, hf) in regimes.items():
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist()
        _, tokens = runner.greedy(prompt, 6, [20, 21])
        assert tokens == want, regime


def test_the_variant_features_change_the_logits(phi):
    """The checks above can fail: without the window (or with the other longrope factors) the
    logits past the window (or at any position) differ by far more than their tolerance."""
    name, cfg, regimes = phi
    prompt = _prompts([40], seed=3)[0]
    if name == "phi3-window":
        runner, hf = regimes["plain"]
        got = runner.run([SeqChunk(prompt, 0, [30, 31, 32])])[0]
        unwindowed = hf_logits(hf_variant(hf, sliding_window=None), prompt)
        _close(got[:24], unwindowed[:24])
        assert np.max(np.abs(got[24:] - unwindowed[24:])) > 0.05 * np.ptp(unwindowed)
    else:
        long = regimes["long"][0].run([SeqChunk(prompt, 0, [30, 31, 32])])[0]
        short = regimes["short"][0].run([SeqChunk(prompt, 0, [33, 34, 35])])[0]
        assert np.max(np.abs(long[1:] - short[1:])) > 0.05 * np.ptp(short)


@pytest.mark.parametrize("phi", ["phi4mini-longrope"], indirect=True)   # the longrope variant only
def test_longrope_past_the_original_context_matches_transformers_own_choice(phi):
    """An 80-token sequence (> original 64): transformers picks the long factors itself, unforced."""
    name, cfg, regimes = phi
    runner, _ = regimes["long"]
    _, plain_hf = regimes["short"]
    seq = _prompts([80], seed=4)[0]
    table = [40, 41, 42, 43, 44]
    got = np.concatenate([runner.run([SeqChunk(seq[:50], 0, table)])[0],
                          runner.run([SeqChunk(seq[50:], 50, table)])[0]])
    _close(got, hf_logits(plain_hf, seq))


def test_longrope_config_parsing_and_errors():
    """A Phi-3-mini-128k-style config ("su", top-level original, no factor) and what is refused."""
    hf = dict(architectures=["Phi3ForCausalLM"], vocab_size=32064, hidden_size=3072, intermediate_size=8192,
              num_hidden_layers=32, num_attention_heads=32, max_position_embeddings=131072,
              original_max_position_embeddings=4096, sliding_window=262144,
              rope_scaling=dict(type="su", short_factor=[1.0] * 48, long_factor=[2.0] * 48))
    cfg = ModelConfig.from_hf(hf)
    rs = cfg.rope_scaling
    assert rs.rope_type == "longrope" and rs.use_long_factor and rs.original_max_position_embeddings == 4096
    assert rs.attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    np.testing.assert_allclose(cfg.rope_inv_freq() * 2, cfg.for_context(4096).rope_inv_freq())
    assert "long factors" in cfg.describe_rope() and "short factors" in cfg.for_context(4096).describe_rope()
    assert hash(cfg) == hash(ModelConfig.from_hf(hf))   # hashable: a static part of the model
    assert ModelConfig.from_hf({**hf, "rope_scaling": {**hf["rope_scaling"], "attention_factor": 1.5}}
                               ).rope_scaling.attention_factor == 1.5
    with pytest.raises(ModelLoadError, match="long_factor"):
        ModelConfig.from_hf({**hf, "rope_scaling": {**hf["rope_scaling"], "long_factor": [1.0] * 47}})
    with pytest.raises(ModelLoadError, match="original_max_position_embeddings"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "original_max_position_embeddings"})
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):
        ModelConfig.from_hf({**hf, "partial_rotary_factor": 1.5})


# ---------------------------------------------------------------- GGUF, tokenizer, engine


def write_phi_tokenizer(path: Path) -> dict[str, int]:
    """A byte-level BPE with Phi-3's specials and chat format; generation_config lists <|end|> as EOS,
    as Phi's does. Returns the specials' ids."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world! 12345"] * 5,
                            trainers.BpeTrainer(vocab_size=200, show_progress=False, special_tokens=PHI_SPECIALS))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": PHI_TEMPLATE}))
    ids = {s: tok.token_to_id(s) for s in PHI_SPECIALS}
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [ids["<|endoftext|>"], ids["<|assistant|>"], ids["<|end|>"]]}))
    return ids


@pytest.fixture(scope="module")
def phi_dir(tmp_path_factory):
    """A complete tiny Phi-4-mini-like HF dir (longrope, partial rotary, tokenizer) and its transformers model."""
    path = tmp_path_factory.mktemp("phi-dir")
    hf = write_tiny_phi3(path, seed=1, **{**VARIANTS["phi4mini-longrope"], "sliding_window": 20})
    return path, hf, write_phi_tokenizer(path)


def test_chat_template_and_end_token_stop(phi_dir):
    path, _, ids = phi_dir
    ckpt = open_checkpoint(path)
    text = ckpt.tokenizer.render_chat([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert text == "<|user|>\nhello<|end|>\n<|assistant|>\n"
    assert ids["<|end|>"] in ckpt.tokenizer.eos_ids and ids["<|endoftext|>"] in ckpt.tokenizer.eos_ids


def write_phi3_gguf(path: Path, hf_dir: Path, hf_config: dict, quantised: bool = False) -> Path:
    """A phi3 GGUF of an HF Phi3 checkpoint, named as llama.cpp's converter names it: F32 tensors,
    or with `quantised` layer 0's fused attn_qkv and ffn_up (gate|up) as Q8_0 blocks."""
    import gguf
    from tiny_gguf import write_gguf_file

    t = SafetensorsDir(hf_dir)
    c = hf_config
    rope = c["rope_parameters"]
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    scale = c["max_position_embeddings"] / c["original_max_position_embeddings"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    meta = dict(block_count=c["num_hidden_layers"], context_length=c["max_position_embeddings"],
                embedding_length=c["hidden_size"], feed_forward_length=c["intermediate_size"],
                head_count=c["num_attention_heads"], head_count_kv=c["num_key_value_heads"],
                rope_freq_base=rope["rope_theta"], layer_norm_rms_eps=c["rms_norm_eps"],
                rope_dimension_count=int(head_dim * c["partial_rotary_factor"]), sliding_window=c["sliding_window"],
                rope_scaling_orig_ctx_len=c["original_max_position_embeddings"],
                rope_scaling_attn_factors=math.sqrt(1 + math.log(scale) / math.log(c["original_max_position_embeddings"])),
                tokenizer_model="llama", token_list=tokens[:c["vocab_size"]], token_scores=[0.0] * c["vocab_size"],
                token_types=[2, 3, 3] + [6] * (c["vocab_size"] - 3), bos_token_id=1, eos_token_id=2)
    tensors = {n: t[n] for n in ("model.embed_tokens.weight", "model.norm.weight")}
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for leaf in ("input_layernorm", "self_attn.qkv_proj", "self_attn.o_proj", "post_attention_layernorm",
                     "mlp.down_proj"):
            tensors[f"{pre}{leaf}.weight"] = t[f"{pre}{leaf}.weight"]
        # HF's fused gate|up goes in as `ffn_up` (the up_proj's name), which the loader reads, with no
        # `ffn_gate` beside it, as gate_up_proj
        tensors[f"{pre}mlp.up_proj.weight"] = t[f"{pre}mlp.gate_up_proj.weight"]
    fused = ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.up_proj.weight")
    Q = gguf.GGMLQuantizationType
    write_gguf_file(path, "phi3", meta, tensors, qtype=lambda name: Q.Q8_0 if quantised and name in fused else Q.F32,
                    extra={f"rope_factors_{k}.weight": np.asarray(rope[f"{k}_factor"], np.float32)
                           for k in ("long", "short")})
    return path


def test_phi3_gguf_loads_to_the_hf_checkpoints_model(phi_dir, tmp_path):
    path, hf, _ = phi_dir
    gguf_path = write_phi3_gguf(tmp_path / "phi.gguf", path, json.loads((path / "config.json").read_text()))
    from_gguf, from_hf = open_checkpoint(gguf_path), open_checkpoint(path)
    gc, hc = from_gguf.config, from_hf.config
    assert gc.architecture == "Phi3ForCausalLM"
    assert (gc.rotary_dim, gc.sliding_window, gc.tie_word_embeddings) == (hc.rotary_dim, hc.sliding_window, True)
    assert gc.rope_scaling.short_factor == pytest.approx(hc.rope_scaling.short_factor)
    assert gc.rope_scaling.long_factor == pytest.approx(hc.rope_scaling.long_factor)
    assert gc.rope_scaling.attention_factor == pytest.approx(hc.rope_scaling.attention_factor, rel=1e-6)
    assert gc.rope_scaling.use_long_factor and gc.max_position_embeddings == hc.max_position_embeddings
    assert "model.layers.0.mlp.gate_up_proj.weight" in from_gguf.tensors
    prompt = _prompts([40], seed=5)[0]   # past the window of 20
    got = PagedRunner(build(gc, from_gguf.tensors)).run([SeqChunk(prompt, 0, [1, 2, 3])])[0]
    rope = dict(hf.config.rope_parameters)
    _close(got, hf_logits(hf_variant(hf, rope_parameters={**rope, "short_factor": rope["long_factor"]}), prompt))


def test_the_engine_serves_phi_without_compiling_after_warm_up(phi_dir, caplog):
    """Built as the server builds it, with a served context of 64 (= the original): the short
    factors, said in the log. Greedy tokens through the engine (ragged batching, chunked prefill)
    equal transformers', no step compiles after warm-up, every KV block comes back; `<|end|>`
    forced by logit_bias ends a request with finish reason stop."""
    import logging

    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    path, hf, ids = phi_dir
    with caplog.at_level(logging.INFO, logger="imp_jax"):
        core = build_engine(EngineConfig(model=str(path), max_model_len=ORIGINAL, max_num_seqs=2,
                                         max_num_batched_tokens=16, block_size=16, num_kv_blocks=16))
    assert isinstance(core.loaded.model, Phi3LM)
    assert not core.loaded.model.config.rope_scaling.use_long_factor
    assert "longrope uses its short factors for every position" in caplog.text
    prompts = _prompts([23, 9], seed=6)   # 23 > 16 batched tokens: chunked prefill
    events: dict[int, list] = {0: [], 1: [], 2: []}
    for i, p in enumerate(prompts):
        core.add_request(GenerationRequest(uuid.uuid4().hex, p, SamplingParams(
            temperature=0.0, max_tokens=5, ignore_eos=True, repetition_penalty=1.0)), events[i].append)
    core.add_request(GenerationRequest(uuid.uuid4().hex, prompts[1], SamplingParams(
        temperature=0.0, max_tokens=5, logit_bias={ids["<|end|>"]: 100.0})), events[2].append)
    while core.has_work():
        core.step()
    for i, p in enumerate(prompts):   # 28 tokens at most: transformers too uses its short factors
        with torch.no_grad():
            want = hf.generate(torch.tensor([p]), max_new_tokens=5, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist()
        assert [t for ev in events[i] for t in ev.token_ids] == want
    assert events[2][-1].finish_reason == "stop"   # at once: <|end|> is its first token
    assert [t for ev in events[2] for t in ev.token_ids] in ([], [ids["<|end|>"]])
    assert core.pool.num_free_blocks == core.baseline_free_blocks
    assert core.step_fn.compilations_after_warmup == 0


def test_quantised_fused_phi3_matrices_stay_ggml_blocks(phi_dir, tmp_path):
    """A Q8_0 attn_qkv / ffn_up is read whole (no split), so where the CPU GEMM kernel runs it stays
    the file's blocks, and the model computes what its dequantised twin does."""
    from imp_jax.kernels_pallas import ggml_blocks
    from imp_jax.model.weights import WeightSource

    path, _, _ = phi_dir
    gguf_path = write_phi3_gguf(tmp_path / "phi-q8.gguf", path, json.loads((path / "config.json").read_text()),
                                quantised=True)
    kept = load_model(gguf_path, dtype="float32", gemm="exact").model
    if not kept.options.kernels.reads_narrow_weights:
        pytest.skip("no CPU GEMM kernel here: every matrix is dequantised")
    formats = {name: [ggml_blocks.format_of(w) for w in ws] for name, ws in kept.layers.matrices().items()}
    assert formats["qkv_proj"] == ["Q8_0", None] and formats["gate_up_proj"] == ["Q8_0", None]
    ckpt = open_checkpoint(gguf_path)
    plain = Phi3LM.from_hf_tensors(ckpt.config, WeightSource(ckpt.tensors), kept.options)
    chunks = [SeqChunk([3, 1, 4, 1, 5, 9, 2, 6, 5], 0, [1])]
    np.testing.assert_allclose(PagedRunner(kept).run(chunks, 16, 1)[0], PagedRunner(plain).run(chunks, 16, 1)[0],
                               rtol=1e-5, atol=1e-5)


def test_a_phi_peft_adapter_on_its_fused_modules_matches_transformers_peft(phi_dir, tmp_path):
    """PEFT's LoRA on qkv_proj / gate_up_proj / o_proj / down_proj: a row under the adapter and one
    without, in one ragged call, against transformers + peft."""
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    from imp_jax.model.lora import LoraOptions
    from imp_jax.runtime.scheduling.lora import AdapterSlots

    path, _, _ = phi_dir
    torch.manual_seed(3)
    peft_model = get_peft_model(transformers.Phi3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
                                LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                           target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    peft_model.save_pretrained(tmp_path / "adapter")
    hf = PeftModel.from_pretrained(transformers.Phi3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32),
                                   tmp_path / "adapter").eval()
    model = load_model(path, dtype="float32").model
    model.enable_lora(LoraOptions(max_loras=1, max_rank=4))
    slots = AdapterSlots(model, model.lora.options, lambda edit: edit(model))
    slot = slots.load("a", slots.read(str(tmp_path / "adapter"))).slot
    prompt = _prompts([20], seed=8)[0]
    got = PagedRunner(model).run([SeqChunk(prompt, 0, [1, 2], slot), SeqChunk(prompt, 0, [3, 4], 0)])
    rope = dict(hf.base_model.model.config.rope_parameters)
    with torch.no_grad():   # the model is served with its long factors (512 > 64): force transformers' too
        hf.base_model.model.model.rotary_emb.original_inv_freq = 1.0 / (torch.tensor(rope["long_factor"]) * (
            rope["rope_theta"] ** (torch.arange(0, 12, 2).float() / 12)))   # 12 rotary dims
        with_adapter = hf(torch.tensor([prompt])).logits[0].numpy()
        with hf.disable_adapter():
            base = hf(torch.tensor([prompt])).logits[0].numpy()
    _close(got[0], with_adapter)
    _close(got[1], base)
    assert np.max(np.abs(with_adapter - base)) > 0.1 * np.ptp(base), "the adapter changes nothing"
