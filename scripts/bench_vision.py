"""What a picture costs: the vision encoder's time per image and the time to first token a picture adds, ours
against transformers on the same checkpoint (default: a tiny random Idefics3 written by scripts/tiny_vlm.py;
`--model DIR` for an Idefics3 / SmolVLM HF directory). Prints a table and writes JSON.

    python scripts/bench_vision.py [--model DIR] [--rounds 7] [--out bench_results/vision.json]

encoder  one image of F frames (tiles + global image), frames padded to the tile, through our jitted encoder
         (tower + connector: what the engine's encoder program runs) and transformers' `get_image_features`
ttft     a streamed chat answer's first token from `python -m imp_jax.server` on loopback, with no picture,
         a new picture each round (encoder + prefill of its rows) and the same picture again (row and prefix
         caches); transformers: `generate(max_new_tokens=1)` on the same prompt, with and without the picture
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_vlm import hf_processor, write_tiny_idefics3  # noqa: E402

QUESTION = "what is in this picture?"
PRESETS = {"tiny": {},
           "small": dict(vision=dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                                     image_size=128, patch_size=8),
                         text=dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2))}


def median_ms(fn: Callable[[], Any], rounds: int) -> tuple[float, float]:
    """(median, min) wall ms of `fn` over `rounds` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def picture(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def bench_encoder(path: Path, model: Any, frames: list[int], rounds: int) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import torch
    from flax import nnx

    from imp_jax.model.formats.loader import load_model
    from imp_jax.model.vision.idefics3 import patch_mask

    vision = load_model(path).vision
    tile, patch = vision.processor.tile, vision.config.vision.patch_size
    encode = nnx.jit(lambda enc, px, mask: enc(px, mask))
    rows = []
    for n in frames:
        pixels = np.random.default_rng(n).standard_normal((n, 3, tile, tile)).astype(np.float32)
        mask = np.ones((n, tile, tile), np.int64)
        px, pm = jnp.asarray(pixels), jnp.asarray(patch_mask(mask, patch))
        ours = median_ms(lambda: jax.block_until_ready(encode(vision.encoder, px, pm)), rounds)
        tp, tm = torch.tensor(pixels[None]), torch.tensor(mask[None]).bool()
        with torch.no_grad():
            theirs = median_ms(lambda: model.model.get_image_features(pixel_values=tp, pixel_attention_mask=tm), rounds)
        rows.append({"frames": n, "ours_ms": ours[0], "ours_min_ms": ours[1], "transformers_ms": theirs[0],
                     "transformers_min_ms": theirs[1]})
    return rows


def first_token_ms(url: str, model: str, png: bytes | None) -> float:
    import httpx

    content: list[dict[str, Any]] = [{"type": "text", "text": QUESTION}]
    if png is not None:
        content.append({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}})
    body = {"model": model, "max_tokens": 4, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    t = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return (time.perf_counter() - t) * 1e3
    raise RuntimeError("the stream ended without a token")


def bench_server(path: Path, size: tuple[int, int], rounds: int) -> dict[str, Any]:
    import httpx

    port = 18000 + int(time.time()) % 1000
    url = f"http://127.0.0.1:{port}"
    log = open(path / "bench_server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "imp_jax.server", "--model", str(path), "--host", "127.0.0.1",
                             "--port", str(port), "--max-num-seqs", "4"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited {proc.returncode}: see {log.name}")
            time.sleep(0.5)
        while (h := httpx.get(url + "/health", timeout=5).json()).get("programs_compiled", 0) < h.get("programs_total", 0):
            time.sleep(0.5)   # the background compiles would be in every first-token time
        same = picture(*size, seed=0)
        model = path.name   # the served name: the directory's
        text = [first_token_ms(url, model, None) for _ in range(rounds + 1)][1:]
        new = [first_token_ms(url, model, picture(*size, seed=100 + i)) for i in range(rounds + 1)][1:]
        again = [first_token_ms(url, model, same) for _ in range(rounds + 1)][1:]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    med = statistics.median
    return {"text_ms": med(text), "new_picture_ms": med(new), "same_picture_ms": med(again),
            "picture_adds_ms": med(new) - med(text)}


def bench_transformers_ttft(path: Path, model: Any, size: tuple[int, int], rounds: int) -> dict[str, Any]:
    import torch
    from PIL import Image

    processor = hf_processor(path)
    image = Image.open(io.BytesIO(picture(*size, seed=0))).convert("RGB")
    prompt = f"<|im_start|>user\n{QUESTION}{{}}<|im_end|>\n<|im_start|>assistant\n"
    with_image = processor(text=[prompt.format("<image>")], images=[[image]], return_tensors="pt")
    text_only = processor.tokenizer([prompt.format("")], return_tensors="pt")

    def run(inputs: Any) -> None:
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=1, do_sample=False)

    text, pic = median_ms(lambda: run(text_only), rounds)[0], median_ms(lambda: run(with_image), rounds)[0]
    return {"text_ms": text, "picture_ms": pic, "picture_adds_ms": pic - text,
            "prompt_tokens": int(with_image["input_ids"].shape[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an Idefics3 / SmolVLM HF directory (default: a random one)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="the random model's size: tiny (the tests'), small (a 128-px, 64-row-per-frame tower of "
                         "hidden 256 over a 4-layer decoder of hidden 256)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--frames", default="1,5,13", help="frame counts of the encoder part")
    ap.add_argument("--size", default="60x45", help="the TTFT part's picture, WIDTHxHEIGHT")
    ap.add_argument("--skip-server", action="store_true", help="only the encoder and transformers' parts")
    ap.add_argument("--out", type=Path, default=Path("bench_results/vision.json"))
    args = ap.parse_args()
    import transformers

    path = args.model or Path(tempfile.mkdtemp(prefix="tiny-idefics3-"))
    if args.model is None:
        model = write_tiny_idefics3(path, **PRESETS[args.preset])
    else:
        model = transformers.AutoModelForImageTextToText.from_pretrained(path, torch_dtype="float32").eval()
    size = tuple(int(v) for v in args.size.split("x"))
    result: dict[str, Any] = {"model": str(args.model or f"{args.preset} random Idefics3 (scripts/tiny_vlm.py)"),
                              "rounds": args.rounds}
    result["encoder"] = bench_encoder(path, model, [int(f) for f in args.frames.split(",")], args.rounds)
    print("frames  ours ms  transformers ms")
    for row in result["encoder"]:
        print(f"{row['frames']:>6}  {row['ours_ms']:7.2f}  {row['transformers_ms']:15.2f}")
    result["transformers_ttft"] = bench_transformers_ttft(path, model, size, args.rounds)
    t = result["transformers_ttft"]
    print(f"transformers TTFT: text {t['text_ms']:.1f} ms, with the picture {t['picture_ms']:.1f} ms "
          f"({t['prompt_tokens']} prompt tokens)")
    if not args.skip_server:
        result["server_ttft"] = s = bench_server(path, size, args.rounds)
        print(f"server TTFT: text {s['text_ms']:.1f} ms, a new picture {s['new_picture_ms']:.1f} ms, "
              f"the same picture again {s['same_picture_ms']:.1f} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
