"""Greedy decoding of the real SmolLM2 through PagedRunner (tests/test_smollm2*.py, tests/test_lora.py): the
one batch shape those tests compile, a chat prompt's ids, and the greedy loop at that shape."""
from __future__ import annotations

import numpy as np
from paged import PagedRunner


NUM_TOKENS = 64  # one compiled shape for prefill and decode steps alike


def chat_ids(loaded, question: str) -> list[int]:
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return loaded.tokenizer.encode(text, add_special_tokens=False)


def greedy(runner: PagedRunner, prompt: list[int], steps: int, table: list[int],
           stop: frozenset[int] = frozenset()) -> tuple[np.ndarray, list[int]]:
    """PagedRunner.greedy at this file's one-sequence batch shape."""
    return runner.greedy(prompt, steps, table, stop=stop, num_tokens=NUM_TOKENS, num_seqs=1)
