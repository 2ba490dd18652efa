"""BERT encoders from GGUF (model/formats/gguf_encoder.py): MiniLM written to a GGUF the way llama.cpp's
convert_hf_to_gguf.py does (gguf-py's tensor names, the phantom-space WordPiece vocabulary,
SpecialVocab's ids) against the HF directory it came from: token ids, embeddings, one request
through a served /v1/embeddings; a tiny random BERT for fused q|k|v, F16 / Q8_0 matrices, CLS
pooling; and the files that are refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from support.corpora import SENTENCES
from support.servers import FakeEngine, app_in_thread, fake_tokenizer, wait_for
from tiny_models import write_tiny_bert

MINILM = "all-minilm-l6-v2"
EXTRA = ["[CLS] a literal [SEP] in the text [MASK]", "Crème brûlée à la française", "naïve café résumé",
         "supercalifragilisticexpialidocious antidisestablishmentarianism", "x" * 150, "AT&T's 3.5% rise",
         "你好，世界", "", "   ", "e-mail: someone@example.com, url: https://example.org/a?b=c"]


def write_bert_gguf(hf_dir: Path, out: Path, matrices: str = "F32", pooling: int = 1, fuse_qkv: bool = False,
                    arch: str = "bert", tokenizer_model: str = "bert") -> Path:
    """A GGUF of an HF BertModel directory as convert_hf_to_gguf.py writes one (BertModel.set_gguf_parameters,
    set_vocab, modify_tensors), 2-D matrices as `matrices` (F32, F16 or Q8_0), 1-D tensors F32."""
    import gguf
    from safetensors.numpy import load_file
    from tiny_gguf import recorded_metadata, write_named_gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    tj = json.loads((hf_dir / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    control = {a["content"] for a in tj["added_tokens"] if a["special"]}
    tokens = [by_id[i] for i in range(len(by_id))]
    types = [gguf.TokenType.CONTROL if t in control else gguf.TokenType.NORMAL for t in tokens]
    meta: dict[str, Any] = dict(
        context_length=cfg["max_position_embeddings"], embedding_length=cfg["hidden_size"],
        feed_forward_length=cfg["intermediate_size"], block_count=L, head_count=cfg["num_attention_heads"],
        layer_norm_eps=cfg["layer_norm_eps"], causal_attention=False, pooling_type=gguf.PoolingType(pooling),
        token_type_count=cfg.get("type_vocab_size", 1), tokenizer_model=tokenizer_model, tokenizer_pre="default",
        token_list=[t if ty == gguf.TokenType.CONTROL else t[2:] if t.startswith("##") else "\u2581" + t
                    for t, ty in zip(tokens, types)],   # llama.cpp's "phantom space" spelling
        token_types=types)
    meta.update(recorded_metadata(lambda w: gguf.SpecialVocab(hf_dir, n_vocab=len(tokens)).add_to_gguf(w, quiet=True)))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, L)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors = {k.removeprefix("bert."): v for k, v in tensors.items()
               if not k.startswith(("pooler.", "bert.pooler.")) and not k.endswith("position_ids")}
    if fuse_qkv:
        for i in range(L):
            for s in ("weight", "bias"):
                p = f"encoder.layer.{i}.attention.self."
                tensors[f"{p}qkv.{s}"] = np.concatenate([tensors.pop(f"{p}{n}.{s}") for n in ("query", "key", "value")])
    stored = {}
    for name, value in tensors.items():
        if ".qkv." in name:
            new = f"blk.{name.split('.')[2]}.attn_qkv.{name.rsplit('.', 1)[1]}"
        else:
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        value = np.ascontiguousarray(value, np.float32)
        stored[new] = (value, gguf.GGMLQuantizationType[matrices if value.ndim == 2 else "F32"])
    write_named_gguf(out, arch, meta, stored)
    return out


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    from imp_jax.model.formats.hub import resolve_model

    return resolve_model(MINILM).path


@pytest.fixture(scope="module")
def minilm_gguf(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_bert_gguf(minilm_dir, tmp_path_factory.mktemp("gguf_enc") / "minilm-f32.gguf")


@pytest.fixture(scope="module")
def tiny_bert_dir(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random BertModel with MiniLM's tokenizer files."""
    path = tmp_path_factory.mktemp("tiny_bert")
    write_tiny_bert(path, minilm_dir, hidden_size=64, intermediate_size=128, max_position_embeddings=64)
    return path


def _pooled(loaded: list[Any], texts: list[str]) -> list[np.ndarray]:
    """Each loaded encoder's finished embeddings of `texts` from one jitted program (same graph, their weights)."""
    import jax
    from flax import nnx

    from imp_jax.runtime.vectors import finish_embeddings

    batches = [enc.tokenizer.encode_batch(texts) for enc in loaded]
    S = max(len(ids) for b in batches for ids, _ in b)
    graphdef, _ = nnx.split(loaded[0].model)
    pooling = loaded[0].settings.pooling

    @jax.jit
    def run(state, ids, types, lengths):
        model = nnx.merge(graphdef, state)
        return model.pool(model(ids, types, lengths), lengths, pooling)

    out = []
    for enc, batch in zip(loaded, batches):
        ids = np.zeros((len(texts), S), np.int32)
        types = np.zeros_like(ids)
        lengths = np.array([len(i) for i, _ in batch], np.int32)
        for r, (i, t) in enumerate(batch):
            ids[r, :len(i)], types[r, :len(t)] = i, t
        vectors = np.asarray(run(nnx.split(enc.model)[1], ids, types, lengths))
        out.append(finish_embeddings(vectors, None, enc.settings.normalize))
    return out


def test_wordpiece_from_the_gguf_vocabulary_gives_the_hf_ids(minilm_dir: Path, minilm_gguf: Path) -> None:
    from imp_jax.model.formats.encoder_loader import EncoderTokenizer
    from imp_jax.model.formats.gguf_encoder import gguf_wordpiece
    from imp_jax.model.formats.gguf_file import GGUFFile

    hf = EncoderTokenizer.from_dir(minilm_dir)
    ours = EncoderTokenizer(gguf_wordpiece(GGUFFile(minilm_gguf).fields, minilm_gguf))
    assert ours.vocab_size == hf.vocab_size == 30522
    texts = SENTENCES + EXTRA
    assert ours.encode_batch(texts) == hf.encode_batch(texts)
    assert ours.encode_pairs(SENTENCES[3], SENTENCES[:10]) == hf.encode_pairs(SENTENCES[3], SENTENCES[:10])
    ids, types = ours.encode("Hello world!")
    assert ids[0] == 101 and ids[-1] == 102 and types == [0] * len(ids)   # [CLS] ... [SEP]
    assert ours.encode("UPPER case")[0] == ours.encode("upper CASE")[0]   # an uncased vocabulary lowercases
    fields = GGUFFile(minilm_gguf).fields   # an older file: the vocabulary in plain WordPiece spelling
    plain = json.loads((minilm_dir / "tokenizer.json").read_text())["model"]["vocab"]
    fields["tokenizer.ggml.tokens"] = sorted(plain, key=plain.get)
    assert EncoderTokenizer(gguf_wordpiece(fields, minilm_gguf)).encode_batch(texts) == hf.encode_batch(texts)


def test_a_cased_vocabulary_keeps_case() -> None:
    from imp_jax.model.formats.encoder_loader import EncoderTokenizer
    from imp_jax.model.formats.gguf_encoder import gguf_wordpiece

    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "\u2581Hello", "\u2581hello", "\u2581World", "\u2581world", "s"]
    fields = {"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": words,
              "tokenizer.ggml.token_type": [3, 3, 3, 3, 1, 1, 1, 1, 1], "tokenizer.ggml.bos_token_id": 2,
              "tokenizer.ggml.seperator_token_id": 3, "tokenizer.ggml.unknown_token_id": 1}
    tok = EncoderTokenizer(gguf_wordpiece(fields, Path("cased.gguf")))
    assert tok.encode("Hello worlds")[0] == [2, 4, 7, 8, 3]   # 'worlds' = world ##s
    assert tok.encode("Hello", "World")[1] == [0, 0, 0, 1, 1]


def test_minilm_gguf_embeds_as_the_hf_directory(minilm_dir: Path, minilm_gguf: Path) -> None:
    from imp_jax.model.formats.encoder_loader import load_encoder

    gg, hf = load_encoder(minilm_gguf), load_encoder(minilm_dir)
    assert gg.config.vocab_size == hf.config.vocab_size and gg.config.num_layers == 6
    assert gg.config.layer_norm_eps == hf.config.layer_norm_eps
    assert (gg.settings.task, gg.settings.pooling, gg.settings.normalize) == ("embed", "mean", True)
    assert gg.settings.max_len == 512   # bert.context_length (the HF directory's sentence-transformers cap: 256)
    got, want = _pooled([gg, hf], SENTENCES)
    assert got.shape == (50, 384)
    assert np.abs(got - want).max() <= 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)


def test_served_gguf_embeddings(minilm_dir: Path, minilm_gguf: Path) -> None:
    """One request through a real app: the engine serves the GGUF under its file name, unit vectors."""
    import openai

    from imp_jax.model.formats.encoder_loader import load_encoder
    from imp_jax.runtime.core.encoder_engine import EncoderEngine, EncoderEngineConfig
    from imp_jax.server.app import create_app
    from imp_jax.server.config import ServerConfig
    from imp_jax.server.encoders import install_encoders

    engine = EncoderEngine(EncoderEngineConfig(str(minilm_gguf), max_batch=4, max_batch_tokens=128,
                                               dtype="float32"))
    assert engine.served_name == "minilm-f32.gguf" and engine.task == "embed"
    chat = FakeEngine(fake_tokenizer())
    chat.start()
    app = create_app(chat, ServerConfig())
    install_encoders(app, [engine])
    with app_in_thread(app) as url:
        wait_for(url + "/ready", 200, timeout=600)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        out = client.embeddings.create(model="minilm-f32.gguf", input=SENTENCES[:3], encoding_format="float")
        got = np.array([d.embedding for d in out.data])
        models = httpx.get(url + "/v1/models").json()["data"]
    chat.shutdown()
    (want,) = _pooled([load_encoder(minilm_dir)], SENTENCES[:3])
    assert np.abs(got - want).max() <= 1e-4
    assert out.usage.prompt_tokens == sum(len(i) for i, _ in engine.tokenizer.encode_batch(SENTENCES[:3]))
    card = next(m for m in models if m["id"] == "minilm-f32.gguf")
    assert card["task"] == "embed" and card["dimensions"] == 384


@pytest.mark.parametrize("matrices,tol", [("F16", 3e-3), ("Q8_0", 3e-2)])
def test_quantised_fused_qkv_cls_pooling(tiny_bert_dir: Path, tmp_path: Path, matrices: str, tol: float) -> None:
    """Fused attn_qkv, CLS pooling and F16 / Q8_0 matrices (dequantised to float32) against the F32 file."""
    from imp_jax.model.formats.encoder_loader import load_encoder

    ref = load_encoder(write_bert_gguf(tiny_bert_dir, tmp_path / "f32.gguf", pooling=2))
    quant = load_encoder(write_bert_gguf(tiny_bert_dir, tmp_path / "q.gguf", matrices, pooling=2, fuse_qkv=True))
    assert quant.settings.pooling == ref.settings.pooling == "cls"
    assert quant.model.layers[0].qkv_w[...].dtype == np.float32
    got, want = _pooled([quant, ref], SENTENCES[:8])
    err = np.abs(got - want).max()
    assert 0 < err <= tol   # close, and really read from the narrower tensors


def test_files_that_are_refused(tiny_bert_dir: Path, tmp_path: Path, smollm2_gguf_path: Path) -> None:
    from imp_jax.errors import ModelLoadError
    from imp_jax.runtime.core.encoder_engine import EncoderEngine, EncoderEngineConfig

    cases = [(dict(pooling=4), "pooling_type 4 is rank"), (dict(pooling=0), "pooling_type 0 is none"),
             (dict(arch="nomic-bert"), "architecture 'nomic-bert' is not an encoder"),
             (dict(tokenizer_model="t5"), "tokenizer.ggml.model 't5' is not supported")]
    for i, (kw, message) in enumerate(cases):
        path = write_bert_gguf(tiny_bert_dir, tmp_path / f"bad{i}.gguf", **kw)
        with pytest.raises(ModelLoadError, match=message):   # at start-up, before any weight is read
            EncoderEngine(EncoderEngineConfig(str(path)))
    with pytest.raises(ModelLoadError, match="GGUF architecture 'llama' is not an encoder"):
        EncoderEngine(EncoderEngineConfig(str(smollm2_gguf_path)))
