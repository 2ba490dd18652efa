"""SmolLM2 in llama.cpp's Q4_K_M layout (Q5_0, Q4_K, Q6_K, Q8_0 blocks; tests/support/kquant_writer.py): kept as
the file's blocks, and greedy output identical to transformers' own load of the same file."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from imp_jax.kernels_pallas import ggml_blocks
from support.kquant_writer import write_q4_k_m
from paged import PagedRunner
from support.smollm2 import NUM_TOKENS, chat_ids, greedy

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def q4_k_m(smollm2_gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("q4_k_m") / "SmolLM2-135M-Instruct.Q4_K_M.gguf"
    write_q4_k_m(smollm2_gguf_path, path)
    return path


def test_q4_k_m_smollm2_keeps_its_blocks_and_matches_transformers(q4_k_m: Path):
    import jax
    import torch
    import transformers
    from flax import nnx

    from imp_jax.model.formats.loader import load_model

    loaded = load_model(q4_k_m, dtype="float32", gemm="exact")   # transformers' products, not llama.cpp's
    model = loaded.model
    formats = {ggml_blocks.format_of(w) for ws in model.layers.matrices().values() for w in ws}
    assert formats == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}   # q|k|v mixing Q5_0 and Q8_0 is held as Q8_0
    device = sum(a.nbytes for a in jax.tree.leaves(nnx.state(model)))
    file = q4_k_m.stat().st_size
    assert abs(device - file) <= 0.01 * file, (device, file)   # the issue asks for 10%

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(q4_k_m.parent), gguf_file=q4_k_m.name, dtype=torch.float32).eval()
    runner = PagedRunner(model, num_blocks=24, max_blocks=8)
    for i, question in enumerate(["Name three colors of the rainbow.", "What is 12 times 7?"]):
        prompt = chat_ids(loaded, question)
        assert len(prompt) <= NUM_TOKENS
        logits, tokens = greedy(runner, prompt, 16, [4 * i + 1, 4 * i + 2, 4 * i + 3, 4 * i + 4])
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float().numpy()
            hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                    pad_token_id=0)[0, len(prompt):].tolist()
        assert np.max(np.abs(logits - ref)) / np.ptp(ref) <= 1e-3
        assert hf_tokens and tokens[:len(hf_tokens)] == hf_tokens


def test_the_writer_gives_llama_quantizes_type_counts(q4_k_m: Path):
    """The layout of `llama-quantize SmolLM2 Q4_K_M` (scripts/bench_peers.sh quantize): 166 Q5_0, 16 Q4_K,
    14 Q6_K, 15 Q8_0, 61 F32 tensors."""
    from collections import Counter

    counts = Counter(t.tensor_type.name for t in gguf.GGUFReader(str(q4_k_m)).tensors)
    assert counts == {"Q5_0": 166, "Q4_K": 16, "Q6_K": 14, "Q8_0": 15, "F32": 61}
