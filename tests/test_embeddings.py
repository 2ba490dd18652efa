"""Encoder models beside the chat model: MiniLM embeddings against transformers, a tiny cross-encoder's
rerank, the wire shapes (openai package, Cohere / Jina bodies), bad input, and zero compilations.

One app for the module: a FakeEngine as the chat model (only its name and routes matter here), the
real MiniLM embedding engine and a tiny random-weight BertForSequenceClassification written by
transformers, each an EncoderEngine with small buckets.
"""
from __future__ import annotations

import asyncio
import base64
import concurrent.futures
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from support.corpora import SENTENCES
from support.servers import FakeEngine, app_in_thread, fake_tokenizer, protocol_members, wait_for
from tiny_models import write_tiny_bert

assert len(SENTENCES) == 50
MINILM = "all-minilm-l6-v2"
CROSS = "tiny-cross-encoder"


def _write_cross_encoder(path: Path, tokenizer_dir: Path):
    """A tiny random BertForSequenceClassification (1 label) with MiniLM's tokenizer files."""
    return write_tiny_bert(path, tokenizer_dir, classifier=True, hidden_size=32, intermediate_size=64,
                           max_position_embeddings=128)


@pytest.fixture(scope="module")
def emb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from imp_jax.model.formats.hub import resolve_model
    from imp_jax.runtime.core.encoder_engine import EncoderEngine, EncoderEngineConfig
    from imp_jax.server.app import create_app
    from imp_jax.server.config import ServerConfig
    from imp_jax.server.encoders import install_encoders

    minilm_dir = resolve_model(MINILM).path
    cross_dir = tmp_path_factory.mktemp("enc") / CROSS
    hf_cross = _write_cross_encoder(cross_dir, minilm_dir)
    small = dict(max_batch=8, max_batch_tokens=1024, dtype="float32")   # few programs; float32 on any device
    engines = [EncoderEngine(EncoderEngineConfig(MINILM, **small)),
               EncoderEngine(EncoderEngineConfig(str(cross_dir), **small))]
    chat = FakeEngine(fake_tokenizer())
    chat.start()
    app = create_app(chat, ServerConfig())
    install_encoders(app, engines)
    with app_in_thread(app) as url:
        wait_for(url + "/ready", 200, timeout=600)
        yield type("Emb", (), dict(url=url, minilm=engines[0], cross=engines[1], hf_cross=hf_cross,
                                   minilm_dir=minilm_dir, chat=chat))


def _embed(engine: Any, texts: list[str]) -> np.ndarray:
    return asyncio.run(engine.embed(engine.tokenizer.encode_batch(texts)))


def _hf_minilm(path: Path, texts: list[str]) -> np.ndarray:
    """sentence-transformers' recipe by hand: BertModel, mean over the attention mask, L2-normalised."""
    import torch
    import transformers

    model = transformers.BertModel.from_pretrained(str(path)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    batch = tok(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"][..., None].float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()


def test_minilm_matches_transformers_alone_and_batched(emb: Any) -> None:
    ref = _hf_minilm(emb.minilm_dir, SENTENCES)
    batched = _embed(emb.minilm, SENTENCES)
    assert batched.shape == (50, 384)
    assert np.abs(batched - ref).max() <= 1e-4
    alone = np.stack([_embed(emb.minilm, [s])[0] for s in SENTENCES])
    assert np.abs(alone - ref).max() <= 1e-4
    # batch invariance: the same sentence alone (bucket of 1) and among others (padded wider) agrees
    assert np.abs(alone - batched).max() <= 1e-6   # measured 3e-7: not bit-identical, close


def test_concurrent_clients_share_batches_and_get_their_own_rows(emb: Any) -> None:
    ref = _embed(emb.minilm, SENTENCES[:16])

    def one(i: int) -> list[float]:
        r = httpx.post(emb.url + "/v1/embeddings", json={"model": MINILM, "input": SENTENCES[i]}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["data"][0]["embedding"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = np.array(list(pool.map(one, range(16))))
    assert np.abs(got - ref).max() <= 1e-5


def test_both_encoder_engines_keep_the_encoder_protocol(emb: Any) -> None:
    from imp_jax.runtime.api import Encoder
    for engine in (emb.minilm, emb.cross):
        assert Encoder in type(engine).__mro__ and not type(engine).__abstractmethods__
        assert {name for name in protocol_members(Encoder) if not hasattr(engine, name)} == set()
        assert engine.state == "ready" and engine.error is None and engine.in_flight == 0
    assert (emb.minilm.task, emb.cross.task) == ("embed", "score")
    assert emb.minilm.dimensions == 384 and emb.minilm.normalize


def test_jobs_of_several_clients_run_in_one_padded_batch(emb: Any) -> None:
    """The batcher itself (what the engine thread runs on all that waits): three clients' inputs in one call."""
    from imp_jax.runtime.core.commands import Encode

    tok = emb.minilm.tokenizer
    texts = [SENTENCES[:2], [SENTENCES[2]], [SENTENCES[3]]]   # 4 inputs: one call of the 4-row bucket
    answers: list[Any] = [None] * 3
    jobs = [Encode(tok.encode_batch(t), reply=lambda v, i=i: answers.__setitem__(i, v)) for i, t in enumerate(texts)]
    before = emb.minilm.stats()["batches"]
    emb.minilm._serve_jobs(jobs)
    assert emb.minilm.stats()["batches"] - before == 1
    before = emb.minilm.stats()["batches"]
    asyncio.run(emb.minilm.run(tok.encode_batch(SENTENCES[:6])))   # 6 = 4 + 1 + 1: no call pads rows
    assert emb.minilm.stats()["batches"] - before == 3
    for t, got in zip(texts, answers):
        alone = asyncio.run(emb.minilm.run(tok.encode_batch(t)))
        assert got.shape == alone.shape and np.abs(got - alone).max() <= 1e-5


def test_the_batcher_splits_by_length_when_that_pads_less(emb: Any) -> None:
    """Length-sorted inputs go in the calls with the fewest padded tokens (plus a cost per call): four short
    and four long inputs run as 4 x 16 + 4 x 128, not 8 x 128; eight alike run as one call."""
    engine = emb.minilm
    assert engine._plan([5] * 4 + [100] * 4) == [4, 4]
    assert engine._plan([100] * 8) == [8]
    assert sorted(engine._plan([5] * 6)) == [1, 1, 4]          # no call pads rows
    assert sum(engine._plan([3, 7, 20, 40, 60, 90, 120, 200, 250])) == 9


def test_openai_client_float_base64_and_dimensions(emb: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=emb.url + "/v1", api_key="unused", max_retries=0)
    ref = _embed(emb.minilm, SENTENCES[:3])
    out = client.embeddings.create(model=MINILM, input=SENTENCES[:3], encoding_format="float")
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == MINILM
    assert np.abs(np.array([d.embedding for d in out.data]) - ref).max() <= 1e-6
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(
        len(ids) for ids, _ in emb.minilm.tokenizer.encode_batch(SENTENCES[:3]))
    default = client.embeddings.create(model=MINILM, input=SENTENCES[:3])   # asks for base64, decodes it itself
    assert np.array_equal(np.array([d.embedding for d in default.data], np.float32), ref)
    b64 = client.embeddings.create(model=MINILM, input=SENTENCES[:3], encoding_format="base64")   # left encoded
    assert np.array_equal(np.stack([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in b64.data]), ref)
    raw = httpx.post(emb.url + "/v1/embeddings", json={"input": "a", "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"),
                          _embed(emb.minilm, ["a"])[0])
    short = client.embeddings.create(model=MINILM, input=SENTENCES[1], dimensions=64)
    v = np.array(short.data[0].embedding)
    assert v.shape == (64,) and abs(np.linalg.norm(v) - 1) < 1e-5
    assert np.allclose(v, ref[1][:64] / np.linalg.norm(ref[1][:64]), atol=1e-6)


def test_token_id_inputs_are_the_model_input_as_given(emb: Any) -> None:
    ids, _ = emb.minilm.tokenizer.encode(SENTENCES[1])   # [CLS] ... [SEP], as the string would be
    for body_input in (ids, [ids, ids]):
        r = httpx.post(emb.url + "/v1/embeddings", json={"model": MINILM, "input": body_input})
        assert r.status_code == 200, r.text
        got = np.array([d["embedding"] for d in r.json()["data"]])
        assert np.abs(got - _embed(emb.minilm, [SENTENCES[1]])).max() <= 1e-5
        assert r.json()["usage"]["prompt_tokens"] == len(ids) * len(got)


def test_cross_encoder_rerank_matches_transformers_scores(emb: Any) -> None:
    import torch
    import transformers

    query = "What is the capital of France?"
    docs = ["Paris is the capital of France.", "Berlin is in Germany.", "I like turtles.",
            "The Eiffel Tower is in Paris, the French capital.", "Bananas are yellow."]
    tok = transformers.AutoTokenizer.from_pretrained(str(emb.minilm_dir))
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(emb.hf_cross(**batch).logits[:, 0]).numpy()
    cohere = {"model": CROSS, "query": query, "documents": docs, "top_n": 3, "return_documents": False}
    r = httpx.post(emb.url + "/v1/rerank", json=cohere)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == CROSS and body["id"].startswith("rerank-") and body["usage"]["total_tokens"] > 0
    order = list(np.argsort(-want, kind="stable")[:3])
    assert [x["index"] for x in body["results"]] == order
    assert all("document" not in x for x in body["results"])
    assert np.allclose([x["relevance_score"] for x in body["results"]], want[order], atol=1e-4)
    jina = {"model": CROSS, "query": query, "documents": [{"text": d} for d in docs]}
    r = httpx.post(emb.url + "/rerank", json=jina)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == list(np.argsort(-want, kind="stable"))
    assert [x["document"]["text"] for x in results] == [docs[x["index"]] for x in results]


def test_rerank_without_model_prefers_the_cross_encoder_and_embedding_model_is_cosine(emb: Any) -> None:
    query, docs = "pizza", ["I love pizza.", "The stock market fell.", "Pizza is my favourite food."]
    r = httpx.post(emb.url + "/v1/rerank", json={"query": query, "documents": docs})
    assert r.status_code == 200 and r.json()["model"] == CROSS
    r = httpx.post(emb.url + "/v1/rerank", json={"model": MINILM, "query": query, "documents": docs})
    assert r.status_code == 200, r.text
    vecs = _embed(emb.minilm, [query, *docs])
    cos = vecs[1:] @ vecs[0]
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    assert np.allclose([got[i] for i in range(3)], cos, atol=1e-5)
    assert [x["index"] for x in r.json()["results"]] == list(np.argsort(-cos, kind="stable"))


LONG = "word " * 300   # > 256 tokens


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/embeddings", {"model": MINILM, "input": ""}, "input[0]", None),
    ("/v1/embeddings", {"model": MINILM, "input": []}, "input", None),
    ("/v1/embeddings", {"model": MINILM, "input": [[]]}, "input[0]", None),
    ("/v1/embeddings", {"model": MINILM, "input": ["a", 3]}, "input[1]", None),
    ("/v1/embeddings", {"model": MINILM}, "input", None),
    ("/v1/embeddings", {"model": MINILM, "input": ["x"] * 2049}, "input", "too_many_inputs"),
    ("/v1/embeddings", {"model": MINILM, "input": ["ok", LONG]}, "input[1]", "context_length_exceeded"),
    ("/v1/embeddings", {"model": MINILM, "input": [999999]}, "input[0]", None),
    ("/v1/embeddings", {"model": MINILM, "input": "a", "dimensions": 385}, "dimensions", None),
    ("/v1/embeddings", {"model": MINILM, "input": "a", "encoding_format": "int8"}, "encoding_format", None),
    ("/v1/embeddings", {"model": "fake-model", "input": "a"}, "model", "wrong_model_task"),
    ("/v1/embeddings", {"model": CROSS, "input": "a"}, "model", "wrong_model_task"),
    ("/v1/chat/completions", {"model": MINILM, "messages": [{"role": "user", "content": "hi"}]}, "model",
     "wrong_model_task"),
    ("/v1/completions", {"model": CROSS, "prompt": "hi"}, "model", "wrong_model_task"),
    ("/v1/rerank", {"model": MINILM, "query": "", "documents": ["a"]}, "query", None),
    ("/v1/rerank", {"model": MINILM, "query": "q", "documents": []}, "documents", None),
    ("/v1/rerank", {"model": MINILM, "query": "q", "documents": [{"title": "x"}]}, "documents[0]", None),
    ("/v1/rerank", {"model": CROSS, "query": "q", "documents": [LONG]}, "documents[0]", "context_length_exceeded"),
    ("/v1/rerank", {"model": "fake-model", "query": "q", "documents": ["a"]}, "model", "wrong_model_task"),
    ("/v1/rerank", {"model": MINILM, "query": LONG, "documents": ["a"]}, "query", "context_length_exceeded"),
    ("/v1/rerank", {"model": MINILM, "query": "q", "documents": ["a", LONG]}, "documents[1]",
     "context_length_exceeded"),
    ("/v1/rerank", {"model": MINILM, "query": "q", "documents": ["a"], "top_n": 0}, "top_n", None),
    ("/v1/embeddings", {"model": MINILM, "input": "a", "truncate_prompt_tokens": 257}, "truncate_prompt_tokens",
     None),
])
def test_bad_input_is_a_400_naming_the_field(emb: Any, path: str, body: dict, param: str, code: str | None) -> None:
    r = httpx.post(emb.url + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if code:
        assert err["code"] == code, err
    if param == "model":
        assert body["model"] in err["message"]


def test_truncate_cuts_to_the_context_instead(emb: Any) -> None:
    for extra in ({"truncate": True}, {"truncate_prompt_tokens": -1}):
        r = httpx.post(emb.url + "/v1/embeddings", json={"model": MINILM, "input": LONG, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 256
    r = httpx.post(emb.url + "/v1/embeddings", json={"model": MINILM, "input": LONG, "truncate_prompt_tokens": 10})
    assert r.json()["usage"]["prompt_tokens"] == 10
    r = httpx.post(emb.url + "/v1/rerank", json={"model": CROSS, "query": "q", "documents": [LONG], "truncate": True})
    assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 128


def test_unknown_model_is_a_404(emb: Any) -> None:
    r = httpx.post(emb.url + "/v1/embeddings", json={"model": "nope", "input": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_models_metrics_log_and_no_compilations_after_warmup(emb: Any) -> None:
    cards = {c["id"]: c for c in httpx.get(emb.url + "/v1/models").json()["data"]}
    assert cards["fake-model"]["task"] == "generate"
    assert cards[MINILM]["task"] == "embed" and cards[MINILM]["dimensions"] == 384 and cards[MINILM]["loaded"]
    assert cards[CROSS]["task"] == "score" and cards[CROSS]["max_model_len"] == 128
    assert httpx.get(emb.url + f"/v1/models/{MINILM}").json()["task"] == "embed"
    httpx.post(emb.url + "/v1/embeddings", json={"input": "count me"}).raise_for_status()
    metrics = httpx.get(emb.url + "/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith('imp_endpoint_requests_total{endpoint="embeddings"}'))
    assert float(line.split()[-1]) >= 1
    assert 'imp_endpoint_requests_total{endpoint="rerank"}' in metrics
    health = httpx.get(emb.url + "/health").json()
    for name in (MINILM, CROSS):
        stats = health["encoder_models"][name]
        assert stats["state"] == "ready" and stats["programs"] > 0 and stats["compilations_after_warmup"] == 0
    assert emb.minilm.compilations_after_warmup == 0 and emb.cross.compilations_after_warmup == 0


def test_roberta_position_offset_matches_transformers(tmp_path: Path) -> None:
    """A tiny random RoBERTa (positions start after the padding id) against transformers, padded batch."""
    import jax
    import torch
    import transformers

    from imp_jax.model.architectures.bert import Encoder, EncoderConfig
    from imp_jax.model.formats.loader import SafetensorsDir
    from imp_jax.model.weights import WeightSource

    cfg = transformers.RobertaConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40, pad_token_id=1,
                                     type_vocab_size=1)
    torch.manual_seed(1)
    hf = transformers.RobertaModel(cfg, add_pooling_layer=False).float().eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = EncoderConfig.from_hf(hf.config.to_dict() | {"architectures": ["RobertaModel"]})
    assert config.position_offset == 2 and config.max_len == 38
    model = Encoder.from_hf_tensors(config, WeightSource(SafetensorsDir(tmp_path)))
    lengths = np.array([38, 5, 1], np.int32)
    ids = np.full((3, 38), 1, np.int32)
    rng = np.random.default_rng(0)
    for r, n in enumerate(lengths):
        ids[r, :n] = rng.integers(3, 100, n)
    got = np.asarray(jax.jit(model)(ids, np.zeros_like(ids), lengths))
    with torch.no_grad():
        want = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                  attention_mask=torch.tensor(np.arange(38)[None] < lengths[:, None], dtype=torch.long)).last_hidden_state
    for r, n in enumerate(lengths):
        assert np.abs(got[r, :n] - want[r, :n].numpy()).max() <= 1e-4


def test_a_model_that_is_no_encoder_stops_start_up(smollm2_gguf_path: Path, tiny_hf_dir: Path) -> None:
    from imp_jax.errors import ModelLoadError
    from imp_jax.runtime.core.encoder_engine import EncoderEngine, EncoderEngineConfig

    with pytest.raises(ModelLoadError, match="GGUF architecture 'llama' is not an encoder"):
        EncoderEngine(EncoderEngineConfig(str(smollm2_gguf_path)))   # a BERT GGUF is: test_gguf_encoder.py
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM"):
        EncoderEngine(EncoderEngineConfig(str(tiny_hf_dir)))
