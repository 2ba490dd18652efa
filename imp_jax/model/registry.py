"""Model registry: HF `architectures` names -> causal LM classes (and user classes by import path)."""
from __future__ import annotations

import importlib
from typing import Callable, TypeVar

from imp_jax.errors import ModelLoadError

T = TypeVar("T", bound=type)
_REGISTRY: dict[str, type] = {}


def register_model(*names: str) -> Callable[[T], T]:
    """Class decorator: serve configs whose `architectures[0]` is one of `names` with this class."""
    def deco(cls: T) -> T:
        for name in names:
            _REGISTRY[name] = cls
        return cls
    return deco


def supported_architectures() -> list[str]:
    _import_builtin_models()
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    """The registered class for an HF architecture name, or a ModelLoadError listing what is supported."""
    _import_builtin_models()
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ModelLoadError(f"unknown architecture '{architecture}' (supported: "
                             f"{', '.join(sorted(_REGISTRY))}; or pass --model-class "
                             f"package.module:Class)", code="unknown_architecture") from None


def import_model_class(spec: str) -> type:
    """Load a user model class from 'package.module:Class'."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelLoadError(f"--model-class {spec!r}: expected 'package.module:Class'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ModelLoadError(f"--model-class {spec!r}: {e}") from None


def _import_builtin_models() -> None:
    importlib.import_module("imp_jax.model.llama")  # registers the decoder family
