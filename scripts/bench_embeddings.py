"""Embedding throughput of imp_jax's encoder engine vs transformers/torch, and HTTP latency under load.

    PYTHONPATH=. python scripts/bench_embeddings.py [--model all-minilm-l6-v2] [--batches 1 32 256]
                                                    [--torch-threads 2] [--clients 8] [--no-server] [--out FILE]

Offline: sentences/s embedding the same varied sentences (5-40 words) in requests of 1, 32 and 256,
tokenizing included, with imp_jax's EncoderEngine (padded buckets compiled at start-up) and with
transformers' BertModel + mean pooling + L2 normalisation (torch, --torch-threads threads, the
whole request as one batch padded to its longest sentence), in the same process on the same CPU.
The two alternate, --rounds rounds of at least 1 s each per batch size, and each keeps its best
round: on a shared machine other tenants' load comes and goes, and alternating exposes both to it.
torch runs in a child process (spawned by this one, driven round by round over a pipe): in one
process, XLA's and torch's idle worker threads spin while the other works, which slowed torch at
batch 1 by 20x here.
Served: a real `python -m imp_jax.server --embedding-model MODEL`, `--clients` HTTP clients each
sending one-sentence /v1/embeddings requests back to back; p50 / p90 latency and requests/s.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

WORDS = ("the a model server request token vector search query document cat dog fast slow red blue "
         "embedding language paris berlin river mountain coffee music computer network data learning "
         "why how when which because although quickly carefully seventeen 2026 hello world").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))).capitalize() + "." for _ in range(n)]


def rate(fn, n: int, min_s: float = 1.0, min_iters: int = 2) -> float:
    """Sentences per second of `fn()` (n sentences a call), after one warm call."""
    fn()
    iters, t0 = 0, time.perf_counter()
    while iters < min_iters or time.perf_counter() - t0 < min_s:
        fn()
        iters += 1
    return n * iters / (time.perf_counter() - t0)


def imp_embedder(model: str, max_batch: int) -> tuple[object, dict]:
    """imp_jax's embed(texts) on a started EncoderEngine, and its start-up facts."""
    from imp_jax.runtime.core.encoder_engine import EncoderEngine, EncoderEngineConfig

    t0 = time.perf_counter()
    engine = EncoderEngine(EncoderEngineConfig(model, max_batch=max_batch))
    engine.start()
    asyncio.run(engine.wait_ready())
    facts = {"startup_s": time.perf_counter() - t0, "programs": len(engine.buckets), "engine": engine}
    return (lambda batch: asyncio.run(engine.embed(engine.tokenizer.encode_batch(batch)))), facts


def torch_embedder(path: Path, threads: int):
    """transformers' BertModel + mean pooling + L2 normalisation, as sentence-transformers computes it."""
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModel.from_pretrained(str(path)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))

    def embed(batch: list[str]) -> np.ndarray:
        enc = tok(batch, padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"][..., None].float()
        return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()

    return embed


def torch_worker(conn, path: str, threads: int, n: int) -> None:
    """The child process: answers `("rate", b)` with torch's sentences/s at b, `("embed", k)` with vectors."""
    embed = torch_embedder(Path(path), threads)
    texts = sentences(n)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, b = msg
        conn.send(rate(lambda: embed(texts[:b]), b) if kind == "rate" else embed(texts[:b]))


def bench_offline(imp_embed, torch_conn, texts: list[str], batches: list[int], rounds: int) -> dict:
    """{"imp" | "torch": {batch: best sentences/s}}, the two alternating round by round."""
    best: dict = {"imp": {}, "torch": {}}
    for b in batches:
        for _ in range(rounds):
            best["imp"][b] = max(best["imp"].get(b, 0.0), rate(lambda: imp_embed(texts[:b]), b))
            torch_conn.send(("rate", b))
            best["torch"][b] = max(best["torch"].get(b, 0.0), torch_conn.recv())
    return best


def bench_server(model: str, texts: list[str], clients: int, per_client: int, max_batch: int) -> dict:
    import httpx

    from loopback import free_port, wait_for

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # the chat model is required: SmolLM2 with the smallest buckets, so its warm-up stays short
    args = [sys.executable, "-m", "imp_jax.server", "--port", str(port), "--embedding-model", model,
            "--encoder-max-batch", str(max_batch), "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
            "--max-model-len", "64", "--log-level", "warning"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(url + "/ready", 200, timeout=900, proc=proc)

        def client(i: int) -> list[float]:
            rng = random.Random(i)
            lat = []
            with httpx.Client(timeout=60) as c:
                for _ in range(per_client):
                    t0 = time.perf_counter()
                    r = c.post(url + "/v1/embeddings", json={"model": model, "input": rng.choice(texts)})
                    r.raise_for_status()
                    lat.append(time.perf_counter() - t0)
            return lat

        client(999)   # one warm request
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(clients) as pool:
            lat = sorted(x for xs in pool.map(client, range(clients)) for x in xs)
        wall = time.perf_counter() - t0
        stats = httpx.get(url + "/health").json()["encoder_models"][model]
        return {"clients": clients, "requests": len(lat), "p50_ms": 1e3 * statistics.median(lat),
                "p90_ms": 1e3 * lat[int(0.9 * (len(lat) - 1))], "requests_per_s": len(lat) / wall,
                "mean_batch": stats["inputs"] / max(stats["batches"], 1),
                "compilations_after_warmup": stats["compilations_after_warmup"]}
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="all-minilm-l6-v2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--max-batch", type=int, default=32, help="the engine's --encoder-max-batch")
    ap.add_argument("--torch-threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds per batch size (best kept)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--per-client", type=int, default=40)
    ap.add_argument("--no-server", action="store_true", help="skip the HTTP latency run")
    ap.add_argument("--out", default="bench_results/embeddings.json")
    args = ap.parse_args()

    from imp_jax.model.formats.hub import resolve_model

    path = resolve_model(args.model).path
    texts = sentences(max(args.batches))
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=torch_worker, args=(child_conn, str(path), args.torch_threads, len(texts)))
    child.start()
    imp_embed, facts = imp_embedder(args.model, args.max_batch)
    conn.send(("embed", 8))
    v_imp, v_ref = imp_embed(texts[:8]), conn.recv()
    best = bench_offline(imp_embed, conn, texts, args.batches, args.rounds)
    conn.send(None)
    child.join(60)
    imp, ref = {**facts, **best["imp"]}, best["torch"]
    imp["compilations_after_warmup"] = facts["engine"].compilations_after_warmup
    facts["engine"].shutdown()
    print(f"imp_jax encoder: start-up {imp['startup_s']:.1f}s, {imp['programs']} programs; "
          f"max |imp - torch| on 8 sentences {np.abs(v_imp - v_ref).max():.1e}")
    print(f"{'batch':>5} {'imp_jax sent/s':>15} {'torch sent/s':>13} {'ratio':>6}")
    rows = []
    for b in args.batches:
        rows.append({"batch": b, "imp_jax_sent_s": imp[b], "torch_sent_s": ref[b], "ratio": imp[b] / ref[b]})
        print(f"{b:5d} {imp[b]:15.1f} {ref[b]:13.1f} {imp[b] / ref[b]:6.2f}")
    results = {"model": args.model, "torch_threads": args.torch_threads, "max_batch": args.max_batch,
               "rounds": args.rounds,
               "startup_s": imp["startup_s"], "programs": imp["programs"],
               "compilations_after_warmup": imp["compilations_after_warmup"], "offline": rows,
               "max_abs_diff_vs_torch": float(np.abs(v_imp - v_ref).max()), "load_average": os.getloadavg()}
    if not args.no_server:
        served = bench_server(args.model, texts, args.clients, args.per_client, args.max_batch)
        results["served"] = served
        print(f"served, {served['clients']} clients x {args.per_client} one-sentence requests: p50 "
              f"{served['p50_ms']:.1f} ms, p90 {served['p90_ms']:.1f} ms, {served['requests_per_s']:.1f} req/s, "
              f"mean batch {served['mean_batch']:.1f}, compilations after warm-up "
              f"{served['compilations_after_warmup']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
