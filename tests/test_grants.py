"""Issue 38, tenants: what a key may do (`inference`, `admin`), which adapter paths /admin/lora/load may read,
who may swap a --models-dir model and how often, and what /health and /v1/models show. In process, over
FakeEngine: these are the server's own rules, not the engine's."""
from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from support.servers import FakeEngine, fake_tokenizer

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Capabilities
from imp_jax.server.app import create_app
from imp_jax.server.config import ServerConfig
from imp_jax.server.context import state_of
from imp_jax.server.models_dir import ModelDirectory

ADMIN_ROUTES = [("/admin/suspend", None), ("/admin/resume", None), ("/admin/lora/load", {"path": "a"}),
                ("/admin/lora/unload", {"name": "a"}), ("/admin/models/load", {"model": "b.gguf"})]
REMOTE = {"client": ("10.0.0.2", 40000)}   # an ASGI scope's peer off this machine


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return fake_tokenizer()


def _engine(tokenizer: Any, name: str = "fake-model") -> FakeEngine:
    engine = FakeEngine(tokenizer, served_name=name)
    engine.state = "ready"
    return engine


async def _post(client: Any, path: str, body: Any = None, headers: dict[str, str] | None = None,
                scope: dict[str, Any] | None = None) -> tuple[int, dict[str, Any], Any]:
    r = await client.post(path, json=body, headers=headers or {}, scope_base=scope)
    return r.status_code, await r.get_json(), r.headers


def _run(app: Any, script: Any) -> Any:
    async def main() -> Any:
        async with app.test_app() as test_app:
            return await script(test_app.test_client())
    return asyncio.run(main())


# --------------------------------------------------------------------------------------------- grants
def test_a_key_without_the_admin_grant_gets_403_on_every_admin_route(tokenizer, tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("file-plain\nfile-admin admin\nfile-pins pins\n")
    app = create_app(_engine(tokenizer), ServerConfig(api_key=["flag-key"], admin_key=["flag-admin"],
                                                      api_key_file=str(keys)))

    async def script(client: Any) -> None:
        for path, body in ADMIN_ROUTES:
            for key in ("flag-key", "file-plain", "file-pins"):
                status, err, _ = await _post(client, path, body, {"x-api-key": key})
                assert (status, err["error"]["code"], err["error"]["type"]) == \
                    (403, "not_granted", "permission_error"), (path, key, err)
                assert "'admin' grant" in err["error"]["message"] and "--admin-key" in err["error"]["message"]
            for key in ("flag-admin", "file-admin"):
                status, err, _ = await _post(client, path, body, {"x-api-key": key})
                assert status not in (401, 403), (path, key, err)   # the route's own answer
        assert (await client.post("/admin/suspend")).status_code == 401   # no key: still a 401 first
    _run(app, script)


def test_key_file_scopes_default_to_inference_and_admin_is_explicit(tmp_path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("k1\nk2 admin\nk3 priority pins\nk4 inference\n")
    grants = ServerConfig(api_key=["f"], admin_key=["a"], api_key_file=str(keys)).api_key_grants()
    assert grants == {"f": {"inference"}, "a": {"inference", "admin"}, "k1": {"inference"},
                      "k2": {"inference", "admin"}, "k3": {"inference", "priority", "pins"}, "k4": {"inference"}}
    keys.write_text("k1 root\n")
    with pytest.raises(ValueError, match="unknown grant 'root'"):
        ServerConfig(api_key_file=str(keys)).api_key_grants()


def test_without_keys_admin_answers_loopback_clients_unless_admin_open(tokenizer) -> None:
    async def script(client: Any) -> list[int]:
        codes = []
        for scope in (REMOTE, {"client": ("127.0.0.1", 1)}, {"client": ("::ffff:127.0.0.1", 1)}):
            codes.append((await _post(client, "/admin/resume", None, scope=scope))[0])
        return codes
    assert _run(create_app(_engine(tokenizer), ServerConfig()), script) == [403, 409, 409]
    assert _run(create_app(_engine(tokenizer), ServerConfig(admin_open=True)), script) == [409, 409, 409]


# --------------------------------------------------------------------------------------------- LoRA paths
class LoraEngine(FakeEngine):
    """FakeEngine with LoRA slots: a load records the path it was handed; a directory without an
    adapter_config.json fails with the message shape of model/formats/peft.py (the path first)."""

    capabilities = Capabilities(suspend=True, lora=True)

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.state = "ready"
        self.adapters: list[dict[str, Any]] = []

    async def load_lora(self, name: str, path: str) -> dict[str, Any]:
        if not (Path(path) / "adapter_config.json").is_file():
            raise InvalidRequestError(f"{path}: adapter_config.json missing ([Errno 2] No such file or "
                                      f"directory: '{path}/adapter_config.json')", code="lora_load_failed",
                                      param="path")
        adapter = {"name": name, "id": len(self.adapters) + 1, "path": path}
        self.adapters.append(adapter)
        return adapter

    def lora_adapters(self) -> list[dict[str, Any]]:
        return list(self.adapters)


def _adapter(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text("{}")
    return path


def test_lora_load_reads_only_inside_lora_dir_and_never_shows_host_paths(tokenizer, tmp_path) -> None:
    root = tmp_path / "loras"
    _adapter(root / "good")
    (root / "empty").mkdir()
    outside = _adapter(tmp_path / "secret")
    os.symlink(outside, root / "escape")
    engine = LoraEngine(tokenizer)

    async def script(client: Any) -> None:
        status, body, _ = await _post(client, "/admin/lora/load", {"path": "good"})
        assert status == 200 and body["path"] == "good" and body["loaded"] is True
        assert engine.adapters[-1]["path"] == str((root / "good").resolve())
        for bad in (str(outside), "../secret", "escape", "good/../../secret", ".", "/etc"):
            status, body, _ = await _post(client, "/admin/lora/load", {"name": "x", "path": bad})
            assert (status, body["error"]["param"]) == (400, "path"), (bad, body)
            assert "--lora-dir" in body["error"]["message"] and str(tmp_path) not in body["error"]["message"]
        status, body, _ = await _post(client, "/admin/lora/load", {"name": "x", "path": "nowhere"})
        assert (status, body["error"]["code"]) == (400, "lora_load_failed")
        assert body["error"]["message"] == "adapter 'nowhere' not found under --lora-dir"
        status, body, _ = await _post(client, "/admin/lora/load", {"name": "x", "path": "empty"})
        assert (status, body["error"]["code"]) == (400, "lora_load_failed")
        assert str(tmp_path) not in body["error"]["message"] and "adapter 'empty'" in body["error"]["message"]
        models = (await (await client.get("/v1/models")).get_json())["data"]
        assert [m["id"] for m in models] == ["fake-model", "good"]
        assert str(tmp_path) not in str(models)   # adapters by name only
    _run(create_app(engine, ServerConfig(lora_dir=str(root))), script)


def test_without_lora_dir_only_start_up_adapters_load_by_path(tokenizer, tmp_path) -> None:
    from imp_jax.runtime.config import EngineConfig

    startup = _adapter(tmp_path / "startup")
    other = _adapter(tmp_path / "other")
    engine = LoraEngine(tokenizer)
    config = ServerConfig(engine=EngineConfig(model="m", lora=[f"s={startup}"]))

    async def script(client: Any) -> None:
        assert (await _post(client, "/admin/lora/load", {"name": "s2", "path": str(startup)}))[0] == 200
        status, body, _ = await _post(client, "/admin/lora/load", {"name": "o", "path": str(other)})
        assert (status, body["error"]["param"]) == (400, "path") and "--lora-dir" in body["error"]["message"]
        assert "--lora" in body["error"]["message"] and str(tmp_path) not in body["error"]["message"]
    _run(create_app(engine, config), script)


# --------------------------------------------------------------------------------------------- swaps
def _models_app(tokenizer: Any, tmp_path: Path, min_residency_s: float = 0.0, load_delay: float = 0.0,
                **config: Any) -> tuple[Any, list[str]]:
    """An app serving a.gguf of a directory of a, b and c, and the names its engine factory loaded."""
    directory = tmp_path / "models"
    directory.mkdir(exist_ok=True)
    for name in ("a.gguf", "b.gguf", "c.gguf"):
        (directory / name).write_bytes(b"GGUF" + b"\0" * 64)
    loaded: list[str] = []

    def make_engine(path: Path) -> FakeEngine:
        loaded.append(path.name)
        return FakeEngine(tokenizer, served_name=path.name, load_delay=load_delay)

    app = create_app(_engine(tokenizer, "a.gguf"), ServerConfig(models_dir=str(directory), **config))
    state_of(app).models = ModelDirectory(directory, make_engine, 5.0, directory / "a.gguf",
                                          min_residency_s=min_residency_s)
    return app, loaded


def _ask(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": "hi", "max_tokens": 2}


def test_only_admin_callers_requests_swap_unless_swap_on_request(tokenizer, tmp_path) -> None:
    keyed = {"api_key": ["user"], "admin_key": ["root"]}
    app, loaded = _models_app(tokenizer, tmp_path, **keyed)

    async def script(client: Any) -> None:
        status, body, _ = await _post(client, "/v1/completions", _ask("b.gguf"), {"x-api-key": "user"})
        assert (status, body["error"]["code"], body["error"]["param"]) == (403, "not_granted", "model")
        assert "--swap-on-request" in body["error"]["message"]
        assert (await _post(client, "/v1/completions", _ask("a.gguf"), {"x-api-key": "user"}))[0] == 200
        assert (await _post(client, "/v1/completions", _ask("b.gguf"), {"x-api-key": "root"}))[0] == 200
    _run(app, script)
    assert loaded == ["b.gguf"]
    app, loaded = _models_app(tokenizer, tmp_path, swap_on_request=True, **keyed)

    async def anyone(client: Any) -> None:
        assert (await _post(client, "/v1/completions", _ask("b.gguf"), {"x-api-key": "user"}))[0] == 200
    _run(app, anyone)
    assert loaded == ["b.gguf"]
    app, loaded = _models_app(tokenizer, tmp_path)   # no keys: a remote client is no admin

    async def remote(client: Any) -> None:
        assert (await _post(client, "/v1/completions", _ask("b.gguf"), scope=REMOTE))[0] == 403
        assert (await _post(client, "/v1/completions", _ask("b.gguf")))[0] == 200   # in-process: local
    _run(app, remote)


def test_a_swap_sooner_than_the_minimum_residency_is_a_503_with_retry_after(tokenizer, tmp_path) -> None:
    app, loaded = _models_app(tokenizer, tmp_path, min_residency_s=60.0)

    async def script(client: Any) -> None:
        status, body, headers = await _post(client, "/v1/completions", _ask("b.gguf"))
        assert (status, body["error"]["code"]) == (503, "swap_too_soon") and 55 <= int(headers["Retry-After"]) <= 60
        assert "--swap-min-seconds" in body["error"]["message"]
        status, body, _ = await _post(client, "/admin/models/load", {"model": "b.gguf"})   # the operator's call
        assert status == 200 and body == {"model": "b.gguf", "loaded": True}
        assert (await _post(client, "/v1/completions", _ask("a.gguf")))[0] == 503   # b serves its minimum now
    _run(app, script)
    assert loaded == ["b.gguf"]


def test_a_request_for_a_third_model_while_a_swap_is_pending_is_refused_at_once(tokenizer, tmp_path) -> None:
    app, loaded = _models_app(tokenizer, tmp_path, load_delay=0.5)

    async def script(client: Any) -> list[tuple[int, str | None]]:
        swap = asyncio.create_task(_post(client, "/v1/completions", _ask("b.gguf")))
        while state_of(app).models.swapping_to is None:
            await asyncio.sleep(0.005)
        same = asyncio.create_task(_post(client, "/v1/completions", _ask("b.gguf")))   # joins the pending swap
        answers = []
        for model in ("c.gguf", "a.gguf"):
            status, body, _ = await asyncio.wait_for(_post(client, "/v1/completions", _ask(model)), 0.3)
            answers.append((status, body["error"]["code"]))
        status, body, _ = await _post(client, "/admin/models/load", {"model": "c.gguf"})
        answers.append((status, body["error"]["code"]))
        answers += [((await t)[0], None) for t in (swap, same)]
        return answers
    assert _run(app, script) == [(503, "swapping")] * 3 + [(200, None)] * 2
    assert loaded == ["b.gguf"]


# --------------------------------------------------------------------------------------------- small items
def test_health_shows_counters_to_key_holders_only(tokenizer) -> None:
    async def script(client: Any) -> tuple[dict, dict]:
        anonymous = await (await client.get("/health")).get_json()
        return anonymous, await (await client.get("/health", headers={"x-api-key": "k"})).get_json()
    anonymous, keyed = _run(create_app(_engine(tokenizer), ServerConfig(api_key=["k"])), script)
    assert anonymous == {"status": "ok", "state": "ready", "model_loaded": True, "queue_depth": 0,
                         "suspended": False, "idle_suspended": False}
    assert keyed["steps_failed_total"] == 0 and keyed["num_free_blocks"] == FakeEngine.POOL_BLOCKS
    open_server = _run(create_app(_engine(tokenizer), ServerConfig()), script)[0]
    assert open_server["num_free_blocks"] == FakeEngine.POOL_BLOCKS   # no keys: one tenant, all shown


def test_listening_beyond_loopback_without_keys_is_logged_once(tokenizer, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="imp_jax.server"):
        create_app(_engine(tokenizer), ServerConfig(host="0.0.0.0"))
        create_app(_engine(tokenizer), ServerConfig(host="0.0.0.0", api_key=["k"]))
        create_app(_engine(tokenizer), ServerConfig())
    lines = [r.getMessage() for r in caplog.records if "no API keys" in r.getMessage()]
    assert len(lines) == 1 and "0.0.0.0" in lines[0] and "any Host ('*')" in lines[0], lines
