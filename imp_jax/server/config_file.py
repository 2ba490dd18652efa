"""`--config FILE.toml`: our flat keys (`max_num_seqs = 16`) and imp's sectioned format (`[server]`, `[runtime]`, ...).

A top-level table named after one of imp's sections holds imp's key names, each mapped to one of
our settings (IMP_KEYS, the table in docs/USAGE.md); our own names are accepted in the section
they belong to (server settings under `[server]`, engine settings under `[runtime]`). An imp key
we cannot honour (UNSUPPORTED, with the reason) and any unknown key or section are an error that
names every one of them: a setting is never silently dropped.
"""
from __future__ import annotations

import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

SECTIONS = ("server", "model", "runtime", "kv_cache", "speculative")


def _same(v: Any) -> Any:
    return v


def _ms_to_s(v: Any) -> Any:
    return v / 1000 if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _on_off(v: Any) -> Any:
    return ("on" if v else "off") if isinstance(v, bool) else v


def _only(value: Any, why: str) -> Callable[[Any], Any]:
    """A key honoured only at `value` (what we always do); any other value is an error saying `why`."""
    def check(v: Any) -> Any:
        if v != value:
            raise ValueError(why)
        return None   # nothing to set: it is how we run anyway
    return check


# (section, imp key) -> (our setting, conversion); a conversion returning None sets nothing
IMP_KEYS: dict[tuple[str, str], tuple[str, Callable[[Any], Any]]] = {
    ("server", "host"): ("host", _same),
    ("server", "port"): ("port", _same),
    ("server", "api_key"): ("api_key", _same),
    ("server", "otlp_endpoint"): ("otlp_endpoint", _same),
    ("server", "otlp_service_name"): ("otlp_service_name", _same),
    ("server", "otlp_protocol"): ("otlp_protocol", _same),
    ("server", "session_ttl_s"): ("session_ttl_s", _same),
    ("server", "idle_unload_seconds"): ("idle_unload_seconds", _same),
    ("server", "model_swap_drain_ms"): ("swap_timeout", _ms_to_s),
    ("server", "models_dir"): ("models_dir", _same),
    ("server", "request_timeout"): ("request_timeout", _same),
    ("server", "max_tokens"): ("max_tokens", _same),
    ("server", "max_queued_tokens"): ("max_queued_tokens", _same),
    ("server", "log_requests"): ("log_requests", _same),
    ("server", "rate_limit"): ("rate_limit", _same),
    ("model", "path"): ("model", _same),
    ("model", "dtype"): ("dtype", _same),
    ("runtime", "max_batch_size"): ("max_num_seqs", _same),
    ("runtime", "max_seq_len"): ("max_model_len", _same),
    ("runtime", "seed"): ("seed", _same),
    ("kv_cache", "block_size"): ("block_size", _same),
    ("kv_cache", "dtype"): ("kv_cache_dtype", _same),
    ("kv_cache", "num_blocks"): ("num_kv_blocks", _same),
    ("kv_cache", "growable"): ("kv_cache.growable", _only(False, "the KV pool is fixed-size, sized once at "
                                                             "start-up; only growable = false can be honoured")),
    ("speculative", "enabled"): ("speculative", _on_off),
    ("speculative", "max_draft"): ("speculative_max_draft", _same),
    ("speculative", "mtp_k"): ("speculative.mtp_k", _only(0, "there is no MTP head (the n-gram matcher is the "
                                                              "only drafter); only mtp_k = 0 can be honoured")),
}
# imp keys we know and cannot honour, with the reason the error gives
UNSUPPORTED: dict[tuple[str, str], str] = {
    ("server", "model_swap"): "swapping is on whenever --models-dir is set (server.models_dir)",
    ("runtime", "admission_decode_tokens"): "admission reserves what each running sequence needs to finish its "
                                            "prefill plus one block per decode; the reserve is not sized by a setting",
    ("runtime", "gdn_batched_decode"): "no hybrid (GDN/SSM) model is served",
}


def read_config(path: Path, server_keys: set[str], engine_keys: set[str]) -> dict[str, Any]:
    """Our settings from a TOML file, flat or sectioned (or both); keys may be spelled with '-' or '_'.
    Every unknown or unsupported key is collected into one ValueError."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--config {path}: {e}") from None
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in raw.items():
        name = key.replace("-", "_")
        if isinstance(value, dict) and name in SECTIONS:
            _read_section(name, value, server_keys, engine_keys, out, problems)
        elif isinstance(value, dict):
            problems.append(f"unknown section [{key}] (imp's sections: {', '.join(SECTIONS)})")
        elif name in server_keys | engine_keys:
            out[name] = value
        else:
            problems.append(f"unknown key {key!r}")
    if problems:
        raise ValueError(f"--config {path}: " + "; ".join(problems) + " (docs/USAGE.md, Configuration file)")
    return out


def _read_section(section: str, table: dict[str, Any], server_keys: set[str], engine_keys: set[str],
                  out: dict[str, Any], problems: list[str]) -> None:
    own = server_keys if section == "server" else engine_keys if section == "runtime" else set()
    for key, value in table.items():
        name = key.replace("-", "_")
        where = f"{section}.{key}"
        if (section, name) in UNSUPPORTED:
            problems.append(f"{where} is not supported: {UNSUPPORTED[section, name]}")
        elif (section, name) in IMP_KEYS:
            ours, convert = IMP_KEYS[section, name]
            try:
                converted = convert(value)
            except ValueError as e:
                problems.append(f"{where} = {value!r} is not supported: {e}")
                continue
            if converted is None:
                continue
            if ours not in server_keys | engine_keys:
                problems.append(f"unknown key {where!r}")
            else:
                out[ours] = converted
        elif name in own:
            out[name] = value
        else:
            problems.append(f"unknown key {where!r}")
