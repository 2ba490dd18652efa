"""SmolLM2-135M-Instruct (Q4_1 GGUF) end to end: parity with transformers' own GGUF load, and a sane answer."""
from __future__ import annotations

import numpy as np
import pytest

from paged import PagedRunner
from support.smollm2 import NUM_TOKENS, chat_ids, greedy

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def runner(smollm2_loaded) -> PagedRunner:
    return PagedRunner(smollm2_loaded.model, num_blocks=24, max_blocks=8)


def test_logits_and_greedy_tokens_match_transformers(smollm2_loaded, hf_smollm2, runner):
    import torch

    prompt = chat_ids(smollm2_loaded, "Name three colors of the rainbow.")
    assert len(prompt) <= NUM_TOKENS
    logits, tokens = greedy(runner, prompt, 12, [1, 2, 3, 4])
    with torch.no_grad():
        ref = hf_smollm2(torch.tensor([prompt])).logits[0].float().numpy()
        hf_tokens = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        pad_token_id=0)[0, len(prompt):].tolist()
    assert logits.shape == ref.shape
    err = np.max(np.abs(logits - ref)) / np.ptp(ref)
    assert err <= 1e-3, err
    assert hf_tokens and tokens[:len(hf_tokens)] == hf_tokens  # transformers may stop early at EOS


def test_capital_of_france_is_paris(smollm2_loaded, runner):
    tok = smollm2_loaded.tokenizer
    prompt = chat_ids(smollm2_loaded, "What is the capital of France?")
    _, tokens = greedy(runner, prompt, 24, [5, 6, 7, 8], stop=tok.eos_ids)
    answer = tok.decode(tokens)
    assert "Paris" in answer, answer
