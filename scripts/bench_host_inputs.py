"""Host time to build one decode step's inputs: the ragged batch, its block tables and the packed
buffers the step receives, with the tables sent whole each step (what `build_step_batch` makes
for a standalone model call) against the engine's device-resident rows (runtime/scheduling/block_tables.py:
only the edits of the step travel). Each row's sequence grows by one token a step, so a row
opens a new block every `block_size` steps, as in a real decode.

    PYTHONPATH=. python scripts/bench_host_inputs.py --rows 1 32 256 --contexts 200 4000
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


from imp_jax.runtime.execution.batch import SeqChunk, build_step_batch
from imp_jax.runtime.scheduling.block_tables import DeviceTables, edit_capacity
from imp_jax.runtime.kv.kv_blocks import BlockTable
from imp_jax.runtime.execution.packing import pack


def measure(rows: int, context: int, max_blocks: int, block_size: int, steps: int, device_rows: bool) -> float:
    """Median microseconds per step over `steps` decode steps of `rows` sequences."""
    tables = [BlockTable() for _ in range(rows)]
    lengths = [context + r for r in range(rows)]   # staggered, so rows open blocks on different steps
    next_block = 1

    def grow(r: int) -> None:
        nonlocal next_block
        while len(tables[r].block_ids) * block_size < lengths[r] + 1:
            tables[r].block_ids.append(next_block % 60000 + 1)
            next_block += 1

    for r in range(rows):
        grow(r)
    dt = DeviceTables(2 * rows + 2, max_blocks)
    dt.edits(tables, rows)
    times = []
    for _ in range(steps):
        for r in range(rows):
            lengths[r] += 1
            grow(r)
        t0 = time.perf_counter()
        chunks = [SeqChunk([7], lengths[r], tables[r].block_ids) for r in range(rows)]
        batch = build_step_batch(chunks, num_tokens=rows, num_seqs=rows, max_blocks=max_blocks,
                                 block_size=block_size, with_tables=not device_rows)
        meta = (batch.query_start_loc, batch.seq_lens, batch.slot_mapping, batch.num_seqs)
        if device_rows:
            slots, edits = dt.edits(tables, rows)
            tree = (batch.input_ids, batch.positions, meta, slots,
                    dt.pack(edits, edit_capacity(rows, rows, block_size)), batch.last_token_rows)
        else:
            tree = (batch.input_ids, batch.positions, (*meta, batch.block_tables), batch.last_token_rows)
        pack(tree)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[200, 4000])
    ap.add_argument("--max-blocks", type=int, default=512, help="max_model_len / block_size (8192 / 16)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", default="bench_host_inputs.json")
    args = ap.parse_args()
    results = []
    for rows in args.rows:
        for context in args.contexts:
            whole, device = [], []
            for _ in range(3):   # interleaved repeats
                whole.append(measure(rows, context, args.max_blocks, args.block_size, args.steps, False))
                device.append(measure(rows, context, args.max_blocks, args.block_size, args.steps, True))
            row = dict(rows=rows, context=context, whole_tables_us=round(min(whole), 1),
                       device_rows_us=round(min(device), 1))
            results.append(row)
            print(f"rows {rows:4d} context {context:5d}: whole tables {row['whole_tables_us']:8.1f} us  "
                  f"device rows {row['device_rows_us']:8.1f} us", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
