"""Tiny random mixtures of experts (tests/test_moe*.py, tests/test_tensor_parallel.py): Mixtral, Qwen2-MoE and
Qwen3-MoE HF directories, their GGUFs as llama.cpp's converter writes them, and GGUFs whose expert stacks are
random GGML blocks of many formats."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from quant_blocks import BLOCK_BYTES, BLOCK_WEIGHTS, random_blocks
from tiny_models import TINY

from imp_jax.model.config import ModelConfig

# the block-stack GGUFs' shape (write_moe_blocks_gguf)
H, I, E, HEADS, KV_HEADS = 256, 256, 4, 4, 2


# each family on a tiny config; Qwen2-MoE with a shared expert and a dense middle layer
# (mlp_only_layers), Qwen3-MoE renormalising its top-k weights, Mixtral always does
FAMILIES = {
    "MixtralForCausalLM": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32)),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False)),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                                                   head_dim=32, norm_topk_prob=True)),
}


def write_tiny_moe(name: str, path: Path, seed: int = 0, **overrides):
    """Save a tiny random `name` (a FAMILIES key; `overrides` of its config) HF dir; returns the transformers model. Norms and
    biases get noise; routers and the LM head a scale that makes routing and greedy picks decisive
    (no near-ties to flip on rounding)."""
    import transformers

    cfg_cls, extra = FAMILIES[name]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, name)(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
            elif n.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight",
                             "lm_head.weight")):
                p.normal_(0, 0.5)   # decisive routers, and greedy tokens far apart
    model.save_pretrained(path, safe_serialization=True)
    return model


# ----------------------------------------------------------------------------------------- GGUF
def write_moe_gguf(path: Path, cfg: ModelConfig, t, quantised: str) -> dict[str, np.ndarray]:
    """`t` (HF tensors of a Mixtral or Qwen2-MoE) as the GGUF llama.cpp's converter writes (each layer's
    experts one [E, out, in] stack, the shared expert's gate a vector); the `quantised` stacked-expert tensor
    (a GGUF name suffix) in Q8_0. Returns the HF-named tensors the GGUF holds, dequantised."""
    from gguf.quants import dequantize, quantize
    from tiny_gguf import byte_level_metadata, gguf_name, write_gguf_file

    mixtral = cfg.architecture == "MixtralForCausalLM"
    arch = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe"}.get(cfg.architecture, "qwen3moe")
    meta = dict(block_count=cfg.num_layers, context_length=cfg.max_position_embeddings,
                embedding_length=cfg.hidden_size, feed_forward_length=cfg.intermediate_size,
                head_count=cfg.num_heads, head_count_kv=cfg.num_kv_heads, rope_freq_base=cfg.rope_theta,
                layer_norm_rms_eps=cfg.rms_norm_eps, expert_count=cfg.num_experts,
                expert_used_count=cfg.num_experts_per_tok)
    if not mixtral:
        meta["expert_feed_forward_length"] = cfg.moe_intermediate_size
    if cfg.shared_expert_intermediate_size:
        meta["expert_shared_feed_forward_length"] = cfg.shared_expert_intermediate_size
    if arch == "qwen3moe":
        meta["key_length"] = cfg.head_dim
    meta.update(byte_level_metadata(), eos_token_id=2)
    held: dict[str, np.ndarray] = {}
    for name in t:
        expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+\.weight)", name)
        if expert is None:
            held[name] = t[name].reshape(-1) if name.endswith("shared_expert_gate.weight") else t[name]
        elif expert[2] == "0":
            stem, leaf = expert[1], expert[3]
            held[f"{stem}.{leaf}"] = np.stack([t[f"{stem}.{e}.{leaf}"] for e in range(cfg.num_experts)])
    is_quantised = lambda name: gguf_name(name, arch, cfg.architecture).endswith(quantised)  # noqa: E731
    write_gguf_file(path, arch, meta, held, hf_arch=cfg.architecture,
                    qtype=lambda name: Q.Q8_0 if is_quantised(name) else Q.F32)
    for name in filter(is_quantised, list(held)):
        held[name] = dequantize(quantize(held[name], Q.Q8_0), Q.Q8_0).reshape(held[name].shape)
    return held


# per family, per layer: the expert stacks' types (gate, up, down). Gate and up of one format fuse as it;
# Q4_0 with Q8_0 fuse as Q8_0 (which holds both exactly); Q4_K with Q5_K cannot fuse: that gate|up is
# dequantised at load while its down stays blocks
EXPERTS = {
    "llama": [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_0, Q.Q8_0, Q.Q5_K)],
    "qwen2moe": [(Q.IQ4_NL, Q.IQ4_NL, Q.Q2_K), (Q.Q4_K, Q.Q5_K, Q.MXFP4)],
}


def expert_blocks(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """Random [rows, k] blocks of `qtype` (the file's bytes, [rows, k / W * bytes]), small weights."""
    fmt = qtype.name
    per = BLOCK_WEIGHTS[fmt]
    b = random_blocks(fmt, rows, k // per, seed=seed, scale=0.3 / k)
    if fmt == "MXFP4":
        b[..., 0] = np.random.default_rng(seed).integers(112, 117, b.shape[:-1])
    assert b.shape[-1] == BLOCK_BYTES[fmt]
    return b.reshape(rows, -1)


def write_moe_blocks_gguf(path: Path, arch: str) -> None:
    """A 2-layer Mixtral (`llama` with expert stacks) or Qwen2-MoE (with a shared expert) GGUF whose
    expert stacks are the `EXPERTS` types, other tensors float32."""
    from tiny_gguf import write_random_moe_gguf

    def stack(rng, i: int, leaf: str, n: int, k: int) -> tuple[np.ndarray, Q]:
        qtype = EXPERTS[arch][i][("gate", "up", "down").index(leaf)]
        return np.stack([expert_blocks(qtype, n, k, seed=100 * i + 10 * e + len(leaf)) for e in range(E)]), qtype

    write_random_moe_gguf(path, arch, hidden=H, ffn=I, heads=HEADS, kv_heads=KV_HEADS, layers=len(EXPERTS[arch]),
                          experts=E, used=2, expert_stack=stack, shared_ffn=64, context=256, seed=1)
