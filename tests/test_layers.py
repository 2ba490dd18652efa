"""The import rules of docs/ARCHITECTURE.md, checked on the source: every `import imp_jax...` in a
module (late imports inside functions included) must be one its layer may make."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "imp_jax"
BASE = ("imp_jax.errors", "imp_jax.paths", "imp_jax.cli_flags")   # small, dependency-free modules every layer may use

# layer -> the project modules (and their submodules) its modules may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "imp_jax.kernels_pallas": ("imp_jax.kernels_pallas", *BASE),
    "imp_jax.model": ("imp_jax.model", "imp_jax.kernels_pallas", *BASE),
    # reply parsing (stop strings, think blocks, harmony, tool calls): pure Python the server imports too, so it
    # imports nothing else of the runtime (listed before the runtime: a module's first matching layer rules)
    "imp_jax.runtime.replies": ("imp_jax.runtime.replies", *BASE),
    "imp_jax.runtime": ("imp_jax.runtime", "imp_jax.model", "imp_jax.kernels_pallas", *BASE),
    # the server speaks to the engine through the request/event contract and the engine's config only, and reads
    # replies with the engine's own reply parsers (runtime/replies: pure Python, no jax)
    "imp_jax.server": ("imp_jax.server", "imp_jax.runtime.request", "imp_jax.runtime.api", "imp_jax.runtime.config",
                       "imp_jax.runtime.replies", *BASE),
    "imp_jax.errors": (),
    "imp_jax.paths": (),
    "imp_jax.cli_flags": (),
}
# module -> extra imports it may make, and why
EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # the process entry point builds the engine, behind a late import (jax loads only there)
    # (multihost: jax.distributed must start before any other JAX use; processes != 0 serve no HTTP)
    # (early_start: the first start's kernel builds begin before that import, jax-free)
    "imp_jax.server.__main__": ("imp_jax.runtime.core.async_engine", "imp_jax.runtime.core.replicas",
                                "imp_jax.runtime.core.encoder_engine", "imp_jax.runtime.parallel.multihost",
                                "imp_jax.runtime.core.early_start"),
    # embedding vectors' truncation and normalisation (numpy, no jax): the encoder engine's output contract
    "imp_jax.server.embeddings": ("imp_jax.runtime.vectors",),
    # output constraints compile at parse time into the engine's own cache of grammars (llguidance, no jax)
    "imp_jax.server.structured": ("imp_jax.runtime.decoding.constraints",),
}


def module_name(path: Path, root: Path = PACKAGE) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_imports(path: Path) -> set[str]:
    """Every imp_jax module `path` imports, wherever in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("imp_jax")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("imp_jax"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return found


def covered(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def layer_of(module: str) -> str | None:
    return next((layer for layer in ALLOWED if covered(module, (layer,))), None)


def violations(root: Path = PACKAGE) -> list[str]:
    """'<module> imports <name>' for every import its layer may not make."""
    broken = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        layer = layer_of(module)
        if layer is None:      # entry points beside the layers: imp_jax.llm, convert, generate, fetch
            continue
        allowed = ALLOWED[layer] + EXCEPTIONS.get(module, ())
        broken += [f"{module} imports {name}" for name in sorted(project_imports(path)) if not covered(name, allowed)]
    return broken


def test_every_module_imports_only_what_its_layer_may():
    assert not violations(), "\n".join(violations())


def test_the_checker_finds_a_late_import_against_the_rules(tmp_path):
    model = tmp_path / "imp_jax" / "model"
    model.mkdir(parents=True)
    (model / "ok.py").write_text("from imp_jax.kernels_pallas import Kernels\n")
    (model / "bad.py").write_text("def g():\n    from imp_jax.runtime.core.engine import EngineCore\n")
    assert violations(tmp_path / "imp_jax") == ["imp_jax.model.bad imports imp_jax.runtime.core.engine",
                                                 "imp_jax.model.bad imports imp_jax.runtime.core.engine.EngineCore"]


def test_every_layer_is_listed():
    """A new subpackage of imp_jax must get a rule here (and a line in docs/ARCHITECTURE.md)."""
    packages = {module_name(p) for p in PACKAGE.glob("*/__init__.py")}
    assert packages <= set(ALLOWED), packages - set(ALLOWED)
