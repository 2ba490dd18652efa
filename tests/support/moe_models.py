"""Tiny random mixtures of experts (tests/test_moe*.py, tests/test_tensor_parallel.py): Mixtral, Qwen2-MoE and
Qwen3-MoE HF directories, their GGUFs as llama.cpp's converter writes them, and GGUFs whose expert stacks are
random GGML blocks of many formats."""
from __future__ import annotations

from pathlib import Path

import gguf
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
    """`t` (HF tensors of a Mixtral or Qwen2-MoE) as the GGUF llama.cpp's converter writes; the
    `quantised` stacked-expert tensor in Q8_0. Returns the HF-named tensors the GGUF holds, dequantised."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import dequantize, quantize

    from imp_jax.model.gguf_loader import permute_rotary
    from tiny_gguf import add_byte_level_vocab

    mixtral = cfg.architecture == "MixtralForCausalLM"
    arch = {"MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe"}.get(cfg.architecture, "qwen3moe")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size:
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "qwen3moe":
        w.add_key_length(cfg.head_dim)
    add_byte_level_vocab(w)
    w.add_eos_token_id(2)
    held: dict[str, np.ndarray] = {}

    def put(name: str, hf_name: str, x: np.ndarray) -> None:
        held[hf_name] = x
        if name.endswith("attn_q.weight") and mixtral:
            x = permute_rotary(x, cfg.num_heads)
        elif name.endswith("attn_k.weight") and mixtral:
            x = permute_rotary(x, cfg.num_kv_heads)
        if name.endswith(quantised):
            q = quantize(x, Q.Q8_0)
            w.add_tensor(name, q, raw_dtype=Q.Q8_0)
            held[hf_name] = dequantize(q, Q.Q8_0).reshape(x.shape)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))

    put("token_embd.weight", "model.embed_tokens.weight", t["model.embed_tokens.weight"])
    put("output_norm.weight", "model.norm.weight", t["model.norm.weight"])
    put("output.weight", "lm_head.weight", t["lm_head.weight"])
    moe = "block_sparse_moe" if mixtral else "mlp"
    names = dict(gate="w1", up="w3", down="w2") if mixtral else dict(gate="gate_proj", up="up_proj", down="down_proj")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                     ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                     ("attn_output", "self_attn.o_proj")):
            put(f"blk.{i}.{g}.weight", p + h + ".weight", t[p + h + ".weight"])
            if p + h + ".bias" in t:
                put(f"blk.{i}.{g}.bias", p + h + ".bias", t[p + h + ".bias"])
        if cfg.qk_norm:
            for q in "qk":
                name = p + f"self_attn.{q}_norm.weight"
                put(f"blk.{i}.attn_{q}_norm.weight", name, t[name])
        if not cfg.is_sparse_layer(i):
            for g in ("gate", "up", "down"):
                put(f"blk.{i}.ffn_{g}.weight", p + f"mlp.{g}_proj.weight", t[p + f"mlp.{g}_proj.weight"])
            continue
        put(f"blk.{i}.ffn_gate_inp.weight", p + f"{moe}.gate.weight", t[p + f"{moe}.gate.weight"])
        for g, leaf in names.items():
            stack = np.stack([t[p + f"{moe}.experts.{e}.{leaf}.weight"] for e in range(cfg.num_experts)])
            put(f"blk.{i}.ffn_{g}_exps.weight", p + f"{moe}.experts.{leaf}.weight", stack)
        if cfg.shared_expert_intermediate_size:
            for g in ("gate", "up", "down"):
                put(f"blk.{i}.ffn_{g}_shexp.weight", p + f"mlp.shared_expert.{g}_proj.weight",
                    t[p + f"mlp.shared_expert.{g}_proj.weight"])
            put(f"blk.{i}.ffn_gate_inp_shexp.weight", p + "mlp.shared_expert_gate.weight",
                t[p + "mlp.shared_expert_gate.weight"].reshape(-1))   # llama.cpp's is a vector
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
    from tiny_gguf import add_byte_level_vocab

    rng = np.random.default_rng(1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(E)
    w.add_expert_used_count(2)
    if arch == "qwen2moe":
        w.add_expert_feed_forward_length(I)
        w.add_expert_shared_feed_forward_length(64)
    tokens = add_byte_level_vocab(w)
    w.add_eos_token_id(2)

    def f32(name: str, *shape: int, scale: float = 0.05) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    f32("token_embd.weight", len(tokens), H, scale=1.0)
    f32("output.weight", len(tokens), H)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    D = H // HEADS
    for i, (gate, up, down) in enumerate(EXPERTS[arch]):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(H, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(H, np.float32))
        for leaf, n in (("attn_q", HEADS * D), ("attn_k", KV_HEADS * D), ("attn_v", KV_HEADS * D)):
            f32(f"blk.{i}.{leaf}.weight", n, H)
        f32(f"blk.{i}.attn_output.weight", H, HEADS * D)
        f32(f"blk.{i}.ffn_gate_inp.weight", E, H, scale=0.5)
        for leaf, qtype, (n, k) in (("gate", gate, (I, H)), ("up", up, (I, H)), ("down", down, (H, I))):
            stack = np.stack([expert_blocks(qtype, n, k, seed=100 * i + 10 * e + len(leaf)) for e in range(E)])
            w.add_tensor(f"blk.{i}.ffn_{leaf}_exps.weight", stack, raw_dtype=qtype)
        if arch == "qwen2moe":
            for leaf, shape in (("gate", (64, H)), ("up", (64, H)), ("down", (H, 64))):
                f32(f"blk.{i}.ffn_{leaf}_shexp.weight", *shape)
            f32(f"blk.{i}.ffn_gate_inp_shexp.weight", H)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
