"""`python -m imp_jax.generate`: its sampling flags are SamplingParams' fields; greedy is the model's argmax."""
from __future__ import annotations

import pytest

from imp_jax.generate import build_parser, main, sampling_params
from imp_jax.runtime.request import SamplingParams


def _params(*argv: str) -> SamplingParams:
    return sampling_params(build_parser().parse_args(["--prompt", "x", *argv]))


def test_flags_left_out_keep_the_request_defaults() -> None:
    assert _params() == SamplingParams(temperature=0.0, max_tokens=128)   # generate's own: greedy, 128 tokens


def test_every_sampling_flag_reaches_the_request() -> None:
    p = _params("--temperature", "0.7", "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05", "--typical-p", "0.95",
                "--presence-penalty", "0.5", "--frequency-penalty", "-0.5", "--repetition-penalty", "1.1",
                "--seed", "7", "--max-tokens", "9", "--min-tokens", "2", "--stop", "a", "--stop", "b",
                "--stop-token-ids", "5", "--ignore-eos", "--no-skip-special-tokens", "--mirostat", "2",
                "--dry-multiplier", "0.8", "--banned-strings", "nope")
    assert p == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, typical_p=0.95, presence_penalty=0.5,
                               frequency_penalty=-0.5, repetition_penalty=1.1, seed=7, max_tokens=9, min_tokens=2,
                               stop=["a", "b"], stop_token_ids=[5], ignore_eos=True, skip_special_tokens=False,
                               mirostat=2, dry_multiplier=0.8, banned_strings=["nope"])


def test_a_bad_value_is_refused_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--prompt", "x", "--top-k", "many"])
    assert e.value.code == 2 and "--top-k" in capsys.readouterr().err


@pytest.mark.real_model
def test_plain_greedy_generate_is_the_models_argmax(smollm2_loaded, smollm2_gguf_path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`--temperature 0 --repetition-penalty 1.0` prints the text of the model's own argmax decode."""
    from paged import PagedRunner

    question = "What is the capital of France?"
    tok = smollm2_loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False)
    runner = PagedRunner(smollm2_loaded.model, num_blocks=24, max_blocks=8)
    _, tokens = runner.greedy(prompt, 16, [1, 2, 3, 4], stop=tok.eos_ids, num_tokens=64, num_seqs=1)
    expected = tok.decode([t for t in tokens if t not in tok.eos_ids])
    assert main(["--model", str(smollm2_gguf_path), "--prompt", question, "--chat", "--max-tokens", "16",
                 "--temperature", "0", "--repetition-penalty", "1.0", "--max-model-len", "256",
                 "--gemm", "exact"]) == 0   # smollm2_loaded's arithmetic
    assert capsys.readouterr().out == expected + "\n"
