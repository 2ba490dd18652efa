"""Tiny GGUF models the loader tests read back (tests/test_gguf_loader.py and its users): a 2-layer model of
mixed storage types written with scripts/tiny_gguf.py's one writer."""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from tiny_gguf import byte_level_vocab, sentencepiece_vocab, write_gguf_file

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
HEAD_DIM = HIDDEN // HEADS
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# per layer: HF leaf, numpy shape, storage type of layer 0 (layer 1 stores everything F32)
LAYER_TENSORS = [
    ("input_layernorm.weight", (HIDDEN,), Q.F32),
    ("self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), Q.Q8_0),
    ("self_attn.k_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.Q4_0),
    ("self_attn.v_proj.weight", (KV_HEADS * HEAD_DIM, HIDDEN), Q.F16),
    ("self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), Q.Q4_1),
    ("post_attention_layernorm.weight", (HIDDEN,), Q.F32),
    ("mlp.gate_proj.weight", (FFN, HIDDEN), Q.Q8_0),
    ("mlp.up_proj.weight", (FFN, HIDDEN), Q.BF16),
    ("mlp.down_proj.weight", (HIDDEN, FFN), Q.Q4_0),
]


def storage_type(hf_name: str) -> Q:
    """The type write_gguf stores a tensor in."""
    if ".layers.1." in hf_name:
        return Q.F32
    for hf_leaf, _, qtype in LAYER_TENSORS:
        if hf_name.endswith(hf_leaf):
            return qtype
    return {"model.embed_tokens.weight": Q.Q8_0, "lm_head.weight": Q.F16}.get(hf_name, Q.F32)


def write_gguf(path: Path, *, arch: str = "llama", vocab: str = "gpt2", tied: bool = False,
               rope_freqs: np.ndarray | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny 2-layer model; returns the HF-named float32 originals (before llama's Q/K permutation)."""
    rng = np.random.default_rng(seed)
    meta: dict = dict(block_count=LAYERS, context_length=256, embedding_length=HIDDEN, feed_forward_length=FFN,
                      head_count=HEADS, head_count_kv=KV_HEADS, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5)
    if arch == "qwen3":
        meta["key_length"] = HEAD_DIM
    if vocab == "gpt2":
        tokens, types, merges = byte_level_vocab()
        meta.update(tokenizer_model="gpt2", tokenizer_pre="default", token_merges=merges,
                    bos_token_id=tokens.index("<|im_start|>"), eos_token_id=tokens.index("<|im_end|>"),
                    pad_token_id=tokens.index("<|im_end|>"), add_bos_token=False, chat_template=CHATML)
    else:
        tokens, types, scores = sentencepiece_vocab()
        meta.update(tokenizer_model="llama", token_scores=scores, bos_token_id=1, eos_token_id=2, unk_token_id=0)
    meta.update(token_list=tokens, token_types=types, vocab_size=len(tokens))

    shapes = {"model.embed_tokens.weight": (len(tokens), HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (len(tokens), HIDDEN)
    for i in range(LAYERS):
        shapes.update({f"model.layers.{i}.{leaf}": shape for leaf, shape, _ in LAYER_TENSORS})
        if arch == "qwen2":
            for p, n in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                shapes[f"model.layers.{i}.self_attn.{p}_proj.bias"] = (n * HEAD_DIM,)
        if arch == "qwen3":
            for p in "qk":
                shapes[f"model.layers.{i}.self_attn.{p}_norm.weight"] = (HEAD_DIM,)
    originals = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    extra = {} if rope_freqs is None else {"rope_freqs.weight": rope_freqs.astype(np.float32)}
    write_gguf_file(path, arch, meta, originals, qtype=storage_type, extra=extra)
    return originals
