"""The model scripts/gpu_check.sh serves: random weights shaped like a 1B Llama with SmolLM2's
tokenizer. The GPU machine has no network and takes at most 64 MiB of carried files per call, so
only a skeleton (config + tokenizer, about 2 MB) is carried and the weights are made there.

    python scripts/gpu_model.py skeleton [--size 1b|tiny] [--dest .gpu_model/skeleton]   # here
    python scripts/gpu_model.py random .gpu_model/skeleton .gpu_model/random             # there

`skeleton` writes config.json (Llama-3.2-1B's shapes: hidden 2048, 16 layers, 32 heads over 8 kv
heads of 64, MLP 8192; `tiny` for the CPU dry run) with SmolLM2's vocabulary (49152, against
Llama's 128k: the skeleton stays small) and SmolLM2's tokenizer and chat template, read from the
cached GGUF; without it (not fetched yet) a small byte-level BPE tokenizer trained on the spot.
`random` turns a skeleton into an HF checkpoint of random float16 weights (uniform, std 0.02; unit
norms): the same shapes, so the same speed in bfloat16, but no sensible answers.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np

SIZES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16),
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def smollm2_gguf() -> Path | None:
    """The cached SmolLM2 GGUF (scripts and CI fetch it before the tests), None when absent."""
    from imp_jax.paths import imp_jax_home

    return next(iter(sorted((imp_jax_home() / "models" / "smollm2-135m-instruct").glob("*.gguf"))), None)


def write_smollm2_tokenizer(gguf: Path, dest: Path) -> tuple[int, list[int]]:
    """SmolLM2's tokenizer files and generation config into dest; (vocab size, eos ids)."""
    from imp_jax.convert import write_tokenizer
    from imp_jax.model.formats.loader import open_checkpoint

    ckpt = open_checkpoint(gguf)
    write_tokenizer(ckpt.tokenizer, dest)
    (dest / "generation_config.json").write_text(json.dumps(ckpt.generation_config, indent=1))
    return ckpt.config.vocab_size, list(ckpt.config.eos_token_id)


def write_small_tokenizer(dest: Path) -> tuple[int, list[int]]:
    """A byte-level BPE of a few hundred tokens with ChatML's special tokens, when SmolLM2 is not
    here; (vocab size, eos ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["The capital of France is Paris.", "What is the history of science?", "hello world"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=512, show_progress=False, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHATML)))
    eos = tok.token_to_id("<|im_end|>")
    (dest / "generation_config.json").write_text(json.dumps(dict(eos_token_id=eos)))
    return tok.get_vocab_size(), [eos]


def skeleton(size: str, dest: Path) -> None:
    """dest/: a Llama config of `size` and a tokenizer (SmolLM2's when cached)."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    gguf = smollm2_gguf()
    vocab, eos = write_smollm2_tokenizer(gguf, dest) if gguf else write_small_tokenizer(dest)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, **SIZES[size],
                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                  tie_word_embeddings=True, attention_bias=False, bos_token_id=None,
                  eos_token_id=eos[0] if len(eos) == 1 else eos, torch_dtype="bfloat16")
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    print(f"wrote {dest}: Llama {size}, vocab {vocab}, tokenizer "
          f"{'of SmolLM2 (' + gguf.name + ')' if gguf else 'a small BPE (SmolLM2 is not cached)'}")


def llama_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of a (tied-embedding) Llama config."""
    h, d, kv = c["hidden_size"], c["head_dim"], c["num_key_value_heads"]
    q, ffn = c["num_attention_heads"] * d, c["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv * d, h),
                       p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "mlp.gate_proj.weight": (ffn, h), p + "mlp.up_proj.weight": (ffn, h),
                       p + "mlp.down_proj.weight": (h, ffn)})
    return shapes


def random_checkpoint(skeleton_dir: Path, dest: Path, seed: int) -> None:
    """An HF dir at dest: the skeleton's files plus model.safetensors of random weights. Uniform
    draws (std 0.02, the scale of trained matrices) cost a third of normal ones: 1B of them in
    seconds."""
    from safetensors.numpy import save_file

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(skeleton_dir, dest)
    rng = np.random.default_rng(seed)
    half_width = np.float32(0.02 * 3 ** 0.5)
    tensors = {}
    for name, shape in llama_shapes(json.loads((skeleton_dir / "config.json").read_text())).items():
        x = rng.random(shape, np.float32)
        x = (x - 0.5) * (0.04 if len(shape) == 1 else 2 * half_width) + (1 if len(shape) == 1 else 0)
        tensors[name] = x.astype(np.float16)
    save_file(tensors, str(dest / "model.safetensors"))
    print(f"wrote {dest}: {sum(t.size for t in tensors.values()) / 1e6:.0f}M random float16 weights")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    ps = sub.add_parser("skeleton", help="here: config + tokenizer to carry")
    ps.add_argument("--size", choices=sorted(SIZES), default="1b")
    ps.add_argument("--dest", type=Path, default=Path(".gpu_model/skeleton"))
    pr = sub.add_parser("random", help="there: an HF checkpoint of random weights from a skeleton")
    pr.add_argument("skeleton", type=Path)
    pr.add_argument("dest", type=Path)
    pr.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.command == "skeleton":
        skeleton(a.size, a.dest)
    else:
        random_checkpoint(a.skeleton, a.dest, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
