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


# ----------------------------------------------------------------------------- the parts inside a layer
# Inside runtime/ and model/ the subpackages are parts with an order: a module may import (at run time) its
# own part and the parts listed before it. Imports under `if TYPE_CHECKING:` are annotations only and are
# not counted (a feature's hook names the EngineCore it is handed without depending on it).
RUNTIME_PARTS: tuple[tuple[str, ...], ...] = (
    ("imp_jax.runtime.replies",),                                    # reply parsing over text, pure Python
    ("imp_jax.runtime.api", "imp_jax.runtime.request", "imp_jax.runtime.config", "imp_jax.runtime.defaults",
     "imp_jax.runtime.vectors"),                                     # the contract the server sees
    ("imp_jax.runtime.parallel",),                                   # mesh, sharding, multi-host broadcast
    ("imp_jax.runtime.kv",),                                         # the block pool and its tiers
    ("imp_jax.runtime.decoding",),                                   # the features' logic
    ("imp_jax.runtime.scheduling",),                                 # sequences, tables, the scheduler
    ("imp_jax.runtime.execution",),                                  # the compiled step and sampler
    ("imp_jax.runtime.features",),                                   # the features as plug-ins of the loop
    ("imp_jax.runtime.core",),                                       # the loop, its thread, start-up
)
MODEL_PARTS: tuple[tuple[str, ...], ...] = (
    ("imp_jax.model.base", "imp_jax.model.config", "imp_jax.model.family", "imp_jax.model.language_model_config",
     "imp_jax.model.layers", "imp_jax.model.lora", "imp_jax.model.projections", "imp_jax.model.registry",
     "imp_jax.model.tensor_parallel", "imp_jax.model.weights"),      # the contract a family is written against
    ("imp_jax.model.text",),                                         # tokenizer, templates, detokenizer
    ("imp_jax.model.architectures",),                                # the families: plain modules
    ("imp_jax.model.formats", "imp_jax.model.vision"),               # loading builds families (and images' side)
)
# module -> imports from a later part it may make, and why
PART_EXCEPTIONS: dict[str, tuple[str, ...]] = {
    # SamplingParams carries DRY's parameters and checks banned phrases with the logic's own limits
    "imp_jax.runtime.request": ("imp_jax.runtime.decoding.dry", "imp_jax.runtime.decoding.banned"),
    # features whose work is a program of their own build it from execution's parts: CFG's guided logits go
    # through the sampler's `cond`, the lens and prompt scoring run batches of the step (its batch builder,
    # CompiledStep), a vision family's images run its encoder program
    "imp_jax.runtime.decoding.cfg": ("imp_jax.runtime.execution.truncation",),
    "imp_jax.runtime.decoding.logit_lens": ("imp_jax.runtime.execution.batch",),
    "imp_jax.runtime.decoding.prompt_logprobs": ("imp_jax.runtime.execution.batch", "imp_jax.runtime.execution.step"),
    "imp_jax.runtime.decoding.image_family": ("imp_jax.runtime.execution.image_encoder",
                                              "imp_jax.runtime.execution.image_encoder_qwen"),
    # a process other than 0 runs the engine the leader drives: its main loop builds one (late import)
    "imp_jax.runtime.parallel.multihost": ("imp_jax.runtime.core.builder",),
    # the families' GGUF hooks read metadata values through the loader's small reader (model/family.py)
    "imp_jax.model.architectures": ("imp_jax.model.formats.gguf_metadata",),
}


def runtime_imports(path: Path) -> set[str]:
    """`project_imports` without the imports under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and
                   getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for stmt in node.body for n in ast.walk(stmt)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("imp_jax")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("imp_jax"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return found


def part_violations(root: Path = PACKAGE) -> list[str]:
    broken = []
    for parts in (RUNTIME_PARTS, MODEL_PARTS):
        rank = {prefix: i for i, names in enumerate(parts) for prefix in names}
        layer = parts[0][0].rsplit(".", 1)[0]
        part_of = lambda name: next((rank[p] for p in rank if covered(name, (p,))), None)  # noqa: E731
        for path in sorted((root / layer.split(".")[1]).rglob("*.py")):
            module = module_name(path, root)
            own = part_of(module)
            if own is None:
                continue
            allowed = tuple(p for p, i in rank.items() if i <= own)
            allowed += PART_EXCEPTIONS.get(module, ()) + next(
                (v for k, v in PART_EXCEPTIONS.items() if k != module and covered(module, (k,))), ())
            broken += [f"{module} imports {name}" for name in sorted(runtime_imports(path))
                       if covered(name, (layer,)) and part_of(name) is not None and not covered(name, allowed)]
    return broken


def test_every_module_imports_only_its_own_and_earlier_parts():
    assert not part_violations(), "\n".join(part_violations())


def test_every_part_is_listed():
    """A new subpackage of runtime/ or model/ (or module at their roots) must get a place in the parts."""
    for layer, parts in (("runtime", RUNTIME_PARTS), ("model", MODEL_PARTS)):
        listed = {p for names in parts for p in names}
        found = {module_name(p) for p in (PACKAGE / layer).glob("*/__init__.py")} | {
            module_name(p) for p in (PACKAGE / layer).glob("*.py") if p.name != "__init__.py"}
        assert found <= listed, found - listed


def test_the_part_checker_counts_run_time_imports_only(tmp_path):
    kv = tmp_path / "imp_jax" / "runtime" / "kv"
    kv.mkdir(parents=True)
    (kv / "ok.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from imp_jax.runtime.core.engine import EngineCore\n")
    (kv / "bad.py").write_text("def f():\n    from imp_jax.runtime.execution.step import CompiledStep\n")
    (tmp_path / "imp_jax" / "model").mkdir()
    assert part_violations(tmp_path / "imp_jax") == [
        "imp_jax.runtime.kv.bad imports imp_jax.runtime.execution.step",
        "imp_jax.runtime.kv.bad imports imp_jax.runtime.execution.step.CompiledStep"]
