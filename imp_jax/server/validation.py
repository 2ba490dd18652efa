"""Request validation shared by every dialect: JSON bodies, pydantic models, model names, context room."""
from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from imp_jax.errors import InvalidRequestError, NotFoundError
from imp_jax.runtime.api import Engine
from imp_jax.server.errors import from_validation_error
from imp_jax.server.limits import field_limits

M = TypeVar("M", bound=BaseModel)
MAX_LORA_NAME = 128


class WireModel(BaseModel):
    """Base of every request model: unknown fields are kept (and ignored), types are checked strictly."""

    model_config = ConfigDict(extra="allow", strict=True)


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_value(value: Any) -> None:
    """400 unless arrays and objects nest at most FieldLimits.json_depth deep and every string is valid Unicode.

    JSON's \\u escapes can spell lone UTF-16 surrogates, which no text is made of: tokenizers and
    UTF-8 encoders fail on them, so they are refused here, naming the field. Iterative, so deep
    input cannot overflow the stack.
    """
    max_depth = field_limits().json_depth
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, dict):
            items = v.items()
        elif isinstance(v, list):
            items = enumerate(v)
        else:
            continue
        if depth > max_depth:
            raise InvalidRequestError(f"the request body nests arrays and objects more than {max_depth} deep "
                                      "(--max-json-depth)", code="invalid_json")
        for k, child in items:
            bad = isinstance(k, str) and _SURROGATE.search(k) or isinstance(child, str) and _SURROGATE.search(child)
            if bad or isinstance(child, (dict, list)):
                where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else k
                if bad:
                    where = _SURROGATE.sub("?", where)
                    raise InvalidRequestError(f"'{where}' holds a lone UTF-16 surrogate (a \\u escape in D800-DFFF "
                                              "without its pair), which is not valid Unicode",
                                              param=where, code="invalid_unicode")
                stack.append((child, depth + 1, where))


def parse_json(body: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 saying what is wrong with it."""
    if not body.strip():
        raise InvalidRequestError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        value = json.loads(body)
    except RecursionError:
        raise InvalidRequestError("the request body nests arrays and objects too deep for the JSON parser",
                                  code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequestError(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    check_json_value(value)
    if not isinstance(value, dict):
        raise InvalidRequestError("the request body must be a JSON object", code="invalid_json")
    return value


def parse_model(cls: type[M], data: dict[str, Any]) -> M:
    """Validate `data` against `cls`; a ValidationError becomes a 400 naming the field path."""
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


# Spec fields (docs/API.md) this server does not implement yet, with the values that ask for nothing
# (accepted); any other value is a 400 not_supported naming the field, never silently ignored.
NOT_YET: dict[str, tuple[Any, ...]] = {
    "xtc_probability": (None, 0, 0.0), "dynatemp_range": (None, 0, 0.0), "top_n_sigma": (None, -1, 0),
}

# Spec fields only /v1/chat/completions takes (its request model declares them, so they never reach
# model_extra there); on other routes any value but these neutral ones is a 400 not_supported.
CHAT_ONLY: dict[str, tuple[Any, ...]] = {
    "logit_lens": (None, False, 0),
    "cfg_scale": (None, 1, 1.0), "cfg_negative_prompt": (None,),   # classifier-free guidance
}


def refuse_not_yet(req: BaseModel) -> None:
    """400 not_supported for a spec field this server cannot honour yet (NOT_YET), or not on this route (CHAT_ONLY)."""
    for name, value in (req.model_extra or {}).items():
        neutral = NOT_YET.get(name)
        if neutral is not None and not any(_same(value, n) for n in neutral):
            off = f" (or send {json.dumps(neutral[1])})" if len(neutral) > 1 else ""
            raise InvalidRequestError(f"'{name}' is not supported by this server yet; leave it out{off}",
                                      code="not_supported", param=name)
        neutral = CHAT_ONLY.get(name)
        if neutral is not None and not any(_same(value, n) for n in neutral):
            raise InvalidRequestError(f"'{name}' is not supported on this route; only /v1/chat/completions "
                                      "takes it", code="not_supported", param=name)


def _same(value: Any, neutral: Any) -> bool:
    """JSON equality where true is not 1 and 0.0 is 0."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def check_model_name(requested: str, served_name: str) -> None:
    """404 model_not_found unless `requested` is the model this server serves."""
    if requested != served_name:
        raise NotFoundError(f"model '{requested}' is not served here; this server serves '{served_name}'",
                            code="model_not_found", param="model")


MAX_SPEC_DEPTH = 16   # the device chain cap the spec names for mtp_k when no head is armed
SPEC_KEYS = ("mtp_k", "ngram_k")


def speculative_of(req: BaseModel) -> tuple[bool | None, int | None, int | None]:
    """The body's `speculative` as (switch, ngram_k, mtp_k), checked. true / false switch drafting on or
    off for the request; the object form {"mtp_k": N, "ngram_k": M} (N, M in 0..16) leaves the switch to
    the server: mtp_k asks for an MTP head (none here: N > 0 is declined in usage), ngram_k sets the
    n-gram matcher's depth (0: off). Absent or null: (None, None, None), the server's --speculative."""
    value = (req.model_extra or {}).get("speculative")
    if value is None or isinstance(value, bool):
        return value, None, None
    if not isinstance(value, dict):
        raise InvalidRequestError("'speculative' must be true, false or an object such as {\"mtp_k\": 0}",
                                  param="speculative")
    depths: dict[str, int] = {}
    for key, depth in value.items():
        if key not in SPEC_KEYS:
            raise InvalidRequestError(f"'speculative.{key}' is not a field of 'speculative' (it takes "
                                      f"{' and '.join(SPEC_KEYS)})", param=f"speculative.{key}")
        if isinstance(depth, bool) or not isinstance(depth, int) or not 0 <= depth <= MAX_SPEC_DEPTH:
            raise InvalidRequestError(f"'speculative.{key}' must be an integer in 0..{MAX_SPEC_DEPTH}",
                                      param=f"speculative.{key}")
        depths[key] = depth
    return None, depths.get("ngram_k"), depths.get("mtp_k")


def lora_of(req: BaseModel) -> str | None:
    """The body's `lora` (the name of a loaded adapter), checked: a non-empty string, or null / absent."""
    value = (req.model_extra or {}).get("lora")
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_LORA_NAME:
        raise InvalidRequestError(f"'lora' must be the name of a loaded adapter (a string of 1 to {MAX_LORA_NAME} "
                                  "characters; GET /v1/models lists them)", param="lora")
    return value


def is_adapter(engine: Engine, name: str) -> bool:
    """Whether `name` is a LoRA adapter the engine has loaded (server/lora.py)."""
    return engine.capabilities.lora and any(a["name"] == name for a in engine.lora_adapters())


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """400 when a caller-given token id is outside the vocabulary."""
    for t in ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(f"token id {t} is outside the vocabulary [0, {vocab_size})", param=param)
