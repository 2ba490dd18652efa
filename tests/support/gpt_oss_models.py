"""A tiny random gpt-oss (tests/test_gpt_oss.py, tests/test_moe_blocks.py, tests/test_tensor_parallel.py): its
HF directory, random MXFP4 expert weights, and its GGUF as llama.cpp's converter writes it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tiny_models import TINY

from imp_jax.model.architectures.gpt_oss import dequantize_mxfp4

YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=64)
# 3 layers: sliding, full, sliding (window 5, so a 30-token prompt crosses it)
GPT_OSS = dict(TINY, num_hidden_layers=3, head_dim=16, intermediate_size=32, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=5, rope_parameters=YARN)


def write_tiny_gpt_oss(path: Path, seed: int = 0, **overrides):
    """Save a tiny random GptOssForCausalLM (eager attention, so the sinks are transformers' own
    softmax column); returns the transformers model. Sinks, biases and norms get noise; router and LM
    head a scale that keeps routing and greedy picks away from near-ties. `overrides`: of GPT_OSS."""
    import transformers

    cfg = transformers.GptOssConfig(**{**GPT_OSS, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("sinks"):
                p.normal_(0, 1.0)
            elif n.endswith("router.weight") or n.endswith("lm_head.weight"):
                p.normal_(0, 0.5)
            elif n.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0, 0.1)
            elif p.ndim == 1 or n.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def random_mxfp4(rng, shape_out_in):
    """Random MXFP4 (blocks, scales) for an [E, out, in] weight and its exact value."""
    E, out, inp = shape_out_in
    blocks = rng.integers(0, 256, (E, out, inp // 32, 16)).astype(np.uint8)
    scales = rng.integers(120, 126, (E, out, inp // 32)).astype(np.uint8)
    return blocks, scales, dequantize_mxfp4(blocks, scales)


# ------------------------------------------------------------------------------------------- GGUF
def write_gpt_oss_gguf(path: Path, hf_model, experts: str = "F32", sliding_window: int | None = 5,
                       fuse_qkv: bool = False, extra: dict | None = None) -> dict:
    """Write `hf_model` as llama.cpp's convert_hf_to_gguf.py writes a gpt-oss (checked against its
    output, tests/data/gpt_oss): its metadata keys, HF's interleaved gate_up split into [E, out, in]
    gate and up (biases too), down transposed, the sinks as `attn_sinks.weight`; experts float32 or
    MXFP4 GGML blocks (gguf-py's quantiser); `fuse_qkv` as its --fuse-qkv writes q|k|v (`attn_qkv`);
    `extra` metadata on top ({GGUF key: (value, GGUFValueType)}). Returns the experts' values as stored
    (dequantised), keyed by HF parameter name, [E, in, out] as HF holds them."""
    import gguf
    from gguf.quants import dequantize, quantize
    from tiny_gguf import write_gguf_file

    c = hf_model.config
    sd = {n: p.detach().numpy().astype(np.float32) for n, p in hf_model.state_dict().items()}
    meta = dict(file_type=gguf.LlamaFileType.ALL_F32 if experts == "F32" else gguf.LlamaFileType.MOSTLY_MXFP4_MOE,
                block_count=c.num_hidden_layers, context_length=c.max_position_embeddings,
                embedding_length=c.hidden_size, feed_forward_length=c.intermediate_size,
                expert_feed_forward_length=c.intermediate_size, head_count=c.num_attention_heads,
                head_count_kv=c.num_key_value_heads, key_length=c.head_dim, value_length=c.head_dim,
                rope_freq_base=YARN["rope_theta"], layer_norm_rms_eps=c.rms_norm_eps,
                expert_count=c.num_local_experts, expert_used_count=c.num_experts_per_tok)
    if sliding_window:
        meta["sliding_window"] = sliding_window
    meta.update(rope_scaling_type=gguf.RopeScalingType.YARN, rope_scaling_factor=YARN["factor"],
                rope_scaling_orig_ctx_len=YARN["original_max_position_embeddings"],
                rope_scaling_yarn_beta_fast=YARN["beta_fast"], rope_scaling_yarn_beta_slow=YARN["beta_slow"],
                **(extra or {}))
    alphabet = _byte_alphabet()[:255]
    alphabet.append(alphabet[0] + alphabet[1])   # one merge, 256 tokens: the model's vocabulary
    meta.update(tokenizer_model="gpt2", tokenizer_pre="gpt-4o", token_list=alphabet, token_types=[1] * len(alphabet),
                token_merges=[alphabet[0] + " " + alphabet[1]], eos_token_id=0)
    tensors = {n: sd[n] for n in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    stacks: set[str] = set()
    stored = {}

    def as_stored(name: str, x: np.ndarray) -> np.ndarray:
        """`x` as the file holds it: an expert stack in the `experts` type."""
        tensors[name] = x
        if experts == "F32":
            return x
        stacks.add(name)
        q = gguf.GGMLQuantizationType[experts]
        return dequantize(quantize(np.ascontiguousarray(x), q), q).reshape(x.shape)

    for i in range(c.num_hidden_layers):
        pre = f"model.layers.{i}."
        for leaf in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.sinks",
                     "mlp.router.weight", "mlp.router.bias"):
            tensors[pre + leaf] = sd[pre + leaf]
        for leaf in ("weight", "bias"):
            qkv = [sd[f"{pre}self_attn.{p}_proj.{leaf}"] for p in "qkv"]
            if fuse_qkv:
                tensors[f"{pre}self_attn.qkv_proj.{leaf}"] = np.concatenate(qkv)
            else:
                tensors.update({f"{pre}self_attn.{p}_proj.{leaf}": x for p, x in zip("qkv", qkv)})
            tensors[f"{pre}self_attn.o_proj.{leaf}"] = sd[f"{pre}self_attn.o_proj.{leaf}"]
        gate_up = np.swapaxes(sd[pre + "mlp.experts.gate_up_proj"], 1, 2)   # [E, 2I (interleaved), H]
        gate = as_stored(pre + "mlp.experts.gate_proj.weight", gate_up[:, 0::2])
        up = as_stored(pre + "mlp.experts.up_proj.weight", gate_up[:, 1::2])
        down = as_stored(pre + "mlp.experts.down_proj.weight", np.swapaxes(sd[pre + "mlp.experts.down_proj"], 1, 2))
        bias = sd[pre + "mlp.experts.gate_up_proj_bias"]
        tensors[pre + "mlp.experts.gate_proj.bias"] = bias[:, 0::2]
        tensors[pre + "mlp.experts.up_proj.bias"] = bias[:, 1::2]
        tensors[pre + "mlp.experts.down_proj.bias"] = sd[pre + "mlp.experts.down_proj_bias"]
        interleaved = np.empty_like(gate_up)
        interleaved[:, 0::2], interleaved[:, 1::2] = gate, up
        stored[pre + "mlp.experts.gate_up_proj"] = np.swapaxes(interleaved, 1, 2)
        stored[pre + "mlp.experts.down_proj"] = np.swapaxes(down, 1, 2)
    write_gguf_file(path, "gpt-oss", meta, tensors,
                    qtype=lambda name: gguf.GGMLQuantizationType[experts] if name in stacks else gguf.GGMLQuantizationType.F32)
    return stored


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: 256 single-character tokens."""
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())
