"""Tiny GGUF files for the tests and scripts: the one GGUF writer (`write_named_gguf`, every GGUF a test or script
writes goes through it); on it, `write_gguf_file`, which names each HF tensor as
imp_jax/model/formats/gguf_loader.py's own tables read it back (their inverse, not a copy) and stores it in the type
asked for; a random mixture of experts written with that; and two small vocabularies (byte-level BPE,
SentencePiece) to write in.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import quantize

from imp_jax.model.family import GGUFNames
from imp_jax.model.formats import gguf_loader as loader

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ("The quick brown fox jumps over the lazy dog. Hello world! hello there, world of tokens. "
          "Numbers 12345 and 2024; café, naïve, 日本語 text.\n\tIndented code: def f(x): return x * 2\n") * 20


def gguf_name(hf_name: str, arch: str, hf_arch: str | None = None) -> str:
    """The GGUF tensor name the loader maps to `hf_name` for a file of `arch` (`hf_arch`: the HF architecture,
    where one `arch` serves two: a `llama` file with experts is a Mixtral). The loader's tables (the common
    decoder's and each family's GGUFNames) are read here, inverted: one table, which a new family extends."""
    stem, _, suffix = hf_name.rpartition(".")
    top = {hf: g for g, hf in loader.TOP_NAMES.items()}
    if stem in top:
        return f"{top[stem]}.{suffix}"
    model, layers, layer, rest = hf_name.split(".", 3)   # model.layers.{i}.{leaf}
    assert (model, layers) == ("model", "layers"), hf_name
    names = _names(arch, hf_arch)
    inverse = {hf: g for g, hf in loader.layer_names(names).items()}
    if rest in inverse and inverse[rest] in names.bare:   # a bare parameter: llama.cpp names it `.weight`
        return f"blk.{layer}.{inverse[rest]}.weight"
    leaf, _, suffix = rest.rpartition(".")
    return f"blk.{layer}.{inverse[leaf]}.{suffix}"


def _names(arch: str, hf_arch: str | None) -> GGUFNames:
    """The loader's declaration of a file of `arch` loading as `hf_arch` (any of `arch`'s, preferring one
    without experts, when not given)."""
    return next((n for n in loader.GGUF_NAMES if n.arch == arch and n.architecture == hf_arch),
                loader.gguf_names(arch))


Stored = np.ndarray | tuple[np.ndarray, Q]


def write_gguf_file(path: Path, arch: str, metadata: Mapping[str, Any], tensors: Mapping[str, np.ndarray], *,
                    qtype: Callable[[str], Q] = lambda name: Q.F32, hf_arch: str | None = None,
                    extra: Mapping[str, Stored] | None = None) -> None:
    """Write HF-named float32 `tensors` as a GGUF of `arch` that the loader reads back as them.

    `metadata`: as write_named_gguf takes it. `qtype(hf_name)`: each tensor's storage type; a uint8 array is GGML
    blocks already, written as they are. What the loader undoes is done here: llama's Q/K row permutation,
    Gemma's norms stored as weight + 1. `extra`: GGUF-named tensors written after them (rope_freqs.weight)."""
    named: dict[str, Stored] = {}
    names = _names(arch, hf_arch)
    for hf_name, x in tensors.items():
        name, x = gguf_name(hf_name, arch, hf_arch), np.ascontiguousarray(x)
        leaf = name.split(".")[2] if name.startswith("blk.") else None
        if names.permuted_qk and leaf in ("attn_q", "attn_k"):
            x = loader.permute_rotary(x, metadata["head_count" if leaf == "attn_q" else "head_count_kv"])
        if names.norm_plus_one and hf_name.endswith("norm.weight"):
            x = x + np.float32(1.0)
        named[name] = (x, qtype(hf_name))
    write_named_gguf(path, arch, metadata, {**named, **(extra or {})})


def write_named_gguf(path: Path, arch: str, metadata: Mapping[str, Any], tensors: Mapping[str, Stored]) -> None:
    """Write a GGUF of `arch` whose tensors the caller has named (the one place that drives gguf-py's writer:
    write_gguf_file names HF tensors through the loader's tables, tests that write as llama.cpp's converter
    does name them through gguf-py's own maps).

    `metadata`: GGUFWriter `add_<key>` calls as {key: value} (e.g. {"block_count": 2}, {"type": "mmproj"}),
    tokenizer included, in the order given; a key with a dot is a raw GGUF key whose value is
    (value, GGUFValueType[, array item type]), written with add_key_value.
    `tensors`: in the order given, each an array written in its own dtype, or (array, type): a uint8 array is
    GGML blocks of that type, a float32 one is stored in it (F32 as is, F16 cast, others quantised by gguf-py)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if "." in key:
            w.add_key_value(key, *value)
        else:
            getattr(w, f"add_{key}")(value)
    for name, stored in tensors.items():
        x, q = stored if isinstance(stored, tuple) else (stored, None)
        if q is None or q == Q.F32:
            w.add_tensor(name, x)
        elif x.dtype == np.uint8:
            w.add_tensor(name, x, raw_dtype=q)
        elif q == Q.F16:
            w.add_tensor(name, x.astype(np.float16))
        else:
            w.add_tensor(name, quantize(x, q), raw_dtype=q)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def recorded_metadata(add_to: Callable[[Any], Any]) -> dict[str, Any]:
    """The GGUFWriter `add_<key>` calls a gguf-py helper makes on the writer it is given (for example
    `SpecialVocab(...).add_to_gguf`), as write_named_gguf's {key: value}, in their order. A method the writer
    lacks is missing here too (the helper skips what it cannot write: SpecialVocab's cls token id)."""
    calls: dict[str, Any] = {}

    class Recorder:
        def __getattr__(self, attr: str) -> Callable[[Any], None]:
            if not hasattr(gguf.GGUFWriter, attr):
                raise AttributeError(attr)
            return lambda value: calls.__setitem__(attr.removeprefix("add_"), value)

    add_to(Recorder())
    return calls


def write_random_moe_gguf(path: Path, arch: str, *, hidden: int, ffn: int, heads: int, kv_heads: int, layers: int,
                          experts: int, used: int,
                          expert_stack: Callable[[np.random.Generator, int, str, int, int], tuple[np.ndarray, Q]],
                          shared_ffn: int = 0, context: int = 1024, seed: int = 0) -> None:
    """A random Mixtral (`llama` with expert stacks) or Qwen2-MoE (`qwen2moe`, with a shared expert `shared_ffn`
    wide) GGUF of the byte-level vocabulary: float32 tensors of small random values, unit norms, and each layer's
    expert stacks as `expert_stack(rng, layer, "gate" | "up" | "down", rows, k)` makes them (GGML blocks
    [experts, rows, bytes] and their type)."""
    hf_arch, moe, leaves = (("MixtralForCausalLM", "block_sparse_moe", dict(gate="w1", up="w3", down="w2"))
                            if arch == "llama" else
                            ("Qwen2MoeForCausalLM", "mlp", dict(gate="gate_proj", up="up_proj", down="down_proj")))
    rng = np.random.default_rng(seed)
    meta = dict(block_count=layers, context_length=context, embedding_length=hidden, feed_forward_length=ffn,
                head_count=heads, head_count_kv=kv_heads, rope_freq_base=10000.0, layer_norm_rms_eps=1e-5,
                expert_count=experts, expert_used_count=used)
    if arch == "qwen2moe":
        meta.update(expert_feed_forward_length=ffn, expert_shared_feed_forward_length=shared_ffn)
    meta.update(byte_level_metadata(), eos_token_id=2)
    tensors: dict[str, np.ndarray] = {}
    blocks: dict[str, Q] = {}

    def f32(name: str, *shape: int, scale: float = 0.05) -> None:
        tensors[name] = (rng.standard_normal(shape) * scale).astype(np.float32)

    f32("model.embed_tokens.weight", len(meta["token_list"]), hidden, scale=1.0)
    f32("lm_head.weight", len(meta["token_list"]), hidden)
    tensors["model.norm.weight"] = np.ones(hidden, np.float32)
    head_dim = hidden // heads
    for i in range(layers):
        pre = f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{pre}{norm}.weight"] = np.ones(hidden, np.float32)
        for proj, n in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            f32(f"{pre}self_attn.{proj}_proj.weight", n, hidden)
        f32(f"{pre}self_attn.o_proj.weight", hidden, heads * head_dim)
        f32(f"{pre}{moe}.gate.weight", experts, hidden, scale=0.5)
        for leaf, (n, k) in (("gate", (ffn, hidden)), ("up", (ffn, hidden)), ("down", (hidden, ffn))):
            name = f"{pre}{moe}.experts.{leaves[leaf]}.weight"
            tensors[name], blocks[name] = expert_stack(rng, i, leaf, n, k)
        if arch == "qwen2moe":
            for leaf, shape in (("gate", (shared_ffn, hidden)), ("up", (shared_ffn, hidden)), ("down", (hidden, shared_ffn))):
                f32(f"{pre}mlp.shared_expert.{leaf}_proj.weight", *shape)
            f32(f"{pre}mlp.shared_expert_gate.weight", hidden)
    write_gguf_file(path, arch, meta, tensors, hf_arch=hf_arch, qtype=lambda name: blocks.get(name, Q.F32))


def byte_level_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a small byte-level BPE trained on CORPUS, with ChatML specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get) + ["<think>", "</think>"]
    types = [3 if t in SPECIALS else 4 if "think" in t else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, types, merges


def byte_level_metadata() -> dict[str, Any]:
    """`byte_level_vocab` as a gpt2 (byte-level BPE) tokenizer's metadata, for write_gguf_file."""
    tokens, types, merges = byte_level_vocab()
    return dict(tokenizer_model="gpt2", tokenizer_pre="default", token_merges=merges, token_list=tokens,
                token_types=types)


def sentencepiece_vocab() -> tuple[list[str], list[int], list[float]]:
    """(tokens, token types, scores) of a small SentencePiece-BPE vocabulary with byte fallback."""
    pieces = ["▁t", "he", "▁the", "▁h", "el", "lo", "ello", "▁hello", "▁w", "or", "ld", "▁wor", "▁world", "in"]
    chars = ["▁"] + list("abcdefghijklmnopqrstuvwxyz.,!?")
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces + chars
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) + len(chars))
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))] + [-100.0 - i for i in range(len(chars))]
    return tokens, types, scores
