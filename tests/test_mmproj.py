"""`--mmproj`: a GGUF text model plus llama.cpp's vision projector GGUF (model/vision/mmproj.py) served like the
HF directory both came from, for Idefics3 / SmolVLM, Qwen2.5-VL and Gemma 3.

The GGUF pairs are written here as llama.cpp's converter writes them (convert_hf_to_gguf.py: Llama's Q/K row
permutation, Qwen's q|k|v and Conv3d splits, Gemma's norms stored as 1 + w), names through gguf's own
TensorNameMap, from the tiny checkpoints of scripts/tiny_vlm.py (which tests/test_vision_engine*.py and
test_vision_gemma3*.py tie to transformers); Gemma 3's text GGUF by test_gemma.py's writer. One test also runs the
real converter when its sources are on this machine.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import tiny_vlm  # noqa: E402

from paged import run_to_end  # noqa: E402
from support.gemma_models import write_gemma_gguf, write_tiny_gemma  # noqa: E402
from support.gguf_models import write_gguf  # noqa: E402
from support.vision import synthetic_image  # noqa: E402
from tiny_gguf import write_named_gguf  # noqa: E402
from imp_jax.errors import ModelLoadError  # noqa: E402
from imp_jax.model.config import ModelConfig, read_json  # noqa: E402
from imp_jax.model.formats.gguf_file import GGUFFile  # noqa: E402
from imp_jax.model.formats.gguf_loader import permute_rotary  # noqa: E402
from imp_jax.model.formats.loader import SafetensorsDir, open_checkpoint  # noqa: E402
from imp_jax.model.vision.side import TextModelTensors, build_vision, text_tensors  # noqa: E402
from imp_jax.runtime.core.builder import build_engine  # noqa: E402
from imp_jax.runtime.config import EngineConfig  # noqa: E402
from imp_jax.runtime.decoding.image_family import image_family  # noqa: E402
from imp_jax.runtime.request import GenerationRequest, ImageInput, SamplingParams  # noqa: E402

# llama.cpp's converter (the llama-cpp-python sdist the peer benchmarks unpack); absent: that test skips
CONVERTER = (Path.home() / ".cache/imp_jax/peers/src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py")
FAMILIES = {"idefics3": ("llama", gguf.MODEL_ARCH.LLAMA, "idefics3"),
            "qwen2_5_vl": ("qwen2vl", gguf.MODEL_ARCH.QWEN2VL, "qwen2.5vl_merger"),
            "gemma3": ("gemma3", gguf.MODEL_ARCH.GEMMA3, "gemma3")}
WRITERS = {"idefics3": tiny_vlm.write_tiny_idefics3, "qwen2_5_vl": tiny_vlm.write_tiny_qwen2_5_vl,
           "gemma3": tiny_vlm.write_tiny_gemma3}
GREEDY = dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, max_tokens=6,
              ignore_eos=True, logprobs=5)
PICTURE = (37, 53, 0)   # width, height, seed: 2 x 2 tiles + global for Idefics3, 14 x 10 patches for Qwen
# transformers 5 saves Gemma 3's tower as `vision_tower.*`; the hub's checkpoints, and so the converter, name it
# `vision_tower.vision_model.*` (the converter cannot map the former)
HUB_TOWER = ("vision_tower.", "vision_tower.vision_model.")


# ------------------------------------------------------------------------------------------------ the writer
def _vocab(hf_dir: Path, vocab_size: int) -> dict[str, Any]:
    """The HF tokenizer as the converter's `_set_vocab_gpt2` writes it (GGUFWriter `add_<key>` values by key):
    byte-level BPE, special added tokens as control tokens, ids past the tokenizer up to the embedding rows as
    [PADn] (unused)."""
    tok = read_json(hf_dir / "tokenizer.json")
    cfg = read_json(hf_dir / "tokenizer_config.json")
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    by_id = {i: t for t, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    return dict(tokenizer_model="gpt2", tokenizer_pre="default", token_list=tokens,
                token_types=[3 if t in special else 1 if i in by_id else 5 for i, t in enumerate(tokens)],
                token_merges=[m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]],
                bos_token_id=vocab[cfg["bos_token"]], eos_token_id=vocab[cfg["eos_token"]], add_bos_token=False,
                chat_template=cfg["chat_template"])


def write_text_gguf(hf_dir: Path, out: Path, family: str) -> Path:
    """The decoder of the image-text checkpoint `hf_dir` as a text GGUF (`llama`, `qwen2vl` or `gemma3`: the last
    by test_gemma.py's writer, with this checkpoint's byte-level vocabulary, as the converter writes a Gemma 3
    without tokenizer.model). The converter would also drop Gemma 3's embedding rows past the tokenizer's ids;
    they stay here (unused ids, but their logits are in every logprob's softmax, which must equal the HF
    directory's)."""
    arch_name, arch, _ = FAMILIES[family]
    cfg = ModelConfig.from_file(hf_dir / "config.json")
    if family == "gemma3":
        tensors = TextModelTensors(SafetensorsDir(hf_dir), "language_model.model.")
        write_gemma_gguf(cfg, {n: tensors[n] for n in tensors if n.startswith(("model.", "lm_head."))}, out,
                         scale_key=True, vocab=_vocab(hf_dir, cfg.vocab_size))
        return out
    meta: dict[str, Any] = dict(
        context_length=cfg.max_position_embeddings, embedding_length=cfg.hidden_size, block_count=cfg.num_layers,
        feed_forward_length=cfg.intermediate_size, head_count=cfg.num_heads, head_count_kv=cfg.num_kv_heads,
        layer_norm_rms_eps=cfg.rms_norm_eps, rope_freq_base=cfg.rope_theta)
    if cfg.mrope_section:
        meta["rope_dimension_sections"] = [*cfg.mrope_section, 0]
    names = gguf.get_tensor_name_map(arch, cfg.num_layers)
    tensors = text_tensors(SafetensorsDir(hf_dir))
    stored = {}
    for name in (n for n in tensors if n.startswith(("model.", "lm_head."))):   # not Qwen's `visual.*`
        x = tensors[name]
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):   # LlamaModel.permute
            x = permute_rotary(x, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stored[names.get_name(name, try_suffixes=(".weight", ".bias"))] = x
    write_named_gguf(out, arch_name, {**meta, **_vocab(hf_dir, cfg.vocab_size)}, stored)
    return out


def write_mmproj(hf_dir: Path, out: Path, family: str, f16: bool = False) -> Path:
    """The image side of `hf_dir` as `convert_hf_to_gguf.py --mmproj` writes it (conversion/smolvlm.py, qwenvl.py,
    gemma.py); `f16`: as its default `--outtype f16` does, matrices in float16 (not the SigLIP embeddings, kept
    float32). Qwen: the tiny tower's window (16 px) and the HF preprocessor's pixel bounds go in gguf's
    `window_size` and `image_min/max_pixels` keys, which the converter leaves out (llama.cpp then uses 112 px and
    its own bounds). Gemma 3: the converter stores `mm.input_projection.weight` float16 whatever `--outtype`; here
    it stays float32 unless `f16`, so the pair can be held to the HF directory's logprobs (the real converter's
    test checks that rounding)."""
    hf, pre = read_json(hf_dir / "config.json"), read_json(hf_dir / "preprocessor_config.json")
    v, qwen, gemma = hf["vision_config"], family == "qwen2_5_vl", family == "gemma3"
    blocks = v["depth"] if qwen else v["num_hidden_layers"]
    default_mean = (0.48145466, 0.4578275, 0.40821073) if qwen else (0.5, 0.5, 0.5)
    default_std = (0.26862954, 0.26130258, 0.27577711) if qwen else (0.5, 0.5, 0.5)
    meta: dict[str, Any] = dict(
        type=gguf.GGUFType.MMPROJ, clip_has_vision_encoder=True, vision_projection_dim=hf["text_config"]["hidden_size"],
        vision_image_size=v.get("image_size", 560), vision_patch_size=v["patch_size"],
        vision_embedding_length=v["hidden_size"], vision_feed_forward_length=v["intermediate_size"],
        vision_block_count=blocks, vision_head_count=v["num_heads"] if qwen else v["num_attention_heads"],
        vision_image_mean=list(pre.get("image_mean", default_mean)),
        vision_image_std=list(pre.get("image_std", default_std)), clip_projector_type=FAMILIES[family][2])
    if qwen:
        meta.update(vision_use_silu=True, vision_n_wa_pattern=v["fullatt_block_indexes"][0] + 1,
                    vision_attention_layernorm_eps=hf.get("rms_norm_eps", 1e-6), vision_window_size=v["window_size"],
                    vision_min_pixels=pre["min_pixels"], vision_max_pixels=pre["max_pixels"])
    elif gemma:   # Gemma3VisionModel: the pooling side only when not llama.cpp's default 4
        meta.update(vision_attention_layernorm_eps=v.get("layer_norm_eps", 1e-6), vision_use_gelu=True)
        rows = read_json(hf_dir / "processor_config.json").get("image_seq_length", 256)
        pool = v["image_size"] // v["patch_size"] // math.isqrt(rows)
        if pool != 4:
            meta["vision_projector_scale_factor"] = pool
    else:
        meta.update(vision_attention_layernorm_eps=v.get("layer_norm_eps", 1e-5),
                    vision_projector_scale_factor=hf.get("scale_factor", 2), vision_use_gelu=True,
                    vision_preproc_image_size=pre["size"]["longest_edge"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    tensors = SafetensorsDir(hf_dir)
    prefixes = {"qwen2_5_vl": ("visual.",), "gemma3": ("vision_tower.", "multi_modal_projector."),
                "idefics3": ("model.vision_model.", "model.connector.")}[family]
    stored = {}
    for name in (n for n in tensors if n.startswith(prefixes)):
        for hf_name, x in _converter_tensors(name, tensors[name]):
            suffix = ".weight.1" if hf_name.endswith(".weight.1") else None
            gname = names.get_name(hf_name.removesuffix(".1") if suffix else hf_name, try_suffixes=(".weight", ".bias"))
            half = f16 and x.ndim > 1 and ".embeddings." not in name
            stored[gname + ".1" if suffix else gname] = x.astype(np.float16) if half else x
    write_named_gguf(out, "clip", meta, stored)
    return out


def _converter_tensors(name: str, x: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Qwen2VLVisionModel.modify_tensors: q|k|v split in three, the Conv3d kernel into its two frames.
    Gemma3VisionModel's filter_tensors and modify_tensors: the hub's tower names (`hub_name`), its pooling head
    dropped (unused), `_weight` read as `.weight`, the soft-emb norm stored as 1 + w."""
    name = hub_name(name)
    if ".qkv." in name:
        return [(name.replace("qkv", p), part) for p, part in zip("qkv", np.split(x, 3))]
    if name.endswith("patch_embed.proj.weight"):
        return [(name, x[:, :, 0]), (name + ".1", x[:, :, 1])]
    if "vision_model.head." in name:
        return []
    if name.startswith("multi_modal_projector."):
        name = name.replace("_weight", ".weight")
        return [(name, x + np.float32(1) if "soft_emb_norm" in name else x)]
    return [(name, x)]


def hub_name(name: str) -> str:
    """A Gemma 3 tensor's name as the hub's checkpoints have it (HUB_TOWER); any other name unchanged."""
    old, new = HUB_TOWER
    return new + name[len(old):] if name.startswith(old) and not name.startswith(new) else name


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, HF dir, text GGUF, mmproj GGUF) of one tiny checkpoint."""
    family = request.param
    root = tmp_path_factory.mktemp(f"mmproj-{family}")
    hf_dir = root / "hf"
    hf_dir.mkdir()
    louder(WRITERS[family](hf_dir), family).save_pretrained(hf_dir)
    return (family, hf_dir, write_text_gguf(hf_dir, root / "text.gguf", family),
            write_mmproj(hf_dir, root / "mmproj.gguf", family))


def louder(model, family: str, gain: float = 50.0):
    """`model` with its image rows `gain` times larger: the tiny random decoder barely hears them otherwise (another
    picture moved its logprobs by 5e-5), and a mistake in the image side must show in the tokens' logprobs. Not
    Gemma 3: its image rows already outweigh its tiny text embeddings (the projection is N(0, 0.3), unscaled), and
    louder rows only mute their differences (with a gain of 50, the soft-emb norm read as 2 + w kept the top
    tokens, which it changes at 1; a tower eps of 1e-5 moved the logprobs 9.5e-7, inside the
    tolerance, against 1.4e-6)."""
    import torch

    if family == "gemma3":
        return model
    inner = model.model
    last = inner.connector.modality_projection.proj if family == "idefics3" else inner.visual.merger.mlp[2]
    with torch.no_grad():   # the weight alone: the bias is the same for every picture
        last.weight.mul_(gain)
    return model


def engine(model: Path, mmproj: Path | None = None):
    """A small engine whose 32-token budget chunks the image prompt's prefill."""
    return build_engine(EngineConfig(model=str(model), mmproj=str(mmproj) if mmproj else None, max_model_len=256,
                                     max_num_seqs=2, max_num_batched_tokens=32, num_kv_blocks=48,
                                     image_cache_rows=16 * 12, seed=0, dtype="float32", speculative="off"))


def picture() -> ImageInput:
    pixels = np.asarray(synthetic_image(*PICTURE))
    return ImageInput(pixels, hashlib.blake2b(pixels.tobytes(), digest_size=16).digest(), "PNG", 0)


def image_prompt(core, img: ImageInput) -> list[int]:
    """A chat turn with the image's prompt text (the family's layout), tokenized by the engine's own tokenizer."""
    text = image_family(core.loaded.vision).prompt(img.size)
    return core.tokenizer.encode(f"<|im_start|>user\n{text}what is in this picture?<|im_end|>\n"
                                 "<|im_start|>assistant\n", add_special_tokens=False)


# ------------------------------------------------------------------------------------------------ tests
def test_the_projector_opens_to_the_hf_directorys_image_side(pair):
    """Config (tower shape, full-attention blocks, image token ids) and preprocessing equal the HF directory's,
    and so does every tensor the encoder is built from."""
    family, hf_dir, text, mmproj = pair
    got, want = open_checkpoint(text, str(mmproj)).vision, open_checkpoint(hf_dir).vision
    assert got.config == want.config and got.processor == as_stored(want.processor)
    assert_same_weights(got, want)


def as_stored(processor):
    """A preprocessor config with its mean and std as a GGUF stores them (float32; preprocessing casts to it)."""
    f32 = lambda xs: tuple(float(str(np.float32(x))) for x in xs)  # noqa: E731
    return dataclasses.replace(processor, image_mean=f32(processor.image_mean), image_std=f32(processor.image_std))


def assert_same_weights(got, want, rtol: float = 0.0, atol: float = 0.0, f16: tuple[tuple, ...] = ()) -> None:
    """The encoders built from two opened image sides hold the same parameters (bit for bit by default). Gemma 3's
    projector norm is compared as the scale 1 + w its projector multiplies by: a file holds that scale, so w comes
    back as (1 + w) - 1, off in its last bits, and 1 + w bit-equal. `f16`: the paths of parameters a file holds in
    float16, compared with the reference's rounded to float16."""
    built = [build_vision(c, np.float32) for c in (got, want)]
    a, b = (nnx.to_flat_state(nnx.state(v.encoder)) for v in built)
    assert [path for path, _ in a] == [path for path, _ in b]
    for (path, x), (_, y) in zip(a, b):
        x, y = np.asarray(x[...]), np.asarray(y[...])
        if built[1].family == "gemma3" and path == ("norm",):
            x, y = 1 + x, 1 + y
        if path in f16:
            y = y.astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=str(path))


def test_an_f16_projector_loads_the_weights_rounded_to_f16(pair, tmp_path):
    """The converter's default output type: float16 matrices are read back as float32 (to f16's precision)."""
    family, hf_dir, text, _ = pair
    path = write_mmproj(hf_dir, tmp_path / "f16.gguf", family, f16=True)
    assert {t.tensor_type.name for t in GGUFFile(path).tensors} == {"F16", "F32"}
    got = open_checkpoint(text, str(path)).vision
    assert_same_weights(got, open_checkpoint(hf_dir).vision, rtol=1e-3, atol=6e-8)   # f16's subnormal step


def test_the_gguf_pair_serves_an_image_like_the_hf_directory(pair):
    """Greedy tokens and their logprobs (top 5 too) with a picture, prefill chunked across the image: the same
    arithmetic on the same weights, so within 1e-6, not only 1e-4 (a wrong tower eps moved them 1e-5, full
    attention in the wrong Qwen blocks 4e-5; Gemma 3's pair gave them bit for bit here, and its tower eps at 1e-5
    moved them 1.4e-6)."""
    family, hf_dir, text, mmproj = pair
    img = picture()
    outs = []
    for core in (engine(text, mmproj), engine(hf_dir)):
        ids = image_prompt(core, img)
        outs.append((ids, run_to_end(core, GenerationRequest(f"{family}-{len(outs)}", ids,
                                                             SamplingParams(**GREEDY), images=(img,)))[0]))
    (ids, got), (want_ids, want) = outs
    assert ids == want_ids and len(ids) > 32
    assert got["error"] is None and got["tokens"] == want["tokens"]
    for lp, ref in zip(got["logprobs"], want["logprobs"]):
        assert [t for t, _ in lp.top] == [t for t, _ in ref.top]
        np.testing.assert_allclose([lp.logprob] + [x for _, x in lp.top],
                                   [ref.logprob] + [x for _, x in ref.top], atol=1e-6, rtol=0)


def _clip_file(path: Path, projector: str, width: int = 48) -> Path:
    """A minimal clip GGUF of projector type `projector` (what the refusals read before any tensor)."""
    write_named_gguf(path, "clip", dict(clip_projector_type=projector, vision_projection_dim=width),
                     {"v.post_ln.weight": np.zeros(4, np.float32)})
    return path


def test_bad_pairings_are_refused_in_one_line(pair, tmp_path):
    """Another projector type, a projector of the next family (its text GGUF of another architecture), a text GGUF
    as the projector, an HF directory."""
    family, hf_dir, text, mmproj = pair
    other = list(FAMILIES)[(list(FAMILIES).index(family) + 1) % len(FAMILIES)]
    cases = {
        str(_clip_file(tmp_path / "pixtral.gguf", "pixtral")): "projector type 'pixtral' is not supported",
        str(text): "not a vision projector",
    }
    for path, match in cases.items():
        with pytest.raises(ModelLoadError, match=match) as e:
            open_checkpoint(text, path)
        assert "\n" not in e.value.message
    with pytest.raises(ModelLoadError, match="pairs with a GGUF text model; .* is an HF directory"):
        open_checkpoint(hf_dir, str(mmproj))
    mismatched = _clip_file(tmp_path / "mismatch.gguf", FAMILIES[other][2])
    with pytest.raises(ModelLoadError, match=f"pairs with a '{FAMILIES[other][0]}' text GGUF, not "
                                             f"'{FAMILIES[family][0]}'"):
        open_checkpoint(text, str(mismatched))


@pytest.mark.parametrize("projector, lacks", [
    ("idefics3", "<image>"), ("gemma3", "<image_soft_token>, <start_of_image>, <end_of_image>")])
def test_a_text_gguf_without_the_image_tokens_or_of_another_width_is_refused(projector, lacks, tmp_path):
    """A text GGUF of the projector's family whose vocabulary has none of its image tokens (a llama with a
    byte-level vocabulary, a Gemma 3 with a SentencePiece one: tests/support): a projector of the text model's
    width is refused for the tokens, one of width 48 for the width."""
    text = tmp_path / "plain.gguf"
    if projector == "gemma3":
        write_tiny_gemma("Gemma3ForCausalLM", tmp_path / "hf")
        write_gemma_gguf(ModelConfig.from_file(tmp_path / "hf" / "config.json"), SafetensorsDir(tmp_path / "hf"),
                         text, scale_key=True)
    else:
        write_gguf(text)
    hidden = open_checkpoint(text).config.hidden_size
    assert hidden != 48
    with pytest.raises(ModelLoadError, match=f"vocabulary lacks {lacks}$"):
        open_checkpoint(text, str(_clip_file(tmp_path / "a.gguf", projector, hidden)))
    with pytest.raises(ModelLoadError, match=f"projection width 48 differs from the text model's hidden size {hidden}"):
        open_checkpoint(text, str(_clip_file(tmp_path / "b.gguf", projector, 48)))


def test_the_server_flag_and_llm_take_mmproj(pair):
    """`--mmproj` is EngineConfig's field, so the server's flag and the offline API pass it to the loader (a
    refusal shows it got there)."""
    from imp_jax.llm import LLM
    from imp_jax.server.cli import parse_config

    family, hf_dir, text, mmproj = pair
    assert parse_config(["--model", str(text), "--mmproj", str(mmproj)], EngineConfig).engine.mmproj == str(mmproj)
    with pytest.raises(ModelLoadError, match="--mmproj"):
        LLM(str(hf_dir), mmproj=str(mmproj))


@pytest.mark.skipif(not CONVERTER.is_file(), reason=f"llama.cpp's converter is not at {CONVERTER}")
def test_the_real_converters_projector_opens_to_the_same_image_side(pair, tmp_path):
    """`convert_hf_to_gguf.py --mmproj --outtype f32` on the tiny checkpoint (skipped only where the converter's
    path does not exist): every tensor the encoder reads equals the HF directory's, and the config too, but for
    what the converter does not write, where llama.cpp's own values stand (Qwen: the 112-pixel window and
    8..4096 merged rows per image). The tiny preprocessor files gain transformers' default image_mean / image_std,
    which the converter requires. Gemma 3: the converter knows the tower only by the hub's names and refuses
    transformers 5's ("Can not map tensor 'vision_tower.embeddings.patch_embedding.bias'"), so the copy is saved
    with the hub's (HUB_TOWER); it stores the input projection float16 whatever --outtype, so that matrix is
    compared with the HF one rounded to float16. Its text half cannot be checked here: the converter has no text
    model for Idefics3, needs `sentencepiece` for Qwen2.5-VL's vocabulary (not installed), and stops on the tiny
    Gemma 3's byte-level tokenizer (its pre-tokenizer probe needs an `<unk>`), so the text GGUF is ours."""
    from safetensors.numpy import save_file

    family, hf_dir, text, _ = pair
    src = tmp_path / "src"
    shutil.copytree(hf_dir, src)
    if family == "gemma3":
        tensors = SafetensorsDir(hf_dir)
        save_file({hub_name(n): tensors[n] for n in tensors}, src / "model.safetensors", {"format": "pt"})
    pre = read_json(src / "preprocessor_config.json")
    qwen = family == "qwen2_5_vl"
    mean, std = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)) if qwen else (
        (0.5,) * 3, (0.5,) * 3)
    (src / "preprocessor_config.json").write_text(json.dumps({"image_mean": mean, "image_std": std, **pre}))
    out = tmp_path / "mmproj-real.gguf"
    subprocess.run([sys.executable, str(CONVERTER), str(src), "--outtype", "f32", "--mmproj", "--outfile", str(out)],
                   check=True, capture_output=True, timeout=600)
    got, want = open_checkpoint(text, str(out)).vision, open_checkpoint(hf_dir).vision
    expected_config, expected_processor = want.config, want.processor
    if qwen:
        area = (want.processor.patch_size * want.processor.merge_size) ** 2
        expected_config = dataclasses.replace(want.config, vision=dataclasses.replace(want.config.vision,
                                                                                      window_size=112))
        expected_processor = dataclasses.replace(want.processor, min_pixels=8 * area, max_pixels=4096 * area)
    assert got.config == expected_config and got.processor == as_stored(expected_processor)
    ours = open_checkpoint(text, str(write_mmproj(hf_dir, tmp_path / "ours.gguf", family))).vision
    assert sorted(got.tensors) == sorted(ours.tensors)   # the same GGUF names
    assert_same_weights(got, want, f16=(("proj",),) if family == "gemma3" else ())
