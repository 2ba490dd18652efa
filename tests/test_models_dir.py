"""--models-dir: a server started with no model lists the directory, loads the model a request
names, and swaps between models with concurrent clients without losing a request."""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from support.servers import READY_TIMEOUT_S, REAL_ENGINE_ARGS, LiveServer, wait_for
from tiny_models import make_adapter

SMOL = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_no_model_then_swaps_by_request_and_by_admin(smollm2_gguf_path: Path, tiny_hf_dir: Path,
                                                      tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(smollm2_gguf_path, models / SMOL)
    os.symlink(tiny_hf_dir, models / "tiny-llama")
    (models / "notes.txt").write_text("not a model")
    live = LiveServer([*REAL_ENGINE_ARGS, "--models-dir", str(models), "--swap-min-seconds", "0"],
                      tmp_path / "server.log")
    try:
        wait_for(live.url + "/health", 200, timeout=60, proc=live.proc)
        ready = httpx.get(live.url + "/ready")
        assert ready.status_code == 503 and ready.json()["code"] == "no_model"
        cards = httpx.get(live.url + "/v1/models").json()["data"]
        assert [(c["id"], c["loaded"]) for c in cards] == [(SMOL, False), ("tiny-llama", False)]
        refused = httpx.post(live.url + "/v1/completions", json={"model": "other", "prompt": "x"}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "no_model"
        lora = httpx.post(live.url + "/admin/lora/load", json={"path": "/x"}, timeout=30)
        assert (lora.status_code, lora.json()["error"]["code"]) == (409, "no_model")   # imp's 409

        async def ask(client: httpx.AsyncClient, model: str) -> httpx.Response:
            return await client.post(live.url + "/v1/completions", timeout=READY_TIMEOUT_S, json={
                "model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True})

        async def waves() -> list[httpx.Response]:
            async with httpx.AsyncClient() as client:
                first = await asyncio.gather(*(ask(client, "tiny-llama") for _ in range(3)))
                to_smol = await asyncio.gather(*(ask(client, SMOL) for _ in range(3)))
                back = await ask(client, "tiny-llama")
                return [*first, *to_smol, back]

        answers = asyncio.run(waves())
        assert [r.status_code for r in answers] == [200] * 7, [r.text for r in answers]
        assert [r.json()["model"] for r in answers] == ["tiny-llama"] * 3 + [SMOL] * 3 + ["tiny-llama"]
        assert all(r.json()["usage"]["completion_tokens"] == 4 for r in answers)
        # one swap pending at most: a request for another model meanwhile is a 503 at once (test_grants.py)
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


def test_a_swap_drops_adapters_and_a_failed_one_restores_the_model(smollm2_gguf_path: Path, tiny_hf_dir: Path,
                                                                  tmp_path: Path) -> None:
    """imp's rule: a swap drops every adapter (a log line each, nothing re-loaded); /ready says `swapping`
    meanwhile; a model that fails to load gives the previous model back instead of leaving none."""
    models = tmp_path / "models"
    models.mkdir()
    os.symlink(tiny_hf_dir, models / "tiny-llama")
    os.symlink(smollm2_gguf_path, models / SMOL)
    (models / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 64)   # named like a model, not loadable
    adapter = make_adapter(tiny_hf_dir, tmp_path / "adapter", 1, r=4, lora_alpha=8, target_modules=["q_proj"])
    live = LiveServer([*REAL_ENGINE_ARGS, "--models-dir", str(models), "--model", str(models / "tiny-llama"),
                       "--lora", f"startup={adapter}", "--max-loras", "2"], tmp_path / "server.log")
    try:
        wait_for(live.url + "/ready", 200, timeout=READY_TIMEOUT_S, proc=live.proc)
        # the start-up adapter's path may be loaded again without --lora-dir
        loaded = httpx.post(live.url + "/admin/lora/load", json={"name": "runtime", "path": str(adapter)}, timeout=60)
        assert loaded.status_code == 200
        def ask(lora: str) -> httpx.Response:
            return httpx.post(live.url + "/v1/completions", timeout=60, json={
                "model": "tiny-llama", "prompt": "Hello", "max_tokens": 2, "temperature": 0, "lora": lora})

        assert [ask(name).status_code for name in ("startup", "runtime")] == [200, 200]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:   # the swap, while /ready is asked
            swap = pool.submit(httpx.post, live.url + "/admin/models/load", json={"model": SMOL},
                               timeout=READY_TIMEOUT_S)
            seen = set()
            while not swap.done():
                r = httpx.get(live.url + "/ready")
                seen.add((r.status_code, r.json().get("code"), r.headers.get("retry-after")))
                time.sleep(0.05)
            assert swap.result().status_code == 200
        assert (503, "swapping", "5") in seen
        for name in ("startup", "runtime"):   # dropped, not re-loaded (POST /admin/lora/load again)
            gone = httpx.post(live.url + "/v1/completions", timeout=60, json={
                "model": SMOL, "prompt": "Hello", "max_tokens": 2, "lora": name})
            assert (gone.status_code, gone.json()["error"]["code"]) == (400, "lora_not_loaded")
        failed = httpx.post(live.url + "/admin/models/load", json={"model": "broken.gguf"}, timeout=READY_TIMEOUT_S)
        assert (failed.status_code, failed.json()["error"]["code"]) == (503, "model_load_failed")
        ready = httpx.get(live.url + "/ready")
        assert ready.status_code == 200 and ready.json()["model"] == SMOL
        log = live.log_text()
        assert "dropped LoRA adapter 'startup'" in log and "dropped LoRA adapter 'runtime'" in log
        assert f"restoring model '{SMOL}' after the failed swap to 'broken.gguf'" in log
    finally:
        assert live.stop() == 0


def test_start_up_adapters_need_the_model_they_belong_to(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "imp_jax.server", "--models-dir", str(tmp_path), "--lora", "a=/x"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--lora needs --model" in done.stderr
