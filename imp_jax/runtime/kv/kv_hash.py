"""Chain hashes of KV blocks: what a block's prefix-cache key is taken of, shared by every tier.

A block's preimage is its parent's digest, the partition's extra key (kv_blocks: Sequence.cache_key) and
its token ids; its hash is SHA-256 of that, so a block's hash names its whole prefix and partition.
An extra key may vary by block (`ImageKeys`: a block holding an image's tokens is keyed on its pixels too).
"""
from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class ImageKeys:
    """A prompt's extra key when it holds images: a block with any token of an image is keyed on the image's
    digest as well, so equal token ids over different pictures share no block from the first image on, while
    the blocks before it (a shared system prompt) keep the plain key and stay shared."""

    base: Hashable
    spans: tuple[tuple[int, int, str], ...]   # per image, in prompt order: (first token, end token, digest hex)

    def at(self, start: int, end: int) -> Hashable:
        """The extra key of the block of tokens [start, end)."""
        digests = tuple(d for a, b, d in self.spans if a < end and start < b)
        return (self.base, "images", *digests) if digests else self.base


def block_key(extra_key: Hashable, start: int, end: int) -> Hashable:
    """The extra key of the block of tokens [start, end): an `ImageKeys`' for that block, any other as it is."""
    return extra_key.at(start, end) if isinstance(extra_key, ImageKeys) else extra_key


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
        key = block_key(extra_key, i * block_size, (i + 1) * block_size)
        parent = hash_block(block_preimage(parent, token_ids[i * block_size:(i + 1) * block_size], key))
        yield parent


def key_from_bytes(data: bytes) -> tuple[Hashable, bytes]:
    """The inverse of key_bytes on the start of `data`: (the extra key, the bytes after its encoding)."""
    tag = data[:1]
    if tag == b"n":
        return None, data[1:]
    n = int.from_bytes(data[1:9], "little")
    body, rest = data[9:9 + n], data[9 + n:]
    if tag == b"s":
        return body.decode("utf-8", "surrogatepass"), rest
    if tag == b"b":
        return body, rest
    if tag == b"i":
        return int(body), rest
    if tag != b"t":
        raise ValueError(f"prefix-cache extra key tag {tag!r}")
    items: list[Hashable] = []
    while body:
        item, body = key_from_bytes(body)
        items.append(item)
    return tuple(items), rest


def durable_key(extra_key: Hashable) -> bool:
    """Whether an extra key means the same after a restart: None, a string (a request's cache_salt: the API
    key's digest), a LoRA key (salt, "lora", name, content digest: lora.adapter_digest), or either with the
    digests of the images its block holds (ImageKeys.at: pixels' hashes). Anything else is per-process: a
    private key (prompt scoring) carries a fresh uuid4, an older LoRA key a load counter."""
    if extra_key is None or isinstance(extra_key, str):
        return True
    if isinstance(extra_key, tuple) and len(extra_key) > 2 and extra_key[1] == "images":
        return durable_key(extra_key[0]) and all(isinstance(d, str) for d in extra_key[2:])
    return (isinstance(extra_key, tuple) and len(extra_key) == 4 and extra_key[1] == "lora"
            and all(k is None or isinstance(k, str) for k in extra_key))


def durable_preimage(preimage: bytes) -> bool:
    """Whether a block's extra key is durable (durable_key), so the block may go to disk."""
    return durable_key(key_from_bytes(preimage[1 + preimage[0]:])[0])
