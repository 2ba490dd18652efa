"""scripts/gpu_check.sh --cpu-dry-run: every part of the GPU check at tiny sizes on this CPU, so the
one prepared device run cannot rot between the sessions that get a GPU. As in CI: no .whl/ (the
install check is skipped), no .gpu_model/ (the dry run makes its own skeleton)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("install", "model", "kernel", "attention", "engine", "logits", "server")


def dry_run(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The dry run with $OUT at `out`, .whl/ hidden (CI has none); its exit and summary.json."""
    env = {**os.environ, "OUT": str(out)}
    env.pop("PYTHONPATH", None)   # the script puts the working tree first itself
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu-dry-run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def summary(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, dict]:
    if (ROOT / ".whl").exists():
        pytest.skip(".whl/ is here: this test runs the dry run as CI does, without it")
    return dry_run(tmp_path_factory.mktemp("gpu_check"))


def test_dry_run_passes_every_part(summary) -> None:
    proc, s = summary
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert s["overall"] == "PASS"
    assert [p for p in PARTS if p in s["parts"]] == list(PARTS)
    assert s["parts"]["install"]["verdict"] == "SKIP"
    assert all(s["parts"][p]["verdict"] == "PASS" for p in PARTS[1:])
    assert proc.stdout.count("GPU check summary") == 1


def test_dry_run_summary_has_every_number(summary) -> None:
    v = {name: part["values"] for name, part in summary[1]["parts"].items()}
    assert v["kernel"]["shapes"] >= 2 and v["kernel"]["variants_ok"] == v["kernel"]["variants"]
    assert v["kernel"]["other_mode"]   # the other lowering mode was tried (or said unavailable)
    assert v["attention"]["measured_gb_s"] > 0
    assert {"pallas", "xla_static", "jax_paged_attention"} <= set(v["attention"]["decode_gb_s"])
    engine = v["engine"]
    assert engine["load_s"] > 0 and engine["compile_s"] > 0 and engine["compile_s_per_program"]
    assert engine["device_memory_gib"] is None   # a CPU keeps no allocator stats: reported n/a
    assert len(engine["tok_s"]) == 2 and engine["long_context"]["tok_s"] > 0
    assert v["logits"]["max_abs_diff"] < 0.05 * v["logits"]["max_abs_logit"]
    assert v["server"]["exit_code"] == 0 and len(v["server"]["serving"]) == 2
    assert all(level["failed"] == 0 and level["output_tok_s"] > 0 for level in v["server"]["serving"].values())


def test_a_failing_part_fails_the_check(tmp_path: Path) -> None:
    if (ROOT / ".whl").exists():
        pytest.skip(".whl/ is here: this test runs the dry run as CI does, without it")
    proc, s = dry_run(tmp_path, "--parts", "kernel", "--fail", "kernel")
    assert proc.returncode != 0
    assert s["overall"] == "FAIL" and s["parts"]["kernel"]["verdict"] == "FAIL"
    assert "forced failure" in (tmp_path / "parts.log").read_text()
