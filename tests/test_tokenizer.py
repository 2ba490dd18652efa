"""Tokenizer: HF directory loading, BOS/EOS rules as in transformers, special tokens, FIM, chat selection."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from imp_jax.errors import ModelLoadError, TemplateError
from imp_jax.model.text.tokenizer import Tokenizer

CORPUS = ["héllo wörld 你好 🙂 the quick brown fox", "naïve café 日本語 🙂🙃, hello world"] * 10
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<pad>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = ["héllo wörld", "你好 🙂", "", "<|eot_id|> inside text", " leading space"]


def byte_level(extra_specials: tuple[str, ...] = ()) -> HFTokenizer:
    """A small byte-level BPE trained here, with Llama-3 style special tokens."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS + list(extra_specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def with_bos_processor(tok: HFTokenizer) -> HFTokenizer:
    """Llama 3's tokenizer.json: a TemplateProcessing post-processor that adds BOS."""
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    return tok


def write_dir(path: Path, tok: HFTokenizer, config: dict | None = None, **files: dict | str) -> Path:
    """A HF tokenizer directory: tokenizer.json, tokenizer_config.json and any other named files."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, content in files.items():
        target = path / name.replace("__", ".").replace("_SLASH_", "/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


LLAMA3_CONFIG = {"bos_token": "<|begin_of_text|>", "eos_token": {"__type": "AddedToken", "content": "<|end_of_text|>", "lstrip": False,
                               "normalized": False, "rstrip": False, "single_word": False, "special": True},
                 "chat_template": CHATML}


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


def test_bad_config_json_is_a_load_error(tmp_path: Path) -> None:
    d = write_dir(tmp_path, byte_level())
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_hf_dir(d)


def test_post_processor_bos_is_added_once(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(write_dir(tmp_path, with_bos_processor(byte_level()), LLAMA3_CONFIG))
    assert tok.add_bos and not tok.add_eos
    ids = tok.encode("héllo wörld")
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.encode("héllo wörld", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "héllo wörld"
    assert tok.decode(ids, skip_special_tokens=False) == "<|begin_of_text|>héllo wörld"


def test_config_flags_apply_when_no_post_processor_adds_tokens(tmp_path: Path) -> None:
    config = {**LLAMA3_CONFIG, "add_bos_token": True, "add_eos_token": True}
    tok = Tokenizer.from_hf_dir(write_dir(tmp_path, byte_level(), config))
    assert tok.add_bos and tok.add_eos
    ids = tok.encode("hello")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.encode("hello", add_special_tokens=False) == ids[1:-1]


def test_no_flags_no_processor_adds_nothing(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(write_dir(tmp_path, byte_level(), {"eos_token": "<|end_of_text|>"}))
    assert not tok.add_bos and tok.bos_id is None
    assert tok.encode("hello") == tok.encode("hello", add_special_tokens=False)


@pytest.mark.parametrize("bos_processor", [True, False])
def test_encode_decode_match_transformers(tmp_path: Path, bos_processor: bool) -> None:
    backend = pytest.importorskip("transformers.tokenization_utils_tokenizers")
    hf_tok = with_bos_processor(byte_level()) if bos_processor else byte_level()
    d = write_dir(tmp_path, hf_tok, LLAMA3_CONFIG)
    ours, theirs = Tokenizer.from_hf_dir(d), backend.TokenizersBackend.from_pretrained(str(d))
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.encode(text, False) == theirs.encode(text, add_special_tokens=False), text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.bos_id == theirs.bos_token_id and ours.eos_id == theirs.eos_token_id


def test_constructor_flags_decide_bos_like_gguf() -> None:
    # A GGUF loader hands over a tokenizer with a ByteLevel post-processor and add_bos=True: BOS is added once.
    tok = Tokenizer(byte_level(), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", add_bos=True,
                    add_eos=False, chat_template=None)
    assert tok.add_bos and tok.encode("hi")[0] == tok.bos_id and tok.encode("hi").count(tok.bos_id) == 1
    # A post-processor adding BOS when the model says not to: the flag wins.
    tok = Tokenizer(with_bos_processor(byte_level()), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                    add_bos=False, add_eos=False, chat_template=None)
    assert not tok.add_bos and tok.bos_id not in tok.encode("hi")


def test_other_post_processor_tokens_are_kept() -> None:
    hf = byte_level(("[CLS]", "[SEP]"))
    cls_id, sep_id = hf.token_to_id("[CLS]"), hf.token_to_id("[SEP]")
    hf.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok = Tokenizer(hf, bos_token=None, eos_token=None, add_bos=False, add_eos=False, chat_template=None)
    ids = tok.encode("hello")
    assert ids[0] == cls_id and ids[-1] == sep_id


def test_special_tokens_from_map_and_generation_config(tmp_path: Path) -> None:
    d = write_dir(tmp_path, byte_level(), {"add_bos_token": False},
                  special_tokens_map__json={"bos_token": {"content": "<|begin_of_text|>"},
                                            "eos_token": "<|end_of_text|>", "pad_token": "<pad>"},
                  generation_config__json={"eos_token_id": [1, 2]})
    tok = Tokenizer.from_hf_dir(d)
    assert tok.bos_token == "<|begin_of_text|>" and tok.pad_id == tok.token_to_id("<pad>")
    eot = tok.token_to_id("<|eot_id|>")
    assert tok.eos_id == tok.token_to_id("<|end_of_text|>") == 1
    assert tok.eos_ids == frozenset({1, eot})
    assert tok.special_ids >= {tok.bos_id, tok.eos_id, eot}


def test_vocabulary_lookups() -> None:
    tok = Tokenizer(byte_level(), bos_token=None, eos_token="<|end_of_text|>", add_bos=False, add_eos=False,
                    chat_template=None)
    assert tok.vocab_size == 300
    assert tok.id_to_token(tok.token_to_id("<|eot_id|>")) == "<|eot_id|>"
    assert tok.token_to_id("not-a-token-at-all") is None
    assert tok.id_to_token(10**6) is None
    assert tok.eos_ids == frozenset({tok.eos_id})


@pytest.mark.parametrize("spelling", [("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
                                      ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")])
def test_fim_tokens_detected_by_name(tmp_path: Path, spelling: tuple[str, str, str]) -> None:
    tok = Tokenizer.from_hf_dir(write_dir(tmp_path, byte_level(spelling), LLAMA3_CONFIG))
    assert tok.has_fim and tok.fim_tokens == dict(zip(("prefix", "suffix", "middle"), spelling))


def test_no_fim_tokens(tmp_path: Path) -> None:
    tok = Tokenizer.from_hf_dir(write_dir(tmp_path, byte_level(("<fim_prefix>",)), LLAMA3_CONFIG))
    assert not tok.has_fim and tok.fim_tokens is None


def test_named_chat_templates_from_config(tmp_path: Path) -> None:
    config = {**LLAMA3_CONFIG, "chat_template": [{"name": "default", "template": CHATML},
                                                 {"name": "tool_use", "template": "TOOLS {{ tools | length }}"}]}
    tok = Tokenizer.from_hf_dir(write_dir(tmp_path, byte_level(), config))
    messages = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == CHATML and set(tok.chat_templates) == {"default", "tool_use"}
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, tools=[{"name": "f"}]) == "TOOLS 1"
    assert tok.apply_chat_template(messages, template_name="tool_use", tools=[]) == "TOOLS 0"
    with pytest.raises(TemplateError, match="unknown chat template"):
        tok.apply_chat_template(messages, template_name="nope")


def test_chat_template_file_wins_over_config(tmp_path: Path) -> None:
    d = write_dir(tmp_path, byte_level(), LLAMA3_CONFIG, chat_template__jinja="FILE {{ bos_token }}",
                  additional_chat_templates_SLASH_rag__jinja="RAG {{ documents[0].title }}")
    tok = Tokenizer.from_hf_dir(d)
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "FILE <|begin_of_text|>"
    assert tok.apply_chat_template(messages, template_name="rag", documents=[{"title": "T", "text": "x"}]) == "RAG T"


def test_apply_chat_template_passes_special_tokens_and_kwargs() -> None:
    template = "{{ bos_token }}#{{ eos_token }}#{{ enable_thinking }}#{{ messages[0]['content'] }}"
    tok = Tokenizer(byte_level(), bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", add_bos=False,
                    add_eos=False, chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], enable_thinking=False)
    assert out == "<|begin_of_text|>#<|eot_id|>#False#hi"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], eos_token="E").split("#")[1] == "E"


def test_no_chat_template_is_a_template_error() -> None:
    tok = Tokenizer(byte_level(), bos_token=None, eos_token=None, add_bos=False, add_eos=False, chat_template=None)
    assert tok.chat_template is None
    with pytest.raises(TemplateError, match="model has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_rendered_chat_encodes_special_tokens_to_their_ids() -> None:
    tok = Tokenizer(byte_level(("<|im_start|>", "<|im_end|>")), bos_token=None, eos_token="<|im_end|>",
                    add_bos=False, add_eos=False, chat_template=CHATML)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "你好"}]), add_special_tokens=False)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 2 and ids.count(tok.eos_id) == 1
