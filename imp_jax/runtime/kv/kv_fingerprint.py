"""The identity of a model's KV blocks: what must match before a block written by one process may serve another.

`model_fingerprint` is pure (identity in, hex out); `weights_digest` turns a checkpoint path into the
weights part of it, reading a few MiB per file rather than the whole model, so start-up stays fast.
A wrong "same" costs wrong outputs and a wrong "different" only a cold disk cache: every rule below
errs toward "different".
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

import xxhash

FINGERPRINT_VERSION = 1     # bump when the rule (or the disk layout a fingerprint names) changes
HEAD = 1 << 20              # bytes read from the start of every weight file (GGUF metadata, arch keys)
MAX_HEADER = 64 << 20       # the most of a safetensors JSON header read whole
SAMPLES = 1024              # 4 KiB chunks read at evenly spaced offsets past the head
CHUNK = 4 << 10
SMALL = 8 << 20             # files up to this size are read whole


def model_fingerprint(weights: str, *, kv_dtype: str, block_size: int, num_layers: int, num_kv_heads: int,
                      head_dim: int, tp_size: int = 1, compute_dtype: str = "", model_class: str = "",
                      adapter: str = "", payload_layout: str = "",
                      extra: Mapping[str, str | int | float | bool] | None = None) -> str:
    """32 hex digits naming everything a KV block's bytes depend on besides its tokens.

    weights: `weights_digest(path)`; kv_dtype and compute_dtype: the cache's and the model's dtype names
    (the same tokens computed in float32 or bfloat16 give different KV); the cache geometry; tp_size (how
    the kv heads are split, should a payload ever be stored per shard); model_class: a --model-class
    override (another model definition over the same weights); payload_layout: how the caller lays a block
    out in its payload (e.g. "layer,kv,token,head,dim"), so a changed layout never reads old files.
    extra: anything else that changes the KV (rope scaling overrides, a kernel with other numerics).

    adapter: leave empty unless every block of this store is computed under one fixed adapter. Adapters
    loaded at run time partition blocks through the chain hash's extra key instead (kv_hash.key_bytes
    of Sequence.cache_key: the request's cache_salt, "key:" + the API key's SHA-256 or None, and for a
    LoRA request ("lora", name, lora.adapter_digest: the adapter's content, the same after a restart).
    Blocks of a private key (prompt scoring: a fresh uuid4 per request) are never hit again; do not store them
    (kv_hash.durable_key says which keys may be stored).
    """
    fields = {"version": FINGERPRINT_VERSION, "weights": weights, "kv_dtype": kv_dtype, "block_size": block_size,
              "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim, "tp_size": tp_size,
              "compute_dtype": compute_dtype, "model_class": model_class, "adapter": adapter,
              "payload_layout": payload_layout, "extra": dict(sorted((extra or {}).items()))}
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def weights_digest(path: str | os.PathLike[str], *, full: bool = False, use_mtime: bool = True) -> str:
    """32 hex digits standing for the checkpoint at `path` (a GGUF file, an HF or converted folder).

    Per weight file (a folder's regular files, sorted, hidden ones skipped; links followed), in order: its
    relative name, size and (use_mtime) modification time in ns; then its bytes: whole if `full` or at most
    8 MiB; else the first 1 MiB (GGUF metadata with the architecture keys; for safetensors the whole JSON
    header, names, dtypes, shapes and offsets of every tensor, up to 64 MiB) and 1024 chunks of 4 KiB at
    evenly spaced offsets after it, the last one ending the file.
    Cost: one stat and ~5 MiB of reads per file, ~1 ms per file warm, 10-30 ms cold on NVMe (1024 seeks).
    Blind spot: an edit confined to a small part of the bytes of a file that keeps its name, size and mtime
    (cp -p, rsync -a) is missed with probability (1 - changed fraction) ** 1024, e.g. ~36% when 0.1% of the
    file changed, ~1e-42 when 9% did (a LoRA merged into q and v). Pass full=True to rule that out (the
    whole model read once: as fast as the disk, xxh3 hashes at ~40 GB/s).
    """
    root = Path(path)
    files = [root] if root.is_file() else sorted(
        p for p in root.rglob("*") if p.is_file() and not any(x.startswith(".") for x in p.relative_to(root).parts))
    if not files:
        raise FileNotFoundError(f"{root}: no weight file")
    h = xxhash.xxh3_128()
    for f in files:
        st = f.stat()
        name = f.name if f == root else f.relative_to(root).as_posix()
        h.update(json.dumps([name, st.st_size, st.st_mtime_ns if use_mtime else 0]).encode())
        _hash_file(h, f, st.st_size, full)
    return h.hexdigest()


def _hash_file(h: xxhash.xxh3_128, path: Path, size: int, full: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if full or size <= SMALL:
            for off in range(0, size, HEAD):
                h.update(os.pread(fd, HEAD, off))
            return
        head = HEAD
        if path.suffix == ".safetensors":
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            head = max(HEAD, min(8 + n, MAX_HEADER, size))
        for off in range(0, head, HEAD):
            h.update(os.pread(fd, min(HEAD, head - off), off))
        span = size - head - CHUNK
        for i in range(SAMPLES):
            h.update(os.pread(fd, CHUNK, head + i * span // (SAMPLES - 1)))
    finally:
        os.close(fd)
