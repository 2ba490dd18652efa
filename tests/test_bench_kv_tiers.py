"""scripts/bench_kv_tiers.py's --quick smoke run on the tiny model: every configuration runs (the restart one in a
fresh process over the first one's disk directory), the JSON matches what main returns, nothing compiles after
warm-up."""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_kv_tiers_bench_runs_every_configuration(_tiny_hf_template: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_kv_tiers

    out = tmp_path / "tiers.json"
    got = bench_kv_tiers.main(["--quick", "--model", str(_tiny_hf_template), "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(got))
    configs = got["configs"]
    assert set(configs) == {"device", "host", "host+disk", "restart (disk warm)"}
    assert all(c["ttft_ms_p50"] > 0 and c["compilations_after_warmup"] == 0 for c in configs.values())
    assert configs["restart (disk warm)"]["kv_disk_hits"] > 0 and configs["restart (disk warm)"]["cached_tokens_mean"] > 0
