"""Device-resident block tables (runtime/scheduling/block_tables.py): the edits each step carries keep a table's
row equal to its blocks through every pool operation that changes them, with slots reclaimed from
emptied tables. The device array is simulated in NumPy with the programs' scatter semantics."""
from __future__ import annotations

import random

import numpy as np
import pytest

from imp_jax.runtime.scheduling.block_tables import DeviceTables, edit_capacity
from imp_jax.runtime.kv.kv_blocks import BlockTable, KVBlockPool, OutOfBlocks

BS = 4


def apply(device: np.ndarray, packed: np.ndarray) -> None:
    """`tables.at[slot, col].set(val, mode="drop")`: an out-of-range slot writes nothing."""
    keep = packed[0] < device.shape[0]
    device[packed[0, keep], packed[1, keep]] = packed[2, keep]


@pytest.mark.parametrize("seed", range(6))
def test_rows_follow_allocate_free_truncate_and_copy_on_write(seed: int) -> None:
    rng = random.Random(seed)
    pool = KVBlockPool(num_blocks=48, block_size=BS)
    dt = DeviceTables(num_slots=7, max_blocks=16)    # 6 rows for 8 tables, at most 6 live at once (the
    device = np.zeros((7, 16), np.int32)             # scheduler's bound): emptied tables' rows are reused
    tables = [BlockTable() for _ in range(8)]
    tokens = [[] for _ in tables]
    owners: dict[int, set[int]] = {}
    for _ in range(600):
        i = rng.randrange(len(tables))
        table, op = tables[i], rng.random()
        if op < 0.45:                                   # grow (a first allocation may hit the prefix cache)
            if not table.block_ids and sum(bool(t.block_ids) for t in tables) == 6:
                continue
            n = min(len(tokens[i]) + rng.randint(1, 9), 60)
            ids = tokens[i] + [rng.randrange(3) for _ in range(n - len(tokens[i]))]
            if pool.allocate(table, ids, n):
                tokens[i] = ids
                pool.commit(table, ids)
        elif op < 0.6:                                  # finish or preemption
            pool.free(table)
            tokens[i] = []
        elif op < 0.75 and tokens[i]:                   # rewind
            n = rng.randrange(len(tokens[i]))
            try:
                pool.truncate(table, n)
            except OutOfBlocks:
                continue
            tokens[i] = tokens[i][:n]
        elif op < 0.85 and tokens[i]:                   # a shared partial tail made private
            try:
                pool.ensure_writable_tail(table, len(tokens[i]))
            except OutOfBlocks:
                continue
        else:                                           # a step over up to 4 live tables
            live = [t for t in tables if t.block_ids]
            batch = rng.sample(live, min(len(live), 4))
            rows, edits = dt.edits(batch, 4)
            capacity = edit_capacity(4, 4, BS)
            while len(edits) > capacity:                # the table program, then the step's own share
                apply(device, dt.pack(edits[:16], 16))
                edits = edits[16:]
            apply(device, dt.pack(edits, capacity))
            gathered = device[rows]
            for r, t in enumerate(batch):
                assert list(gathered[r, :len(t.block_ids)]) == t.block_ids
                assert t.device_synced == len(t.block_ids)
                owners.setdefault(t.device_slot, set()).add(id(t))
            assert not gathered[len(batch):].any()      # padding rows read slot 0, all zero
    assert any(len(o) > 1 for o in owners.values())     # rows were reclaimed and handed on


def test_a_step_edits_only_what_changed() -> None:
    pool = KVBlockPool(num_blocks=32, block_size=BS)
    dt = DeviceTables(num_slots=4, max_blocks=8)
    a, b = BlockTable(), BlockTable()
    assert pool.allocate(a, list(range(10)), 10) and pool.allocate(b, list(range(100, 103)), 3)
    rows, edits = dt.edits([a, b], 3)
    assert len(edits) == 4 and list(rows) == [a.device_slot, b.device_slot, 0]
    assert dt.edits([a, b], 3)[1] == []                 # nothing changed: nothing sent
    assert pool.allocate(a, list(range(13)), 13)        # a opens its 4th block
    assert dt.edits([a, b], 2)[1] == [(a.device_slot, 3, a.block_ids[3])]
    pool.free(b)
    assert pool.allocate(b, list(range(200, 205)), 5)   # readmitted: its whole table again
    assert [e[1] for e in dt.edits([b], 1)[1]] == [0, 1]


def test_every_row_held_by_a_live_table_is_an_error() -> None:
    pool = KVBlockPool(num_blocks=32, block_size=BS)
    dt = DeviceTables(num_slots=3, max_blocks=8)
    live = [BlockTable() for _ in range(3)]
    for k, t in enumerate(live):
        assert pool.allocate(t, [k], 1)
    dt.edits(live[:2], 2)
    with pytest.raises(RuntimeError, match="device block-table rows"):
        dt.edits(live[2:], 1)
