"""Tiny random-weight HF checkpoints of each supported architecture, written with transformers,
and a GGUF file that names an architecture and holds nothing else."""
from __future__ import annotations

from pathlib import Path
from typing import Any

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)

ARCHS = {
    "LlamaForCausalLM": ("LlamaConfig", dict(tie_word_embeddings=False)),
    "LlamaForCausalLM-llama3-rope": ("LlamaConfig", dict(
        tie_word_embeddings=True, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=64))),
    "MistralForCausalLM": ("MistralConfig", dict(sliding_window=24, head_dim=16)),
    "Qwen2ForCausalLM": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=False)),
}


def write_tiny_hf(name: str, path: Path, seed: int = 0, **overrides):
    """Save a tiny random `name` model (an ARCHS key; `overrides` of its config) as a HF dir; returns
    the transformers model."""
    import torch
    import transformers

    cfg_cls, extra = ARCHS[name]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra, **overrides})
    arch = name.split("-")[0]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float().eval()
    with torch.no_grad():  # random norms and biases so parity checks exercise them
        for n, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_arch_only_gguf(path: Path, arch: str) -> Path:
    """A GGUF file with `arch` in its header and one embedding tensor: enough to be refused by architecture."""
    import numpy as np
    from tiny_gguf import write_named_gguf

    write_named_gguf(path, arch, {}, {"token_embd.weight": np.zeros((4, 8), np.float32)})
    return path


# ------------------------------------------------------------------------- a tiny model that thinks
# A Qwen3-like template: the generation prompt opens no think block (the model does), and
# enable_thinking=false prefills an empty one, as Qwen3's does.
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% if not loop.last or add_generation_prompt %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}")
# What each piece's token is followed by under greedy decoding: a reply thinks "Hmm so", answers
# "Yes done"; "ok" thinks forever and "zz" answers forever (so a request can be caught mid-block).
THINKING_CHAIN = {"\n": "<think>", "<think>": "Hmm", "Hmm": " so", " so": "</think>", "</think>": "\n\n",
                  "\n\n": "Yes", "Yes": " done", " done": "<|im_end|>", "ok": "ok", "zz": "zz"}


def write_thinking_model(path: Path) -> dict[str, int]:
    """A tiny Qwen3 HF dir whose greedy output follows THINKING_CHAIN, token by token, whatever came before.

    Attention and MLP outputs are zero, so the last hidden state is the current token's embedding:
    each chain token gets its own embedding axis, and the lm_head row of its successor reads that
    axis. Returns the chain pieces' token ids.
    """
    import json

    import torch
    import transformers
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hmm so\n\n", "Yes done\n\n", "ok", "zz", "user system assistant hello world\n\n", "assistant\n"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, show_progress=False, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])  # plain added tokens, as Qwen3's
    ids = {}
    for piece in THINKING_CHAIN:
        enc = tok.encode(piece, add_special_tokens=False).ids
        assert len(enc) == 1, (piece, enc)
        ids[piece] = enc[0]
    ids["<|im_end|>"] = tok.token_to_id("<|im_end|>")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": THINKING_TEMPLATE}))

    cfg = transformers.Qwen3Config(**{**TINY, "vocab_size": tok.get_vocab_size(), "max_position_embeddings": 4096},
                                   head_dim=32, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.norm.weight.fill_(1.0)
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.normal_(0, 0.01)
        head.zero_()
        for axis, (piece, nxt) in enumerate(THINKING_CHAIN.items()):
            emb[ids[piece]].zero_()
            emb[ids[piece], axis] = 1.0
            head[ids[nxt], axis] = 10.0
    model.save_pretrained(path, safe_serialization=True)
    return ids


THINKER_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
                "--num-kv-blocks", "600"]   # a LiveServer for write_thinking_model's model (small, fast start)


def write_tiny_bert(path: Path, tokenizer_dir: Path, classifier: bool = False, **config: int):
    """A tiny random BERT (BertModel, or a 1-label BertForSequenceClassification) with the tokenizer files
    of `tokenizer_dir` (MiniLM's), its 1-D parameters (biases, norms) jittered so none is trivial; the
    transformers model it saved."""
    import shutil

    import torch
    import transformers

    cfg = transformers.BertConfig(vocab_size=30522, num_hidden_layers=2, num_attention_heads=4,
                                  num_labels=1, **config)
    torch.manual_seed(0)
    model = (transformers.BertForSequenceClassification(cfg) if classifier
             else transformers.BertModel(cfg, add_pooling_layer=True)).float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / f, path / f)
    return model


# ------------------------------------------------------------------------- a harmony (gpt-oss) vocabulary
HARMONY_SPECIALS = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                    "<|call|>", "<|constrain|>"]
# A minimal harmony template (the official gpt-oss one renders these parts the same way): reasoning_effort in
# the system message, tools in a developer message, replayed reasoning (`thinking`) as an analysis message,
# a replayed call on the commentary channel to its recipient, its result from `functions.NAME`.
HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>Reasoning: ' + (reasoning_effort | default('medium')) + '<|end|>' -}}"
    "{%- if tools %}{{- '<|start|>developer<|message|># Tools' -}}"
    "{%- for t in tools %}{{ ' ' + t.function.name }}{% endfor %}{{- '<|end|>' -}}{% endif -%}"
    "{%- set ns = namespace(last=none) -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{%- if m.thinking is defined and m.thinking -%}"
    "{{- '<|start|>assistant<|channel|>analysis<|message|>' + m.thinking + '<|end|>' -}}{%- endif -%}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}{%- set c = m.tool_calls[0].function -%}"
    "{{- '<|start|>assistant to=functions.' + c.name + '<|channel|>commentary <|constrain|>json<|message|>' -}}"
    "{{- c.arguments | tojson -}}{{- '<|call|>' -}}{%- set ns.last = c.name -%}"
    "{%- else -%}{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- elif m.role == 'tool' -%}"
    "{{- '<|start|>functions.' + ns.last + ' to=assistant<|channel|>commentary<|message|>' + m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}")
HARMONY_WORDS = ["GO", "CALL", "SUNNY", "TRAIL"]   # plain added tokens: the scripted model's triggers


def write_harmony_tokenizer(path: Path) -> None:
    """A tiny byte-level BPE tokenizer.json with gpt-oss's harmony special tokens, and a tokenizer_config.json
    with HARMONY_TEMPLATE (EOS <|return|>; generation_config.json adds <|call|>, as gpt-oss's does)."""
    import json

    from tokenizers import AddedToken, decoders, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["assistant analysis final commentary to=functions.get_weather json user system developer",
              "Hmm so the user wants weather. Let me check. Yes done, it is sunny in Paris.",
              '{"city": "Paris"} Reasoning: medium high low # Tools'] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, show_progress=False, special_tokens=HARMONY_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(w, special=False, normalized=False) for w in HARMONY_WORDS])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|return|>", "pad_token": "<|endoftext|>", "chat_template": HARMONY_TEMPLATE}))
    call_id = tok.token_to_id("<|call|>")
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id("<|return|>"), call_id, tok.token_to_id("<|endoftext|>")]}))


def make_adapter(base_dir: Path, out: Path, seed: int, **lora: Any) -> Path:
    """A PEFT adapter of the HF model at `base_dir` with random non-zero A and B, saved to `out`."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.1)
    peft_model.save_pretrained(out)
    return out


TINY_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
               " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE of < 256 ids (fits tiny_models' vocab) with BOS, ChatML specials and two templates."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world! 12345"] * 5,
                            trainers.BpeTrainer(vocab_size=160, show_progress=False,
                                                special_tokens=["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|endoftext|>", "add_bos_token": True,
              "chat_template": [{"name": "default", "template": TINY_CHATML},
                                {"name": "tool_use", "template": "{# tools #}" + TINY_CHATML}]}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3], "temperature": 0.7}))
