"""Tiny random-weight HF checkpoints of each supported architecture, written with transformers,
and a GGUF file that names an architecture and holds nothing else."""
from __future__ import annotations

from pathlib import Path

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

ARCHS = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "LlamaForCausalLM-llama3-rope": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=64))),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=24, head_dim=16)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


def write_tiny_hf(name: str, path: Path, seed: int = 0):
    """Save a tiny random `name` model (an ARCHS key) as a HF dir; returns the transformers model."""
    import torch
    import transformers

    cfg_cls, extra = ARCHS[name]
    cfg = getattr(transformers, cfg_cls)(**TINY, **extra)
    arch = name.split("-")[0]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():  # random norms and biases so parity checks exercise them
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_arch_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF file with `arch` in its header and one embedding tensor: enough to be refused by architecture."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
