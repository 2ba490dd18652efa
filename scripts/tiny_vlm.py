"""A tiny random Idefics3 checkpoint (SmolVLM's architecture) with a byte-level tokenizer that holds the image
special tokens: what scripts/bench_vision.py serves by default and tests/test_vision_server.py checks against
transformers; and a tiny random Qwen2.5-VL (tests/test_vision_server_qwen.py) and Gemma 3
(tests/test_vision_gemma3*.py) likewise. Needs torch and transformers (the test extras).

    python scripts/tiny_vlm.py DIR [idefics3|qwen2_5_vl|gemma3]      # write one
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


CORPUS = "what is in this picture? a red square, a blue sky, hello world 12345"


def write_tokenizer(path: Path, specials: list[str], template: str = CHATML, extra: dict[str, Any] | None = None,
                    corpus: str = CORPUS) -> None:
    """A byte-level BPE of 200 ids whose first ids are `specials` (BOS, EOS, the chat turn's, then the image
    tokens), trained on `corpus` (its characters are the alphabet), with a chat template (ChatML unless given),
    EOS ids [1, 3] and `extra` tokenizer_config fields."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([corpus] * 5,
                            trainers.BpeTrainer(vocab_size=200, show_progress=False, special_tokens=specials))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": specials[0], "eos_token": specials[1], "chat_template": template,
         "additional_special_tokens": specials[4:], **(extra or {})}))
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


GEMMA_SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>", "<pad>"]
# Gemma 3's chat template (google/gemma-3-*-it's): an image item renders as <start_of_image>, text items trimmed
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}{%- else -%}{%- set first_user_prefix = \"\" -%}"
    "{%- set loop_messages = messages -%}{%- endif -%}{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}"
    "{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}{%- elif item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}{%- endif -%}{%- endfor -%}{%- else -%}"
    "{{ raise_exception(\"Invalid content type\") }}{%- endif -%}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}")
GEMMA_VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, image_size=32, patch_size=4)
GEMMA_TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, sliding_window=24,
                  query_pre_attn_scalar=24, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e5},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
GEMMA_TOKENS = 16   # mm_tokens_per_image: 8 x 8 patches of 4 pooled 2 x 2
GEMMA_PRE = dict(size={"height": 32, "width": 32}, resample=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                 do_pan_and_scan=None)


def write_tiny_gemma3(path: Path, seed: int = 0) -> Any:
    """A random Gemma3ForConditionalGeneration (a 2-layer SigLIP tower on 32-pixel images, 16 rows per image;
    a 3-layer Gemma 3 text model, sliding window 24) with Gemma 3's chat template and image tokens; returns
    transformers' model. Every 1-D parameter (norms, biases) is jittered so a wrong one shows, and the projection
    (zeros at init) is random."""
    import torch
    import transformers

    ids = {GEMMA_SPECIALS[i]: i for i in range(len(GEMMA_SPECIALS))}
    write_tokenizer(path, GEMMA_SPECIALS, GEMMA_TEMPLATE, {"extra_special_tokens": {
        "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}},
        CORPUS + "\n\n user model: describe, compare; go on. two takes! the quick brown fox jumps over a lazy dog "
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ 67890 <>()[]{}'\"-_/\\|@#$%^&*+=~`")
    cfg = transformers.Gemma3Config(vision_config=GEMMA_VISION, text_config=GEMMA_TEXT,
                                    mm_tokens_per_image=GEMMA_TOKENS, image_token_index=ids["<image_soft_token>"],
                                    boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.3)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.3)   # initialised to zeros
    model.generation_config.eos_token_id = [1, 3]   # <eos>, <end_of_turn> (Gemma 3's own: 1 and 106)
    model.save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps(GEMMA_PRE))
    (path / "processor_config.json").write_text(json.dumps({"image_seq_length": GEMMA_TOKENS}))
    return model


def hf_gemma3_processor(path: Path) -> Any:
    """transformers' Gemma3Processor (its PIL image processor) for a checkpoint written by `write_tiny_gemma3`."""
    import transformers
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path)
    return transformers.Gemma3Processor(Gemma3ImageProcessorPil(**GEMMA_PRE), tokenizer,
                                        chat_template=GEMMA_TEMPLATE, image_seq_length=GEMMA_TOKENS)


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
    {"idefics3": write_tiny_idefics3, "qwen2_5_vl": write_tiny_qwen2_5_vl, "gemma3": write_tiny_gemma3}[family](out)
    print(f"wrote a tiny random {family} checkpoint to {out}")
