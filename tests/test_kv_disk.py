"""Disk tier store: round trips, LRU under a byte cap, restarts, and every bad file rejected, counted, removed."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import struct
import threading
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import xxhash

from imp_jax.paths import UnsafePathError
from imp_jax.runtime.kv.kv_disk import (DIGEST_SIZE, DiskKVStore, Rejected, block_digest, decode_block, encode_header,
                                     model_fingerprint, weights_digest)

FP = "0123abcd"
SHAPE = (2, 2, 4, 3, 8)             # layers, K/V, tokens, kv heads, head_dim: 384 bf16 = 768 bytes


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def block(i: int, dtype: object = ml_dtypes.bfloat16, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    """A payload that says which block it is: equal only to itself."""
    return np.random.default_rng(i).standard_normal(shape).astype(dtype)


def same(a: np.ndarray | None, b: np.ndarray) -> bool:
    return a is not None and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def file_size(shape: tuple[int, ...] = SHAPE, dtype: object = ml_dtypes.bfloat16) -> int:
    arr = np.zeros(shape, dtype)
    return len(encode_header(FP, h(0), arr)) + arr.nbytes + DIGEST_SIZE


def path_of(root: Path, block_hash: bytes, fp: str = FP) -> Path:
    return root / fp / block_hash.hex()[:2] / f"{block_hash.hex()}.kvb"


@pytest.fixture
def store(tmp_path: Path):
    s = DiskKVStore(tmp_path, FP, 1 << 20)
    yield s
    s.close()


@pytest.mark.parametrize("dtype,shape", [(ml_dtypes.bfloat16, SHAPE), (np.uint16, (3, 5)), (np.float32, (7,)),
                                         (np.float16, (2, 1, 3)), (np.int8, ()), (np.float32, (0, 4))])
def test_round_trip_keeps_dtype_shape_and_bytes(store: DiskKVStore, tmp_path: Path, dtype: object,
                                                shape: tuple[int, ...]) -> None:
    a = block(1, dtype, shape)
    store.put(h(1), a)
    assert store.flush()
    b = store.get(h(1))
    assert same(b, a) and b.flags.writeable
    assert store.stats()["hits"] == 1 and store.stats()["writes"] == 1
    assert oct(path_of(tmp_path, h(1)).stat().st_mode & 0o777) == "0o600"


def test_put_copies_the_callers_array_and_takes_any_layout(store: DiskKVStore) -> None:
    a = block(2, np.float32, (4, 6))
    strided, swapped = a.copy()[:, ::2], a.astype(">f4")
    store.put(h(2), strided)
    store.put(h(3), swapped)
    expected = strided.copy()
    strided[...] = 0                                     # reusing the buffer after put must not change the block
    assert store.flush()
    assert same(store.get(h(2)), expected)
    assert np.array_equal(store.get(h(3)), a)


def test_written_blocks_buffers_are_reused_without_mixing_blocks(store: DiskKVStore) -> None:
    for i in range(6):
        store.put(h(i), block(i))
        if i % 2:
            assert store.flush()
    assert store.flush() and store._spare_bytes > 0      # noqa: SLF001  (the recycling this pins)
    held = [store.get(h(i)) for i in range(6)]
    store.put(h(9), block(9))                            # refills a spare buffer: earlier results must not change
    assert store.flush()
    assert all(same(held[i], block(i)) for i in range(6)) and same(store.get(h(9)), block(9))


def test_get_serves_a_queued_block_before_it_is_written(tmp_path: Path) -> None:
    gate = threading.Event()
    s = DiskKVStore(tmp_path, FP, 1 << 20, writer_hook=lambda _: gate.wait())
    s.put(h(1), block(1))
    assert s.contains(h(1)) and same(s.get(h(1)), block(1))
    assert not path_of(tmp_path, h(1)).exists()
    gate.set()
    s.close()
    assert path_of(tmp_path, h(1)).exists()


def test_lru_evicts_least_recently_used_under_byte_cap(tmp_path: Path) -> None:
    s = DiskKVStore(tmp_path, FP, 3 * file_size() + 100)
    for i in range(3):
        s.put(h(i), block(i))
    assert s.flush()
    assert s.get(h(0)) is not None                      # 0 used last: 1 is now the oldest
    s.put(h(3), block(3))
    assert s.flush()
    st = s.stats()
    assert st["evictions"] == 1 and st["files"] == 3 and st["bytes"] == 3 * file_size() <= s.max_bytes
    assert not s.contains(h(1)) and s.get(h(1)) is None and not path_of(tmp_path, h(1)).exists()
    assert all(same(s.get(h(i)), block(i)) for i in (0, 2, 3))
    s.close()


def test_block_larger_than_the_cap_is_dropped(tmp_path: Path) -> None:
    s = DiskKVStore(tmp_path, FP, file_size() - 1)   # the payload fits, its file does not
    s.put(h(1), block(1))
    s.close()
    assert s.stats()["dropped_writes"] == 1 and s.stats()["files"] == 0


def test_restart_reuses_blocks_in_mtime_order(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    first = DiskKVStore(tmp_path, FP, 1 << 20)
    for i in range(3):
        first.put(h(i), block(i))
    with caplog.at_level(logging.INFO, logger="imp_jax.kv_disk"):
        first.close()
    assert [r.getMessage() for r in caplog.records if "closed" in r.getMessage()] == [
        "KV disk tier closed: 3 blocks (0 MiB) written this run, 0 dropped; 3 files (0 MiB) kept for the next start"]
    for i, age in ((0, 10), (1, 30), (2, 20)):          # 1 oldest, then 2, then 0
        t = time.time() - age
        os.utime(path_of(tmp_path, h(i)), (t, t))
    second = DiskKVStore(tmp_path, FP, 2 * file_size() + 100)   # smaller cap: the scan evicts the oldest
    assert second.stats()["files"] == 2 and second.stats()["evictions"] == 1
    assert not second.contains(h(1)) and not path_of(tmp_path, h(1)).exists()
    assert same(second.get(h(0)), block(0)) and same(second.get(h(2)), block(2))
    second.close()


def test_another_fingerprint_never_sees_the_blocks(tmp_path: Path) -> None:
    a = DiskKVStore(tmp_path, FP, 1 << 20)
    a.put(h(1), block(1))
    a.close()
    b = DiskKVStore(tmp_path, "ffff0000", 1 << 20)
    assert not b.contains(h(1)) and b.get(h(1)) is None
    # a file copied from the first model's directory into the second's is read as foreign and removed
    dst = path_of(tmp_path, h(1), "ffff0000")
    dst.parent.mkdir(mode=0o700)
    dst.write_bytes(path_of(tmp_path, h(1)).read_bytes())
    b.close()
    b = DiskKVStore(tmp_path, "ffff0000", 1 << 20)
    assert b.contains(h(1)) and b.get(h(1)) is None
    assert b.stats()["rejected_foreign"] == 1 and not dst.exists() and b.stats()["files"] == 0
    b.close()


def reopened_after(tmp_path: Path, tamper) -> DiskKVStore:
    """A store's block 1 tampered with on disk by `tamper(path)`, then read by a new store (as after a crash)."""
    s = DiskKVStore(tmp_path, FP, 1 << 20)
    s.put(h(1), block(1))
    s.close()
    tamper(path_of(tmp_path, h(1)))
    return DiskKVStore(tmp_path, FP, 1 << 20)


def planted(path: Path, header_hash: bytes, payload: np.ndarray, digest: bytes | None = None) -> None:
    header = encode_header(FP, header_hash, payload)
    path.write_bytes(header + payload.tobytes() + (digest or block_digest(header, payload)))


@pytest.mark.parametrize("reason,tamper", [
    ("torn", lambda p: p.write_bytes(p.read_bytes()[:-100])),
    ("torn", lambda p: p.write_bytes(p.read_bytes()[:10])),
    ("corrupt", lambda p: p.write_bytes(flip(p.read_bytes(), -DIGEST_SIZE - 5))),      # a payload byte
    ("corrupt", lambda p: p.write_bytes(p.read_bytes().replace(b'"shape":[2,2,4,3,8]', b'"shape":[2,2,4,8,3]'))),
    ("header", lambda p: p.write_bytes(b"GGUF" + p.read_bytes()[4:])),
    ("corrupt", lambda p: planted(p, h(1), block(1), digest=bytes(DIGEST_SIZE))),    # right header, wrong digest
    ("misnamed", lambda p: planted(p, h(2), block(2))),                             # valid, of another block
])
def test_bad_file_is_rejected_counted_and_removed(tmp_path: Path, reason: str, tamper) -> None:
    s = reopened_after(tmp_path, tamper)
    assert s.contains(h(1))                              # indexed by name: only a read can tell
    assert s.get(h(1)) is None
    st = s.stats()
    assert st[f"rejected_{reason}"] == 1 and st["rejected"] == 1 and st["misses"] == 1 and st["hits"] == 0
    assert st["files"] == 0 and st["bytes"] == 0
    assert not path_of(tmp_path, h(1)).exists() and not s.contains(h(1))
    s.put(h(1), block(1))                                # and the block can be stored again
    assert s.flush() and same(s.get(h(1)), block(1))
    s.close()


def flip(data: bytes, at: int) -> bytes:
    b = bytearray(data)
    b[at] ^= 0x01
    return bytes(b)


def test_no_single_byte_change_or_cut_is_ever_served() -> None:
    a = block(1)
    header = encode_header(FP, h(1), a)
    good = header + a.tobytes() + block_digest(header, a)
    assert same(decode_block(bytearray(good), FP, h(1)), a)
    cases = [flip(good, i) for i in range(len(good))] + [good[:n] for n in range(0, len(good), 7)]
    for bad in cases + [good + b"\0"]:
        with pytest.raises(Rejected):                    # Rejected, never another exception, never a block
            decode_block(bytearray(bad), FP, h(1))


@pytest.mark.parametrize("dtype,shape,nbytes", [("O", [1], 8), ("V0", [4], 0), ("f4", [-1, -4], 16),
                                                ("f4", [1 << 32, 1 << 32], 0), ("f4", "12", 8), ("nope", [1], 1)])
def test_a_planted_meta_with_a_valid_digest_is_rejected(dtype: str, shape: object, nbytes: int) -> None:
    meta = json.dumps({"fingerprint": FP, "hash": h(1).hex(), "dtype": dtype, "shape": shape, "nbytes": nbytes})
    head = struct.pack("<8sHI", b"IMPKVB\r\n", 1, len(meta)) + meta.encode() + bytes(nbytes)
    with pytest.raises(Rejected) as e:
        decode_block(bytearray(head + xxhash.xxh3_128_digest(head)), FP, h(1))
    assert e.value.reason == "header"


def test_file_changed_after_indexing_is_rejected(store: DiskKVStore, tmp_path: Path) -> None:
    store.put(h(1), block(1))
    assert store.flush()
    with open(path_of(tmp_path, h(1)), "ab") as f:
        f.write(b"\0" * (1 << 20))                       # never read past the size the index holds
    assert store.get(h(1)) is None and store.stats()["rejected_torn"] == 1


def test_link_in_place_of_a_file_is_not_followed(store: DiskKVStore, tmp_path: Path) -> None:
    store.put(h(1), block(1))
    store.put(h(2), block(2))
    assert store.flush()
    p = path_of(tmp_path, h(1))
    p.unlink()
    p.symlink_to(path_of(tmp_path, h(2)))
    assert store.get(h(1)) is None and store.stats()["rejected_link"] == 1


def test_stale_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    DiskKVStore(tmp_path, FP, 1 << 20).close()
    (tmp_path / FP / "ab").mkdir(mode=0o700)
    old, fresh = tmp_path / FP / "ab" / ".ab12.1.2.tmp", tmp_path / FP / "ab" / ".ab34.1.2.tmp"
    old.write_bytes(b"x")
    fresh.write_bytes(b"x")
    os.utime(old, (time.time() - 3600,) * 2)
    s = DiskKVStore(tmp_path, FP, 1 << 20)
    assert not old.exists() and fresh.exists() and s.stats()["files"] == 0
    s.close()


def test_put_never_blocks_when_the_queue_is_full(tmp_path: Path) -> None:
    gate = threading.Event()
    s = DiskKVStore(tmp_path, FP, 1 << 20, max_pending_bytes=2 * block(0).nbytes, writer_hook=lambda _: gate.wait())
    t0 = time.perf_counter()
    for i in range(6):
        s.put(h(i), block(i))
    assert time.perf_counter() - t0 < 0.5
    assert s.stats()["dropped_writes"] == 4 and s.stats()["pending_writes"] == 2
    gate.set()
    s.close()
    assert s.stats()["writes"] == 2 and s.contains(h(1)) and not s.contains(h(2))


def test_close_flushes_pending_writes(tmp_path: Path) -> None:
    s = DiskKVStore(tmp_path, FP, 1 << 20, writer_hook=lambda _: time.sleep(0.01))
    for i in range(10):
        s.put(h(i), block(i))
    s.close()
    s.put(h(99), block(99))                              # after close: dropped, not raised
    assert s.stats()["writes"] == 10 and s.stats()["dropped_writes"] == 1
    again = DiskKVStore(tmp_path, FP, 1 << 20)
    assert all(same(again.get(h(i)), block(i)) for i in range(10))
    again.close()


def test_close_gives_up_on_a_stalled_writer(tmp_path: Path) -> None:
    gate = threading.Event()
    s = DiskKVStore(tmp_path, FP, 1 << 20, writer_hook=lambda _: gate.wait())
    for i in range(3):
        s.put(h(i), block(i))
    t0 = time.perf_counter()
    s.close(timeout_s=0.2)
    assert time.perf_counter() - t0 < 1.0 and s.stats()["dropped_writes"] == 3
    gate.set()


def test_write_error_is_counted_and_the_writer_goes_on(tmp_path: Path) -> None:
    def hook(block_hash: bytes) -> None:
        if block_hash == h(1):
            raise OSError("disk full")
    s = DiskKVStore(tmp_path, FP, 1 << 20, writer_hook=hook)
    s.put(h(1), block(1))
    s.put(h(2), block(2))
    s.close()
    assert s.stats()["write_errors"] == 1 and not s.contains(h(1)) and same(s.get(h(2)), block(2))


def test_concurrent_gets_and_puts_never_serve_a_wrong_block(tmp_path: Path) -> None:
    # room for all 24 blocks in the queue: none is dropped however far the writer falls behind (a loaded
    # machine), so all are written and 24 blocks on an 8-file disk must evict
    s = DiskKVStore(tmp_path, FP, 8 * file_size() + 100, max_pending_bytes=32 * block(0).nbytes)
    wrong: list[int] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            i = rng.randrange(24)
            if rng.random() < 0.5:
                s.put(h(i), block(i))
            else:
                got = s.get(h(i))
                if got is not None and not same(got, block(i)):
                    wrong.append(i)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s.close()
    st = s.stats()
    on_disk = sorted(tmp_path.glob(f"{FP}/*/*.kvb"))
    assert not wrong and st["rejected"] == 0 and st["hits"] > 0 and st["evictions"] > 0
    assert st["files"] == len(on_disk) and st["bytes"] == sum(p.stat().st_size for p in on_disk) <= s.max_bytes


def test_store_refuses_a_directory_others_can_write(tmp_path: Path) -> None:
    (tmp_path / FP).mkdir(mode=0o700)
    os.chmod(tmp_path / FP, 0o777)
    with pytest.raises(UnsafePathError):
        DiskKVStore(tmp_path, FP, 1 << 20)
    with pytest.raises(ValueError):
        DiskKVStore(tmp_path, "../escape", 1 << 20)


def test_model_fingerprint_changes_with_every_field() -> None:
    base = dict(weights="w", kv_dtype="bfloat16", block_size=16, num_layers=30, num_kv_heads=3, head_dim=64)
    fp = model_fingerprint(**base)
    assert fp == model_fingerprint(**base) and len(fp) == 32
    variants = [dict(weights="v"), dict(kv_dtype="float32"), dict(block_size=32), dict(num_layers=31),
                dict(num_kv_heads=4), dict(head_dim=128), dict(tp_size=2), dict(compute_dtype="float32"),
                dict(model_class="m:C"), dict(adapter="a"), dict(payload_layout="kv,layer"), dict(extra={"rope": 2})]
    assert len({model_fingerprint(**{**base, **v}) for v in variants} | {fp}) == len(variants) + 1


def test_weights_digest_sees_names_sizes_mtimes_and_sampled_bytes(tmp_path: Path) -> None:
    model = tmp_path / "m"
    model.mkdir()
    big = model / "model.safetensors"
    data = bytearray(np.random.default_rng(0).integers(0, 256, 9 << 20, dtype=np.uint8).tobytes())
    data[:8] = (100).to_bytes(8, "little")              # a safetensors JSON header of 100 bytes
    big.write_bytes(data)
    (model / "config.json").write_text("{}")
    (model / ".cache").mkdir()
    (model / ".cache" / "lock").write_text("x")
    d = weights_digest(model)
    assert d == weights_digest(model) and len(d) == 32
    (model / ".cache" / "lock").write_text("changed")   # hidden files are not the model
    assert weights_digest(model) == d
    st = big.stat()

    def rewritten(at: int) -> str:                       # one byte changed, name, size and mtime kept
        changed = bytearray(data)
        changed[at] ^= 0xFF
        big.write_bytes(changed)
        os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
        return weights_digest(model)

    assert rewritten(100) != d                           # in the head
    assert rewritten(len(data) - 1) != d                 # the last chunk ends the file
    gap = (1 << 20) + 4096 + 100                          # past the first sample, before the second
    big.write_bytes(data)
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    full = weights_digest(model, full=True)
    assert rewritten(gap) == d                           # the documented blind spot...
    assert weights_digest(model, full=True) != full      # ...which full=True rules out
    no_mtime = weights_digest(model, use_mtime=False)
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert weights_digest(model) != d and weights_digest(model, use_mtime=False) == no_mtime
    (model / "config.json").write_text('{"rope_theta": 2}')
    assert weights_digest(model, use_mtime=False) != no_mtime
