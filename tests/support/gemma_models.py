"""Tiny Gemma 2 / Gemma 3 checkpoints (transformers) and their GGUF, as llama.cpp's converter writes a Gemma:
shared by tests/test_gemma.py and tests/test_mmproj.py (a Gemma 3 text GGUF beside its projector)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import gguf
import numpy as np
import torch

from imp_jax.model.config import ModelConfig

WINDOW = 8   # the test prompts are longer
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
            query_pre_attn_scalar=24)   # not head_dim: the scale is the config's
CONFIGS = {
    # soft-caps small enough to bind on random weights; layers sliding, full, sliding, full
    "Gemma2ForCausalLM": ("Gemma2Config", dict(attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # layers sliding, sliding, full, sliding; global RoPE linearly scaled, local RoPE its own base
    "Gemma3ForCausalLM": ("Gemma3TextConfig", dict(
        sliding_window_pattern=3, tie_word_embeddings=False, rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})),
}


def write_tiny_gemma(arch: str, path: Path):
    """A tiny random `arch` checkpoint (1-D weights jittered so every norm matters); the transformers model."""
    import transformers

    cfg_cls, extra = CONFIGS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, arch)(getattr(transformers, cfg_cls)(**TINY, **extra)).float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_gemma_gguf(cfg: ModelConfig, tensors, path: Path, *, scale_key: bool,
                     vocab: Mapping[str, Any] | None = None) -> None:
    """The HF checkpoint as llama.cpp's convert_hf_to_gguf writes a Gemma: its metadata, norms stored with 1
    added, Q/K not permuted, a SentencePiece vocabulary (padded to the vocab size) unless `vocab` gives the
    tokenizer's metadata (tiny_gguf.write_gguf_file's {key: value} form). `tensors`: the language model's, under
    `model.*` / `lm_head.*`. `scale_key`: write `attention.scale` (else the reader falls back to
    1/sqrt(head_dim))."""
    from tiny_gguf import sentencepiece_vocab, write_gguf_file

    arch = {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
            "Gemma3ForConditionalGeneration": "gemma3"}[cfg.architecture]
    meta: dict[str, Any] = dict(
        context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size, block_count=cfg.num_layers,
        feed_forward_length=cfg.intermediate_size, head_count=cfg.num_heads, head_count_kv=cfg.num_kv_heads,
        layer_norm_rms_eps=cfg.rms_norm_eps, key_length=cfg.head_dim, value_length=cfg.head_dim,
        sliding_window=cfg.sliding_window)
    if scale_key:
        meta["attention_scale"] = cfg.query_pre_attn_scalar ** -0.5
    if arch == "gemma2":
        meta.update(attn_logit_softcapping=cfg.attn_logit_softcapping,
                    final_logit_softcapping=cfg.final_logit_softcapping)
    else:
        meta.update(rope_freq_base=cfg.rope_theta, rope_freq_base_swa=cfg.rope_local_theta,
                    sliding_window_pattern=[t == "sliding_attention" for t in cfg.layer_types])
        if cfg.rope_scaling.rope_type == "linear":
            meta.update(rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=cfg.rope_scaling.factor)
    if vocab is None:
        tokens, types, scores = sentencepiece_vocab()
        pad = cfg.vocab_size - len(tokens)
        vocab = dict(tokenizer_model="llama", token_list=tokens + [f"<unused{i}>" for i in range(pad)],
                     token_types=types + [4] * pad, token_scores=scores + [0.0] * pad,
                     bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id[0])
    write_gguf_file(path, arch, {**meta, **vocab}, {name: np.asarray(tensors[name], np.float32) for name in tensors})
