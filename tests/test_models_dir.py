"""--models-dir: a server started with no model lists the directory, loads the model a request
names, and swaps between models with concurrent clients without losing a request."""
from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx

from server_fixtures import READY_TIMEOUT_S, REAL_ENGINE_ARGS, LiveServer, wait_for

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_no_model_then_swaps_by_request_and_by_admin(smollm2_gguf_path: Path, tiny_hf_dir: Path,
                                                      tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(smollm2_gguf_path, models / SMOL)
    os.symlink(tiny_hf_dir, models / "tiny-llama")
    (models / "notes.txt").write_text("not a model")
    live = LiveServer([*REAL_ENGINE_ARGS, "--models-dir", str(models)], tmp_path / "server.log")
    try:
        wait_for(live.url + "/health", 200, timeout=60, proc=live.proc)
        ready = httpx.get(live.url + "/ready")
        assert ready.status_code == 503 and ready.json()["code"] == "no_model"
        cards = httpx.get(live.url + "/v1/models").json()["data"]
        assert [(c["id"], c["loaded"]) for c in cards] == [(SMOL, False), ("tiny-llama", False)]
        refused = httpx.post(live.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_model"

        async def ask(client: httpx.AsyncClient, model: str) -> httpx.Response:
            return await client.post(live.url + "/v1/completions", timeout=READY_TIMEOUT_S, json={
                "model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True})

        async def waves() -> list[httpx.Response]:
            async with httpx.AsyncClient() as client:
                first = await asyncio.gather(*(ask(client, "tiny-llama") for _ in range(3)))
                mixed = await asyncio.gather(*(ask(client, m) for m in [SMOL, "tiny-llama", SMOL, SMOL]))
                return [*first, *mixed]

        answers = asyncio.run(waves())
        assert [r.status_code for r in answers] == [200] * 7, [r.text for r in answers]
        assert [r.json()["model"] for r in answers] == ["tiny-llama"] * 3 + [SMOL, "tiny-llama", SMOL, SMOL]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in answers)
        loaded = httpx.post(live.url + "/admin/models/load", json={"model": "tiny-llama"}, timeout=READY_TIMEOUT_S)
        assert loaded.status_code == 200 and loaded.json() == {"model": "tiny-llama", "loaded": True}
        cards = {c["id"]: c["loaded"] for c in httpx.get(live.url + "/v1/models").json()["data"]}
        assert cards == {SMOL: False, "tiny-llama": True}
        assert httpx.get(live.url + "/ready").json()["model"] == "tiny-llama"
        unknown = httpx.post(live.url + "/admin/models/load", json={"model": "nope"}, timeout=30)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        log = live.log_text()
        assert log.count("swapped to model") >= 3 and "ERROR" not in log
    finally:
        assert live.stop() == 0
