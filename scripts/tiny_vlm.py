"""A tiny random Idefics3 checkpoint (SmolVLM's architecture) with a byte-level tokenizer that holds the image
special tokens: what scripts/bench_vision.py serves by default and tests/test_vision_server.py checks against
transformers; and a tiny random Qwen2.5-VL likewise (tests/test_vision_server_qwen.py). Needs torch and transformers (the test extras).

    python scripts/tiny_vlm.py DIR [idefics3|qwen2_5_vl]      # write one
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
          " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<fake_token_around_image>", "<image>",
            "<global-img>", "<end_of_utterance>", *(f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5))]
IMAGE_ID = SPECIALS.index("<image>")
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
              patch_size=4)
TEXT = dict(model_type="llama", vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5)
PRE = dict(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})   # tiles of 32: up to 2 x 2 + global
IMAGE_SEQ_LEN = 16   # rows per frame: (32 / 4)^2 patches / scale_factor^2


def write_tokenizer(path: Path, specials: list[str]) -> None:
    """A byte-level BPE of 200 ids whose first ids are `specials` (BOS, EOS, ChatML's, then the image tokens),
    with a ChatML template and EOS ids [1, 3]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["what is in this picture? a red square, a blue sky, hello world 12345"] * 5,
                            trainers.BpeTrainer(vocab_size=200, show_progress=False, special_tokens=specials))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|endoftext|>", "chat_template": CHATML,
         "additional_special_tokens": specials[4:]}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 3]}))


def write_tiny_idefics3(path: Path, seed: int = 0, vision: dict[str, Any] | None = None,
                        text: dict[str, Any] | None = None) -> Any:
    """Write the checkpoint to `path` (config, safetensors, tokenizer, processor files); returns transformers' model."""
    import torch
    import transformers

    write_tokenizer(path, SPECIALS)
    vision, text = {**VISION, **(vision or {})}, {**TEXT, **(text or {})}
    seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // 4
    cfg = transformers.Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, image_token_id=IMAGE_ID)
    torch.manual_seed(seed)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(
        {"size": {"longest_edge": 2 * vision["image_size"]}, "max_image_size": {"longest_edge": vision["image_size"]}}))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_len": seq_len}))
    return model


QWEN_SPECIALS = ["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                 "<|image_pad|>", "<|video_pad|>"]
QWEN_VISION = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, temporal_patch_size=2,
                   spatial_merge_size=2, window_size=16, fullatt_block_indexes=[1, 3], out_hidden_size=64)
QWEN_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
                 rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, bos_token_id=0, eos_token_id=1)
QWEN_PRE = dict(min_pixels=16 * 16, max_pixels=48 * 48, patch_size=4, temporal_patch_size=2, merge_size=2)


def write_tiny_qwen2_5_vl(path: Path, seed: int = 0) -> Any:
    """A random Qwen2.5-VL (a 4-block windowed tower, a 2-layer Qwen2 with M-RoPE) whose tokenizer holds the
    vision special tokens at the config's ids; returns transformers' model."""
    import torch
    import transformers

    write_tokenizer(path, QWEN_SPECIALS)
    ids = {name: QWEN_SPECIALS.index(tok) for name, tok in [("vision_start_token_id", "<|vision_start|>"),
           ("vision_end_token_id", "<|vision_end|>"), ("image_token_id", "<|image_pad|>"),
           ("video_token_id", "<|video_pad|>")]}
    cfg = transformers.Qwen2_5_VLConfig(vision_config=QWEN_VISION, text_config=QWEN_TEXT, **ids)
    torch.manual_seed(seed)
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():   # norms and biases away from their init, so a wrong one shows
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(QWEN_PRE))
    return model


def hf_processor(path: Path) -> Any:
    """transformers' Idefics3Processor for a checkpoint written here."""
    import transformers

    pre = json.loads((path / "preprocessor_config.json").read_text())
    seq_len = json.loads((path / "processor_config.json").read_text())["image_seq_len"]
    return transformers.Idefics3Processor(transformers.Idefics3ImageProcessor(**pre),
                                          transformers.PreTrainedTokenizerFast.from_pretrained(path),
                                          image_seq_len=seq_len)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    family = sys.argv[2] if len(sys.argv) > 2 else "idefics3"
    {"idefics3": write_tiny_idefics3, "qwen2_5_vl": write_tiny_qwen2_5_vl}[family](out)
    print(f"wrote a tiny random {family} checkpoint to {out}")
