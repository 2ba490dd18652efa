"""Chain hashes of KV blocks: what a block's prefix-cache key is taken of, shared by every tier.

A block's preimage is its parent's digest, the partition's extra key (kv_blocks: Sequence.cache_key) and
its token ids; its hash is SHA-256 of that, so a block's hash names its whole prefix and partition.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Iterator, Sequence


def key_bytes(extra_key: Hashable) -> bytes:
    """A canonical, injective encoding of an extra key: None, str, bytes, int or tuples of them."""
    if extra_key is None:
        return b"n"
    if isinstance(extra_key, str):
        data, tag = extra_key.encode("utf-8", "surrogatepass"), b"s"
    elif isinstance(extra_key, bytes):
        data, tag = extra_key, b"b"
    elif isinstance(extra_key, int) and not isinstance(extra_key, bool):
        data, tag = str(extra_key).encode(), b"i"
    elif isinstance(extra_key, tuple):
        data, tag = b"".join(key_bytes(k) for k in extra_key), b"t"
    else:
        raise TypeError(f"prefix-cache extra key of type {type(extra_key).__name__}")
    return tag + len(data).to_bytes(8, "little") + data


def block_preimage(parent: bytes | None, token_ids: Sequence[int], extra_key: Hashable = None) -> bytes:
    """The bytes a block's hash is taken of: parent digest, extra key, token ids as int64."""
    head = parent or b""
    return bytes((len(head),)) + head + key_bytes(extra_key) + array("q", token_ids).tobytes()


def hash_block(preimage: bytes) -> bytes:
    """SHA-256 of a block's preimage: collision-resistant, unlike Python's 64-bit hash()."""
    return hashlib.sha256(preimage).digest()


def prefix_hashes(token_ids: Sequence[int], block_size: int, extra_key: Hashable = None) -> Iterator[bytes]:
    """The chained hashes of the prompt's full blocks that a prefix lookup may hit (all but the block of the
    last token, as in match_prefix), computed lazily: a caller that stops early pays only for what it read."""
    parent = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(block_preimage(parent, token_ids[i * block_size:(i + 1) * block_size], extra_key))
        yield parent


def durable_preimage(preimage: bytes) -> bool:
    """Whether a block's extra key means the same after a restart, so the block may go to disk: None or a
    string (a request's cache_salt: the API key's digest). A tuple is per-process: a LoRA key carries its
    adapter's load generation (a counter), a private key (prompt scoring) a fresh uuid4."""
    return preimage[1 + preimage[0]:2 + preimage[0]] in (b"n", b"s")
