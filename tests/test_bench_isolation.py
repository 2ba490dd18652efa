"""scripts/bench_isolation.py's --quick smoke run: every hostile kind runs beside the plain streams through
AsyncEngine, the JSON has a TPOT per arm, the regex client's requests end on their time budget, and
nothing compiles after warm-up."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_isolation_bench_runs_every_kind(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_isolation

    out = tmp_path / "iso.json"
    got = bench_isolation.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(got))
    arms = got["arms"]
    assert set(arms) == {"alone", *bench_isolation.KINDS}
    assert all(a["tpot_ms"] > 0 and a["vs_alone"] > 0 for a in arms.values())
    assert arms["regex"]["hostile_errors"] >= 1          # spent budgets end those requests
    assert arms["grammar"]["hostile_requests"] >= 2 and arms["grammar"]["hostile_errors"] == 0
    assert got["compilations_after_warmup"] == 0
