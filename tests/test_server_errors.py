"""Error envelopes (OpenAI and Anthropic), field paths from pydantic, request ids, the CLI, no jax in server/."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from werkzeug.exceptions import MethodNotAllowed, NotFound

from imp_jax.errors import EngineError, ImpError, InvalidRequestError, NotFoundError, TemplateError
from imp_jax.server.app import sanitize_request_id
from imp_jax.server.chat_completions import ChatRequest
from imp_jax.server.cli import parse_config
from imp_jax.server.errors import (anthropic_error_body, error_body, loc_to_param, openai_error_body,
                                   to_imp_error)


def test_openai_envelope_has_message_type_param_code() -> None:
    body = openai_error_body(InvalidRequestError("'n' must be in [1, 4]", param="n"))
    assert body == {"error": {"message": "'n' must be in [1, 4]", "type": "invalid_request_error",
                              "param": "n", "code": "invalid_request_error"}}
    assert openai_error_body(NotFoundError("x", code="model_not_found"))["error"]["type"] == "not_found_error"
    assert openai_error_body(EngineError("boom"))["error"]["type"] == "server_error"


@pytest.mark.parametrize("err, kind", [
    (InvalidRequestError("bad"), "invalid_request_error"), (TemplateError("bad"), "invalid_request_error"),
    (NotFoundError("gone"), "not_found_error"), (ImpError("big", status=413), "request_too_large"),
    (ImpError("slow", status=429), "rate_limit_error"), (EngineError("boom"), "api_error"),
    (ImpError("busy", status=503, code="loading"), "overloaded_error"), (ImpError("teapot", status=418),
                                                                          "invalid_request_error"),
])
def test_anthropic_envelope_uses_anthropic_types(err: ImpError, kind: str) -> None:
    body = anthropic_error_body(err, request_id="req-1")
    assert body == {"type": "error", "error": {"type": kind, "message": err.message}, "request_id": "req-1"}


def test_envelope_is_chosen_by_path() -> None:
    err = InvalidRequestError("bad")
    assert error_body(err, "/v1/messages")["type"] == "error"
    assert error_body(err, "/v1/messages/count_tokens")["type"] == "error"
    assert "error" in error_body(err, "/v1/chat/completions") and "type" not in error_body(err, "/v1/chat")
    assert "type" not in error_body(err, "/v1/messagesx")


def test_validation_error_names_the_field_path() -> None:
    with pytest.raises(ValidationError) as info:
        ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"},
                                                               {"role": "robot", "content": "x"}]})
    err = to_imp_error(info.value)
    assert err.status == 400 and err.param == "messages[1].role" and "messages[1].role" in err.message


def test_loc_to_param() -> None:
    assert loc_to_param(("messages", 0, "content", 2, "type")) == "messages[0].content[2].type"
    assert loc_to_param(("logit_bias", "12")) == "logit_bias.12"


def test_http_exceptions_keep_their_status_and_unknown_errors_hide_details() -> None:
    assert to_imp_error(NotFound()).status == 404 and to_imp_error(NotFound()).code == "not_found"
    err = to_imp_error(MethodNotAllowed(valid_methods=["POST"]))
    assert err.status == 405 and "POST" in err.message
    hidden = to_imp_error(RuntimeError("secret detail"))
    assert hidden.status == 500 and "secret" not in hidden.message


@pytest.mark.parametrize("raw, clean", [
    ("abc-123", "abc-123"), ("a\x01b\x7fc", "abc"), ("é-id", "-id"), ("x" * 200, "x" * 128), ("\x01", None),
    (None, None), ("", None),
])
def test_request_id_is_printable_ascii_capped_at_128(raw: str | None, clean: str | None) -> None:
    assert sanitize_request_id(raw) == clean


@dataclasses.dataclass
class _EngineConfig:
    model: str = "default-model"
    max_num_seqs: int = 32
    kv_cache_memory: float | None = None


def test_cli_flags_win_over_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "imp.toml"
    cfg.write_text('model = "from-file"\nmax-num-seqs = 8\nport = 9000\nkv_cache_memory = 1e8\n')
    config = parse_config(["--config", str(cfg), "--max-num-seqs", "4", "--host", "0.0.0.0"], _EngineConfig)
    assert (config.host, config.port) == ("0.0.0.0", 9000)
    assert config.engine == _EngineConfig(model="from-file", max_num_seqs=4, kv_cache_memory=1e8)
    assert parse_config([], _EngineConfig).engine == _EngineConfig()
    assert (parse_config([], _EngineConfig).host, parse_config([], _EngineConfig).port) == ("127.0.0.1", 8080)


def test_cli_rejects_an_unknown_config_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "imp.toml"
    cfg.write_text("max_num_sequences = 8\n")
    with pytest.raises(SystemExit):
        parse_config(["--config", str(cfg)], _EngineConfig)
    assert "max_num_sequences" in capsys.readouterr().err


def test_cli_flags_mirror_the_real_engine_config() -> None:
    from imp_jax.runtime.config import EngineConfig
    config = parse_config(["--max-num-seqs", "3", "--dtype", "float32", "--num-kv-blocks", "7"], EngineConfig)
    assert (config.engine.max_num_seqs, config.engine.dtype, config.engine.num_kv_blocks) == (3, "float32", 7)
    assert config.engine.model == "qwen2.5-coder-0.5b-instruct"   # the server's default (docs/PERF.md)


def test_server_modules_do_not_import_jax() -> None:
    """DESIGN.md: server/ never imports jax (only __main__ reaches the engine, behind a late import)."""
    modules = sorted(p.stem for p in Path("imp_jax/server").glob("*.py") if p.stem != "__main__")
    code = ("import sys\n" + "".join(f"import imp_jax.server.{m}\n" for m in modules)
            + "import imp_jax.server.__main__\nassert 'jax' not in sys.modules, 'jax was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)
