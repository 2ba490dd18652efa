"""scripts/peers_table.py on a fake scripts/bench_peers.sh run: the median and the spread (min-max) of each
server's throughput per concurrency level across rounds, the ratio of the medians, one row per level and
--gemm mode; a run from before rounds existed (no `.rN`) reads as one round. And bench_peers.sh parses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def serving(tok_s: float, load: float = 1.0, failed: int = 0) -> dict:
    return {"env": {"loadavg_start": [load, 0.0, 0.0]},
            "levels": [{"requests": 8, "output_tok_per_s": tok_s, "ttft_p50_ms": 100.0, "tpot_p50_ms": 10.0,
                        "e2e_p50_ms": 1500.0, "failed": failed}]}


def write(out: Path, name: str, data: dict) -> None:
    (out / name).write_text(json.dumps(data))


def table(out: Path) -> list[str]:
    sys.path.insert(0, str(ROOT / "scripts"))
    import peers_table

    assert peers_table.main(str(out)) == 0
    return (out / "table.md").read_text().splitlines()


def test_rounds_give_medians_spreads_and_the_ratio_of_medians(tmp_path: Path) -> None:
    write(tmp_path, "run.json", {"rounds": 3, "model": "/m/SmolLM2.Q4_K_M.gguf", "llama_isa": "avx512-vnni"})
    for r, (llama, imp, q8) in enumerate([(100.0, 50.0, 90.0), (80.0, 70.0, 95.0), (120.0, 60.0, 10.0)], 1):
        write(tmp_path, f"serving_llama.c1.r{r}.json", serving(llama, load=r))
        write(tmp_path, f"serving_imp.c1.r{r}.json", serving(imp, failed=r == 2))
        write(tmp_path, f"serving_imp_cpu_q8.c1.r{r}.json", serving(q8))
        write(tmp_path, f"ready_llama_warm.r{r}.json", {"ready_s": float(r)})
        write(tmp_path, f"ready_imp_warm.r{r}.json", {"ready_s": 10.0 * r})
    write(tmp_path, "serving_llama.c8.r1.json", serving(300.0))
    write(tmp_path, "serving_imp.c8.r1.json", serving(150.0))
    lines = table(tmp_path)
    assert "3 round(s)" in lines[0] and "SmolLM2.Q4_K_M.gguf" in lines[0] and "avx512-vnni" in lines[0]
    rows = [line for line in lines if line.startswith("| 1 |")]
    assert len(rows) == 2   # the default mode and --gemm cpu_q8
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[2:6] == ["3 / 3", "100.0 (80.0-120.0)", "60.0 (50.0-70.0)", "**0.60x**"]
    assert cells[9:11] == ["0 / 1", "2.0 / 1.0"]   # failures summed, load averages' medians
    q8 = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert q8[4:6] == ["90.0 (10.0-95.0)", "**0.90x**"]   # one bad round widens the spread, not the median
    [c8] = [line for line in lines if line.startswith("| 8 |")]
    assert "| 300.0 | 150.0 | **0.50x** |" in c8   # one round: the value alone
    assert "| llama-server | - s | 2.0 s |" in lines and "| imp_jax | - s | 20.0 s |" in lines


def test_a_run_without_rounds_reads_as_one_round(tmp_path: Path) -> None:
    write(tmp_path, "serving_llama.c1.json", serving(100.0))
    write(tmp_path, "serving_imp.c1.json", serving(40.0))
    write(tmp_path, "ready_imp_warm.json", {"ready_s": 5.0})
    lines = table(tmp_path)
    [row] = [line for line in lines if line.startswith("| 1 |")]
    assert "| 1 / 1 | 100.0 | 40.0 | **0.40x** |" in row
    assert "| imp_jax | - s | 5.0 s |" in lines


def test_bench_peers_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / "bench_peers.sh")]).returncode == 0


def test_batch_one_rows_are_medians_of_rounds_on_the_wall_clock(tmp_path: Path) -> None:
    """llama-bench and bench_engine.py run in turn per round: each batch-1 cell is a median over the rounds, and
    imp_jax's tg128 is 1 / its decode steps' wall clock (an older run's imp_engine.json, which timed the device
    alone, is not read)."""
    def llama_bench(pp: float, tg0: float, tg512: float) -> list[dict]:
        return [{"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": pp},
                {"n_prompt": 0, "n_gen": 128, "n_depth": 0, "avg_ts": tg0},
                {"n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ts": tg512}]

    def engine(step_ms: float, step512_ms: float, ttft512_s: float) -> dict:
        return {"decode_step_ms": 1.0, "engine": [{"decode_step_s": step_ms / 1e3}],
                "long_context": {"decode_step_s": step512_ms / 1e3, "ttft_median_s": ttft512_s}}

    write(tmp_path, "serving_llama.c1.r1.json", serving(100.0))
    write(tmp_path, "serving_imp.c1.r1.json", serving(40.0))
    for r, (tg0, ms) in enumerate([(100.0, 10.0), (200.0, 8.0), (150.0, 5.0)], 1):
        write(tmp_path, f"llama_bench.r{r}.json", llama_bench(500.0 * r, tg0, tg0 / 2))
        write(tmp_path, f"imp_engine.r{r}.json", engine(ms, 2 * ms, 0.5))
    write(tmp_path, "imp_engine.json", engine(1.0, 1.0, 0.1))   # ignored
    lines = table(tmp_path)
    [tg0] = [line for line in lines if line.startswith("| tg128 from an empty context |")]
    assert [c.strip() for c in tg0.split("|")[1:-1]] == ["tg128 from an empty context", "3 / 3",
                                                        "150.0 (100.0-200.0)", "125.0 (100.0-200.0)", "**0.83x**"]
    [tg512] = [line for line in lines if line.startswith("| tg128 after 512 tokens |")]
    assert "| 75.0 (50.0-100.0) | 62.5 (50.0-100.0) | **0.83x** |" in tg512
    [pp] = [line for line in lines if line.startswith("| pp512 (prompt) |")]
    assert "| 1000.0 (500.0-1500.0) | 1024.0 (1024.0-1024.0) | **1.02x** |" in pp
