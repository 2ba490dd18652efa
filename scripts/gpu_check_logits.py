"""The model's logits with the Pallas attention kernel against XLA attention, on the same weights:
the check that the kernel is right inside the model's program (paged cache written by the model,
every layer, a prefill then decode steps), not only alone against the oracle.

Builds the checkpoint twice through the engine's loader (bfloat16; the Pallas kernel compiled on a
Hopper GPU, interpreted elsewhere), runs one prompt's prefill and --decode-steps teacher-forced
decode steps through the engine's forward (runtime/step_programs.model_forward), and compares.
Passes when both are finite and the largest difference is within --tolerance of the largest |logit|.

    python scripts/gpu_check_logits.py --model PATH [--prompt-len 200] [--out logits.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paged import PagedRunner  # noqa: E402

from imp_jax.kernels_pallas.backends import Kernels, is_hopper  # noqa: E402
from imp_jax.model.base import ModelOptions  # noqa: E402
from imp_jax.model.formats.loader import build_model, open_checkpoint  # noqa: E402
from imp_jax.runtime.execution.batch import SeqChunk  # noqa: E402

BLOCK_SIZE = 16


def kernels(attention: str) -> Kernels:
    """The kernels an engine on this device would run, with `attention` forced; the Pallas kernel
    interpreted off a Hopper GPU."""
    gpu = jax.local_devices()[0].platform == "gpu"
    return Kernels(attention=attention, dynamic_skips=not gpu,
                   pallas_interpret=attention == "pallas" and not is_hopper(jax.local_devices()[0]))


def model_logits(path: str, attention: str, prompt: list[int], forced: list[int]) -> tuple[np.ndarray, float]:
    """Logits [len(prompt) + len(forced), V] of one prefill and a decode step per forced token; and
    the seconds it took (load and compile included)."""
    t0 = time.perf_counter()
    model = build_model(open_checkpoint(path), ModelOptions(dtype=jnp.bfloat16, kernels=kernels(attention))).model
    total = len(prompt) + len(forced)
    blocks = -(-total // BLOCK_SIZE)
    runner = PagedRunner(model, num_blocks=blocks + 1, block_size=BLOCK_SIZE, max_blocks=blocks)
    table = list(range(1, blocks + 1))
    tokens = max(16, 1 << (len(prompt) - 1).bit_length())
    rows = [runner.run([SeqChunk(prompt, 0, table)], num_tokens=tokens, num_seqs=2)[0]]
    for i, token in enumerate(forced):
        rows.append(runner.run([SeqChunk([token], len(prompt) + i, table)], num_tokens=16, num_seqs=2)[0])
    return np.concatenate(rows).astype(np.float32), time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model path or alias")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--tolerance", type=float, default=0.05, help="of the largest |logit|")
    p.add_argument("--out", help="write the result as JSON here")
    a = p.parse_args()
    vocab = open_checkpoint(a.model).config.vocab_size
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, vocab, a.prompt_len).tolist()
    forced = rng.integers(0, vocab, a.decode_steps).tolist()
    xla, xla_s = model_logits(a.model, "xla", prompt, forced)
    pallas, pallas_s = model_logits(a.model, "pallas", prompt, forced)
    diff = np.abs(pallas - xla)
    scale = float(np.abs(xla).max())
    n = len(prompt)
    result = dict(model=a.model, device=jax.local_devices()[0].device_kind, positions=len(xla), vocab=vocab,
                  interpret=kernels("pallas").pallas_interpret, max_abs_logit=scale,
                  max_abs_diff=float(diff.max()), prefill_max_abs_diff=float(diff[:n].max()),
                  decode_max_abs_diff=float(diff[n:].max()) if forced else None,
                  top1_agreement=float((pallas.argmax(-1) == xla.argmax(-1)).mean()),
                  finite=bool(np.isfinite(pallas).all() and np.isfinite(xla).all()),
                  xla_s=xla_s, pallas_s=pallas_s, tolerance=a.tolerance)
    result["ok"] = result["finite"] and result["max_abs_diff"] <= a.tolerance * scale
    print(json.dumps(result, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
