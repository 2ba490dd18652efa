"""Make tests/data/gpt_oss: a tiny random gpt-oss checkpoint and its GGUF from llama.cpp's own converter.

    python scripts/make_gpt_oss_fixture.py [--llama-cpp SRC] [--llama-server BIN] [--out tests/data/gpt_oss]

Writes `hf/` (config.json, model.safetensors: bfloat16, experts dense, the transformers reference) and
`tiny-gpt-oss-mxfp4.gguf`: the same weights saved as gpt-oss ships them (experts as MXFP4 `_blocks` /
`_scales`, `quantization_config.quant_method = mxfp4`) and run through llama.cpp's vendored
`convert_hf_to_gguf.py --outtype f32` (experts stay MXFP4, repacked to GGML blocks; the rest float32).
Every weight is exactly representable in bfloat16 and the experts' values are exactly their MXFP4 codes,
so both files hold the same numbers. With --llama-server, `llama_cpp_greedy.json` records llama.cpp's
greedy tokens on that GGUF (f32 KV cache, flash attention off).

The converter hashes the tokenizer's pre-tokenizer output to name it and knows no tiny tokenizer's
hash, so `get_vocab_base_pre` is answered with gpt-oss's own "gpt-4o"; nothing else is patched.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PEERS = Path.home() / ".cache/imp_jax/peers"
SRC = PEERS / "src/llama_cpp_python-0.3.36/vendor/llama.cpp"
SERVER = PEERS / "llama.cpp-0.3.36/bin/llama-server"
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64}
CONFIG = {"vocab_size": 160, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "num_local_experts": 4,
          "num_experts_per_tok": 2, "sliding_window": 4, "max_position_embeddings": 512, "rope_parameters": YARN}
GGUF = "tiny-gpt-oss-mxfp4.gguf"
PROMPTS = [[5, 17, 100, 33, 90, 12, 7, 150, 3, 44, 61, 99], [9, 2, 140]]   # token ids, llama.cpp adds no BOS
NEW_TOKENS = 10
_CONVERT = """import sys
sys.path[:0] = [{src!r}, {src!r} + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-4o"
import convert_hf_to_gguf
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


def tiny_model(seed: int = 0):
    """A random GptOssForCausalLM, every parameter rounded to bfloat16; experts are set by `mxfp4_experts`."""
    import torch
    import transformers

    cfg = transformers.GptOssConfig(**CONFIG)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("sinks", "embed_tokens.weight")):
                p.normal_(0, 1.0)
            elif n.endswith(("router.weight", "lm_head.weight")):
                p.normal_(0, 0.5)
            elif p.ndim == 1 or n.endswith("_bias"):
                p.add_(torch.randn_like(p) * 0.1)
            p.copy_(p.to(torch.bfloat16).float())
    return model


def mxfp4_experts(model, seed: int = 7) -> dict[str, np.ndarray]:
    """Random MXFP4 codes and scales for every expert matrix, as gpt-oss stores them ([E, out, G, 16] and
    [E, out, G]); the model's experts are set to their values. Returns the `_blocks` / `_scales` tensors."""
    import torch

    from imp_jax.model.architectures.gpt_oss import dequantize_mxfp4

    rng, out = np.random.default_rng(seed), {}
    c = model.config
    E, H, I = c.num_local_experts, c.hidden_size, c.intermediate_size
    for i, layer in enumerate(model.model.layers):
        for name, (rows, cols) in (("gate_up_proj", (2 * I, H)), ("down_proj", (H, I))):
            blocks = rng.integers(0, 256, (E, rows, cols // 32, 16)).astype(np.uint8)
            scales = rng.integers(118, 122, (E, rows, cols // 32)).astype(np.uint8)
            with torch.no_grad():   # transformers holds [E, in, out]
                getattr(layer.mlp.experts, name).copy_(torch.from_numpy(dequantize_mxfp4(blocks, scales)).transpose(1, 2))
            pre = f"model.layers.{i}.mlp.experts.{name}"
            out[pre + "_blocks"], out[pre + "_scales"] = blocks, scales
    return out


def convert(hf_dir: Path, out: Path, src: Path) -> None:
    """llama.cpp's convert_hf_to_gguf.py, in a subprocess that imports the vendored gguf-py."""
    subprocess.run([sys.executable, "-c", _CONVERT.format(src=str(src)), str(hf_dir), "--outtype", "f32",
                    "--outfile", str(out)], check=True, env={**os.environ, "PYTHONPATH": ""})


def llama_cpp_greedy(server: Path, gguf: Path, port: int = 8097) -> list[list[int]]:
    """Greedy tokens of each prompt from llama-server (float32 KV cache, no flash attention)."""
    proc = subprocess.Popen([str(server), "-m", str(gguf), "--port", str(port), "-t", "2", "-c", "256", "-np", "1",
                             "-ctk", "f32", "-ctv", "f32", "-fa", "off"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                time.sleep(0.2)
        tokens = []
        for prompt in PROMPTS:
            body = {"prompt": prompt, "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1, "cache_prompt": False,
                    "return_tokens": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            reply = json.load(urllib.request.urlopen(req))
            assert reply["tokens_evaluated"] == len(prompt), reply["tokens_evaluated"]
            tokens.append(reply["tokens"])
        return tokens
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, default=SRC, help="llama.cpp source (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-server", type=Path, default=SERVER if SERVER.exists() else None)
    ap.add_argument("--out", type=Path, default=ROOT / "tests/data/gpt_oss")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import safetensors.torch
    from tiny_models import write_tiny_tokenizer

    model = tiny_model()
    packed = mxfp4_experts(model)
    (args.out / "hf").mkdir(parents=True, exist_ok=True)
    import torch

    model.to(torch.bfloat16).save_pretrained(args.out / "hf", safe_serialization=True)
    (args.out / "hf/generation_config.json").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mx = Path(tmp) / "gpt-oss-mxfp4"
        shutil.copytree(args.out / "hf", mx)
        state = {n: t for n, t in safetensors.torch.load_file(str(mx / "model.safetensors")).items()
                 if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
        state.update({n: torch.from_numpy(v) for n, v in packed.items()})
        safetensors.torch.save_file(state, str(mx / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((mx / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        (mx / "config.json").write_text(json.dumps(cfg, indent=2))
        write_tiny_tokenizer(mx)
        convert(mx, args.out / GGUF, args.llama_cpp)
    print(f"wrote {args.out / 'hf'} and {args.out / GGUF} ({(args.out / GGUF).stat().st_size} bytes)")
    if args.llama_server:
        tokens = llama_cpp_greedy(args.llama_server, args.out / GGUF)
        record = {"prompts": PROMPTS, "greedy_tokens": tokens,
                  "llama_server": f"{args.llama_server.parent.parent.name}: -ctk f32 -ctv f32 -fa off, "
                                  f"temperature 0, top_k 1"}
        (args.out / "llama_cpp_greedy.json").write_text(json.dumps(record) + "\n")
        print("llama.cpp greedy tokens:", tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
