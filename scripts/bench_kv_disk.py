"""Disk tier throughput: write and read back N KV blocks of a real model's geometry through DiskKVStore.

Default: SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), block 16, bfloat16, K and V:
30 * 2 * 16 * 3 * 64 * 2 B = 368,640 B a block. Reports the engine thread's cost of put (the copy
and queueing: into recycled buffers, in bursts the writer drains between; and into fresh ones,
page faults included), the writer's drain rate, get latency (read + verify) from the page cache, the
start-up scan of the files left behind, and the weights digest of a model file when --weights is given.

    PYTHONPATH=. python scripts/bench_kv_disk.py --blocks 512 --out /tmp/kv_disk.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from imp_jax.runtime.kv.kv_disk import DiskKVStore, weights_digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--burst", type=int, default=16, help="blocks put before waiting for the writer")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a fresh temp dir)")
    ap.add_argument("--weights", type=Path, default=None, help="also time weights_digest of this model path")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = ap.parse_args()

    shape = (args.layers, 2, args.block_size, args.kv_heads, args.head_dim)
    payload = np.random.default_rng(0).standard_normal(shape).astype(ml_dtypes.bfloat16)
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(args.blocks)]
    total = payload.nbytes * args.blocks
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        burst = args.burst
        store = DiskKVStore(Path(root), "bench", max_bytes=2 * total, max_pending_bytes=burst * payload.nbytes)
        put_s = []
        t0 = time.perf_counter()
        for i, hsh in enumerate(hashes):    # bursts the writer drains in between, as blocks leave a host tier
            t = time.perf_counter()
            store.put(hsh, payload)
            put_s.append(time.perf_counter() - t)
            if i % burst == burst - 1:
                assert store.flush(600)
        assert store.flush(600)
        write_s = time.perf_counter() - t0
        put_s = put_s[burst:]              # the first burst fills fresh buffers: counted as put_us_cold
        written = store.stats()
        store.close()

        t = time.perf_counter()
        store = DiskKVStore(Path(root), "bench", max_bytes=2 * total)    # a restart: scan the files
        scan_s = time.perf_counter() - t
        get_s = []
        t0 = time.perf_counter()
        for hsh in hashes:
            t = time.perf_counter()
            got = store.get(hsh)
            get_s.append(time.perf_counter() - t)
            assert got is not None and got.shape == shape
        read_s = time.perf_counter() - t0
        read = store.stats()
        store.close()

        gate = threading.Event()                    # put into fresh buffers (page faults), the writer held
        store = DiskKVStore(Path(root) / "held", "bench", max_bytes=2 * total, max_pending_bytes=2 * total,
                            writer_hook=lambda _: gate.wait())
        held_s = []
        for i in range(min(args.blocks, 128)):
            t = time.perf_counter()
            store.put(hashlib.sha256(b"held" + i.to_bytes(8, "little")).digest(), payload)
            held_s.append(time.perf_counter() - t)
        gate.set()
        store.close()

    mb = total / 1e6
    result = {
        "block_shape": list(shape), "dtype": "bfloat16", "block_bytes": payload.nbytes, "blocks": args.blocks,
        "file_bytes": written["bytes_written"] // args.blocks,
        "put_us_cold_median": 1e6 * statistics.median(held_s),
        "put_us_median": 1e6 * statistics.median(put_s), "put_us_p99": 1e6 * sorted(put_s)[int(0.99 * len(put_s))],
        "write_MBps": mb / write_s, "write_ms_per_block": 1e3 * write_s / args.blocks,
        "dropped_writes": written["dropped_writes"], "write_errors": written["write_errors"],
        "scan_ms": 1e3 * scan_s, "scan_files": read["files"],
        "get_ms_median": 1e3 * statistics.median(get_s), "get_ms_p99": 1e3 * sorted(get_s)[int(0.99 * len(get_s))],
        "read_MBps": mb / read_s, "hits": read["hits"], "rejected": read["rejected"],
    }
    if args.weights:
        t = time.perf_counter()
        weights_digest(args.weights)
        result["weights_digest_ms"] = 1e3 * (time.perf_counter() - t)
        files = [args.weights] if args.weights.is_file() else [p for p in args.weights.rglob("*") if p.is_file()]
        result["weights_bytes"] = sum(p.stat().st_size for p in files)
    for k, v in result.items():
        print(f"{k:>20}: {v:.3f}" if isinstance(v, float) else f"{k:>20}: {v}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
