"""Block tables kept on the device: each running sequence's table is a row (a slot) of one device
array that the step programs update in place, so a step sends the few entries that changed (a
decode row's new block every `block_size` tokens) instead of every row's whole table.

The host side here assigns slots and remembers, per table, how many leading entries its slot's row
already holds (`BlockTable.device_synced`; the pool lowers it whenever it changes an entry). Each
step's edits ride in its packed inputs, up to a fixed number per bucket; a step that changes more
(an admission with a long cached prefix) writes the rest first with a separate small program.

Entries past a sequence's blocks hold whatever an earlier owner of the slot left there: valid block
ids, which the attention kernels never read (they stop at `seq_lens`). Slot 0 is never assigned and
stays zero: padding rows read it.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from imp_jax.runtime.kv.kv_blocks import BlockTable


def edit_capacity(num_tokens: int, num_seqs: int, block_size: int) -> int:
    """Table entries a (T, S) step program writes itself: a chunk of n tokens opens at most
    ceil(n / block_size) + 1 blocks, so a step of growing sequences never needs more."""
    return num_tokens // block_size + 2 * num_seqs


class DeviceTables:
    """Which slot of the device-resident tables holds which BlockTable, and the edits that bring a
    step's rows up to date."""

    def __init__(self, num_slots: int, max_blocks: int):
        self.num_slots = num_slots
        self.max_blocks = max_blocks
        self._owner: list[BlockTable | None] = [None] * num_slots
        self._free = list(range(num_slots - 1, 0, -1))   # slot 0: the all-zero row of padding

    def edits(self, tables: Sequence[BlockTable], num_rows: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
        """(slot of each of `num_rows` batch rows, zeros past `tables`; the (slot, column, block id)
        writes that make those rows hold the tables' current blocks). The tables count as synced."""
        rows = np.zeros(num_rows, np.int32)
        out: list[tuple[int, int, int]] = []
        for r, table in enumerate(tables):
            slot = table.device_slot
            if not slot or self._owner[slot] is not table:
                slot = self._assign(table)
            ids = table.block_ids
            for j in range(table.device_synced, len(ids)):
                out.append((slot, j, ids[j]))
            table.device_synced = len(ids)
            rows[r] = slot
        return rows, out

    def pack(self, edits: list[tuple[int, int, int]], capacity: int) -> np.ndarray:
        """Edits as int32 [3, capacity] (slot, column, block id); unused entries name slot
        `num_slots`, out of range, so the program's scatter drops them."""
        out = np.zeros((3, capacity), np.int32)
        out[0] = self.num_slots
        if edits:
            out[:, :len(edits)] = np.asarray(edits, np.int32).T
        return out

    def _assign(self, table: BlockTable) -> int:
        if not self._free:
            self._reclaim()
        slot = self._free.pop()
        self._owner[slot] = table
        table.device_slot, table.device_synced = slot, 0
        return slot

    def _reclaim(self) -> None:
        """Free the slots of emptied tables (finished, preempted or released sequences): their rows
        are read by no later step (an earlier, launched step read them before any rewrite lands)."""
        for slot in range(1, self.num_slots):
            table = self._owner[slot]
            if table is None or not table.block_ids:
                if table is not None:
                    table.device_slot, table.device_synced = 0, 0
                self._owner[slot] = None
                self._free.append(slot)
        if not self._free:
            raise RuntimeError(f"all {self.num_slots - 1} device block-table rows are held by live tables")
