"""Pictures for the image tests: a PIL image of gradients and noise (the resamplers have something to do) and
a PNG of colour bands and noise, each the same for the same seed; and a tiny vision checkpoint served on loopback."""
from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from PIL import Image
from support.servers import LiveServer, wait_for


def synthetic_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth gradients plus noise (LANCZOS has something to do), RGB uint8."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], -1)
    noisy = base + rng.normal(0, 30, base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def picture(width: int, height: int, seed: int) -> bytes:
    """A PNG of smooth colour bands plus noise (the same seed, the same picture)."""
    rng = np.random.default_rng(seed)
    x = np.linspace(0, 1, width)[None, :, None] * rng.uniform(50, 255, 3) + rng.uniform(0, 60, 3)
    y = np.linspace(0, 1, height)[:, None, None] * rng.uniform(0, 120, 3)
    noise = rng.normal(0, 20, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(x + y + noise, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@contextlib.contextmanager
def served_checkpoint(path: Path, budget: int, *extra: str) -> Iterator[LiveServer]:
    """`python -m imp_jax.server` on the checkpoint at `path` (4 sequences, a prefill budget of `budget` tokens, a
    1024-token context, 128 KV blocks, `extra` flags), ready, its served name (the directory's) in `.model`;
    it must exit cleanly after."""
    live = LiveServer(["--model", str(path), "--max-num-seqs", "4", "--max-num-batched-tokens", str(budget),
                       "--max-model-len", "1024", "--num-kv-blocks", "128", *extra], path / "server.log")
    try:
        wait_for(live.url + "/ready", 200, timeout=600, proc=live.proc)
        live.model = path.name
        yield live
    finally:
        assert live.stop() in (None, 0), live.log_text()[-3000:]


def hf_greedy_logprobs(hf, ids: list[int], inputs: Callable[[list[int]], dict], n: int = 8
                       ) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens (`generate`, EOS and every knob off) after `ids`, and its logprobs [n, vocab] at
    each of them from one forward pass over the prompt and the tokens (generate's own logits drift ~1e-3 from
    its forward); `inputs(seq)` gives the model's keyword inputs for a sequence (its pixels, image token types)."""
    import torch
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None,
                                           repetition_penalty=1.0, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        tokens = hf.generate(**inputs(ids), generation_config=config)[0, len(ids):].tolist()
        logits = hf(**inputs(ids + tokens[:-1])).logits[0, len(ids) - 1:]
    return tokens, torch.log_softmax(logits.float(), -1).numpy()
