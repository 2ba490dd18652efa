"""Building the C++ kernel libraries: a library's translation units compile at once and link into
one library whose hash is recorded and checked; background builds (`prebuild`) are joined, not
repeated; a default CPU engine builds only the libraries it loads."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from imp_jax.kernels_pallas.cpu.build import cpu_libraries
from imp_jax.kernels_pallas.cpu import build

# A stand-in compiler: `-c SRC -o OBJ` sleeps 1 s and writes the source's name (logging when it ran),
# `-shared OBJ... -o LIB` concatenates the objects; `--version` names it.
FAKE_CXX = """#!/bin/sh
log="$(dirname "$0")/calls.log"
case "$1" in --version) echo "fake-cxx 1"; exit 0;; esac
out=""; prev=""; objs=""; shared=0; src=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out="$a"
  case "$a" in -shared) shared=1;; *.o) objs="$objs $a";; *.cc) src="$a";; esac
  prev="$a"
done
if [ $shared = 1 ]; then echo "link $objs" >> "$log"; cat $objs > "$out"; exit 0; fi
echo "start $(basename "$src") $(date +%s.%N)" >> "$log"
sleep 1
basename "$src" > "$out"
echo "end $(basename "$src") $(date +%s.%N)" >> "$log"
"""


@pytest.fixture
def fake_cxx(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cxx = tmp_path / "bin" / "c++"
    cxx.parent.mkdir()
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setenv("IMP_JAX_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(build, "_libraries", {})
    monkeypatch.setattr(build, "_library_locks", {})
    return cxx


def calls(cxx: Path) -> list[list[str]]:
    log = cxx.parent / "calls.log"
    return [line.split() for line in log.read_text().splitlines()] if log.exists() else []


def test_a_library_of_two_units_compiles_them_at_once_and_records_its_hash(fake_cxx: Path) -> None:
    lib = build._build("gemm", str(fake_cxx))
    log = calls(fake_cxx)
    spans = {c[1]: float(c[2]) for c in log if c[0] == "start"}, {c[1]: float(c[2]) for c in log if c[0] == "end"}
    assert sorted(spans[0]) == ["gemm.cc", "gemm_k.cc"]
    assert max(spans[0].values()) < min(spans[1].values())   # the second started before the first ended
    links = [c for c in log if c[0] == "link"]
    assert len(links) == 1 and sorted(Path(o).name for o in links[0][1:]) == ["gemm.o", "gemm_k.o"]
    assert lib.read_text().split() == ["gemm.cc", "gemm_k.cc"] and build.verified(lib)
    assert build._build("gemm", str(fake_cxx)) == lib and len(calls(fake_cxx)) == len(log)   # built once
    lib.write_text("tampered")
    assert build._build("gemm", str(fake_cxx)) == lib and build.verified(lib)   # the hash check rebuilt it
    assert len(calls(fake_cxx)) == 2 * len(log)


def test_processes_that_build_at_once_compile_once(fake_cxx: Path, tmp_path: Path) -> None:
    """Two processes (two servers, two test workers) that ask for a library nobody built yet: one compiles
    it, the other waits for its build lock and loads the same file."""
    import subprocess
    import sys

    go = tmp_path / "go"
    code = ("import logging, sys, time, pathlib; from imp_jax.kernels_pallas.cpu import build\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "while not pathlib.Path(sys.argv[1]).exists(): time.sleep(0.01)\n"
            "print(build._build('attention', sys.argv[2]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(go), str(fake_cxx)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    time.sleep(3)   # both imported and polling
    go.touch()
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert outs[0][0] == outs[1][0]   # the same library
    assert [c[1] for c in calls(fake_cxx) if c[0] == "start"] == ["attention.cc"]
    assert sum("another process is building the attention kernel" in err for _, err in outs) == 1


def test_a_librarys_hash_covers_the_headers_it_includes_and_no_others() -> None:
    here = Path(build.__file__).parent
    names = {name: {p.name for p in build._with_headers([here / s for s in sources])}
             for name, sources in build.SOURCES.items()}
    assert names["attention"] == {"attention.cc", "simd.h"}
    assert names["gemm"] == {"gemm.cc", "gemm_k.cc", "gemm_exact.h", "simd.h"}
    assert {"gemm_q8.h", "gemm_q8_x16.h", "gemm_q8_k.h", "gemm_q8_gemv.h", "gemm_q8_iq.h"} < names["gemm_q8"]
    assert "gemm_exact.h" not in names["gemm_q8"]


def test_a_load_during_a_background_build_waits_for_it(fake_cxx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", str(fake_cxx))
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    threads = build.prebuild(["attention"])
    results: list[object] = []
    waiters = [threading.Thread(target=lambda: results.append(build.load("attention"))) for _ in range(2)]
    for t in waiters:
        t.start()
    for t in waiters + threads:
        t.join(30)
    assert [c[1] for c in calls(fake_cxx) if c[0] == "start"] == ["attention.cc"]   # one build, three callers
    assert results == [None, None]   # the stand-in library does not load: XLA is used (and logged)
    assert build.prebuild(["attention"]) == []   # settled: nothing more to start


def test_a_default_cpu_engine_builds_the_q8_library_but_not_the_lora_one() -> None:
    """`--gemm auto` runs a quantised GGUF on int8 activations, which the engine learns only from the model."""
    assert cpu_libraries("auto", "auto", lora=False) == ["attention", "gemm", "gemm_q8"]
    assert cpu_libraries("auto", "exact", lora=False) == ["attention", "gemm"]
    assert cpu_libraries("auto", "cpu_q8", lora=True) == ["attention", "gemm", "gemm_q8", "lora"]
    assert cpu_libraries("xla", "xla", lora=False) == []
    assert set(build.SOURCES) == {"attention", "gemm", "gemm_q8", "lora"}
    here = Path(build.__file__).parent
    assert all((here / s).is_file() for sources in build.SOURCES.values() for s in sources)


def test_start_early_builds_only_where_the_engine_will_run_on_this_cpu(monkeypatch) -> None:
    started: list[list[str]] = []
    monkeypatch.setattr(build, "prebuild", lambda names: started.append(names) or [])
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    build.start_early("auto", "auto", lora=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    build.start_early("auto", "auto", lora=True)
    build.start_early("xla", "xla", lora=False)
    assert started == [["attention", "gemm", "gemm_q8", "lora"], []]
    monkeypatch.setattr(build.platform, "machine", lambda: "aarch64")
    build.start_early("auto", "auto", lora=False)
    assert len(started) == 2


def test_include_dir_is_jaxs() -> None:
    import jax

    assert build.include_dir() == jax.ffi.include_dir()


def test_the_server_module_starts_the_builds_without_importing_jax() -> None:
    """The server starts the builds before its jax import (which then runs beside the compiler)."""
    import subprocess
    import sys

    code = ("import sys, imp_jax.server.__main__, imp_jax.runtime.core.early_start as e; "
            "e.cpu_kernels.include_dir(); print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_install_step_builds_the_default_libraries_and_never_breaks_the_install_chain(
        fake_cxx: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("CXX", str(fake_cxx))
    monkeypatch.setattr(build.platform, "machine", lambda: "x86_64")
    assert build.main([]) == 0   # the stand-in libraries do not load: reported, and the chain goes on
    out = capsys.readouterr().out
    assert sorted(c[1] for c in calls(fake_cxx) if c[0] == "start") == ["attention.cc", "gemm.cc", "gemm_k.cc",
                                                                         "gemm_q8.cc"]
    assert "attention: unavailable, the server uses XLA" in out and "0 of 3 ready" in out
    monkeypatch.setattr(build, "_libraries", {})
    assert build.main(["--strict", "--all"]) == 1
    assert "0 of 4 ready" in capsys.readouterr().out
