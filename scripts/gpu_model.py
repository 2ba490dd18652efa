"""The model scripts/gpu_check.sh serves on the GPU machine, which has no network and takes at most
64 MiB of carried files per call: the SmolLM2 GGUF (94 MiB) does not fit in one call.

    python scripts/gpu_model.py prepare [--src smollm2-135m-instruct] [--dest .gpu_model]   # here
    python scripts/gpu_model.py random .gpu_model/skeleton .gpu_model/random                # there

`prepare` (where the GGUF is) writes under --dest: `skeleton/`, the model's config.json, tokenizer
and generation config plus the names and shapes of its tensors (about 4 MB), and the GGUF cut in two
(`<name>.gguf.0`, 55 MiB, and `.1`) with its sha256, to carry over two calls of one warm machine.
`random` (on the GPU machine) turns a skeleton into an HF checkpoint of the same architecture with
random weights (float16, N(0, 0.02) matrices, unit norms): the same shapes, so the same speed in
bfloat16, and the real tokenizer and chat template, but no sensible answers.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import shutil
import sys
from pathlib import Path

import numpy as np

FIRST_PART_BYTES = 55 << 20


def hf_config(config) -> dict:
    """An HF config.json that `ModelConfig.from_hf` reads back as `config`."""
    c = config
    rope = None if c.rope_scaling.rope_type == "default" else dataclasses.asdict(c.rope_scaling)
    eos = list(c.eos_token_id)
    return dict(architectures=[c.architecture], vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=rope,
                max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
                attention_bias=c.attention_bias, sliding_window=c.sliding_window, bos_token_id=c.bos_token_id,
                eos_token_id=eos[0] if len(eos) == 1 else eos or None, torch_dtype="bfloat16")


def prepare(src: str, dest: Path) -> None:
    """Write dest/skeleton/ and the GGUF in two parts with its sha256."""
    from imp_jax.convert import write_tokenizer
    from imp_jax.kernels_pallas import ggml_blocks
    from imp_jax.model.loader import open_checkpoint

    ckpt = open_checkpoint(src)
    if ckpt.kind != "gguf" or ckpt.tensors is None:
        raise SystemExit(f"{src}: expected a GGUF model, got {ckpt.kind}")
    skeleton = dest / "skeleton"
    shutil.rmtree(skeleton, ignore_errors=True)
    skeleton.mkdir(parents=True)
    (skeleton / "config.json").write_text(json.dumps(hf_config(ckpt.config), indent=1))
    (skeleton / "generation_config.json").write_text(json.dumps(ckpt.generation_config, indent=1))
    write_tokenizer(ckpt.tokenizer, skeleton)
    shapes = {}
    for name in ckpt.tensors:
        v = ckpt.tensors[name]
        shapes[name] = list(ggml_blocks.matrix_shape(v) if ggml_blocks.format_of(v) else v.shape)
    (skeleton / "tensors.json").write_text(json.dumps(shapes, indent=0))
    data = ckpt.path.read_bytes()
    for old in dest.glob(ckpt.path.name + ".*"):
        old.unlink()
    (dest / f"{ckpt.path.name}.0").write_bytes(data[:FIRST_PART_BYTES])
    (dest / f"{ckpt.path.name}.1").write_bytes(data[FIRST_PART_BYTES:])
    (dest / f"{ckpt.path.name}.sha256").write_text(f"{hashlib.sha256(data).hexdigest()}  {ckpt.path.name}\n")
    print(f"wrote {skeleton} and {dest / ckpt.path.name}.0/.1/.sha256 ({len(data) / 2**20:.1f} MiB)")


def random_checkpoint(skeleton: Path, dest: Path, seed: int) -> None:
    """An HF dir at dest: the skeleton's files plus model.safetensors of random weights."""
    from safetensors.numpy import save_file

    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(skeleton, dest, ignore=shutil.ignore_patterns("tensors.json"))
    shapes = json.loads((skeleton / "tensors.json").read_text())
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:  # norms (and biases): near one, so activations keep their scale
            tensors[name] = (1 + 0.02 * rng.standard_normal(shape, np.float32)).astype(np.float16)
        else:
            tensors[name] = (0.02 * rng.standard_normal(shape, np.float32)).astype(np.float16)
    save_file(tensors, str(dest / "model.safetensors"))
    print(f"wrote {dest}: {sum(t.size for t in tensors.values()) / 1e6:.0f}M random float16 weights")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    pp = sub.add_parser("prepare", help="here: the skeleton and the GGUF in two parts")
    pp.add_argument("--src", default="smollm2-135m-instruct", help="a GGUF path or alias")
    pp.add_argument("--dest", type=Path, default=Path(".gpu_model"))
    pr = sub.add_parser("random", help="there: an HF checkpoint of random weights from a skeleton")
    pr.add_argument("skeleton", type=Path)
    pr.add_argument("dest", type=Path)
    pr.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.command == "prepare":
        prepare(a.src, a.dest)
    else:
        random_checkpoint(a.skeleton, a.dest, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
