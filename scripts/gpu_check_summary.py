"""The one summary block of scripts/gpu_check.sh: pass/fail per part and its key numbers, read from
the parts' JSON files; also written as summary.json.

    python scripts/gpu_check_summary.py OUT_DIR STATUS_FILE MODEL_LABEL DEVICE_LABEL
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PARTS = ("install", "model", "kernel", "attention", "engine", "server")


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kernel_numbers(d: dict) -> str:
    rows = d["rows"]
    ok = sum(r["ok"] for r in rows)
    errs = [r["max_abs_err"] for r in rows if "max_abs_err" in r]
    split = [r for r in rows if r["kv_splits"] > 1]
    text = f"{ok}/{len(rows)} variants within tolerance ({len(split)} with splits > 1)"
    text += f"; max err {max(errs):.1e}" if errs else ""
    big = {r["kv_splits"]: r.get("call_ms") for r in rows if r["case"] == "gpu_decode_32k"}
    if big.get(1) and len(big) > 1:
        n = max(big)
        text += f"; 32k decode one call: splits {n} {big[n]:.3f} ms, 1 split {big[1]:.3f} ms"
    return text


def attention_numbers(d: dict) -> str:
    rows = [r for r in d["results"] if "seconds" in r]
    errors = [r for r in d["results"] if "error" in r]
    by = {(r["mode"], r["batch"], r["context"], r["backend"]): r for r in rows}
    text = f"{len({(r['mode'], r['batch'], r['context']) for r in d['results']})} step sizes, {len(errors)} errors"
    for (mode, batch, context, backend), r in sorted(by.items()):
        one = by.get((mode, batch, context, "pallas_splits=1"))
        if backend == "pallas" and mode == "decode" and one and r.get("kv_splits", 1) > 1:
            text += (f"; decode b{batch} ctx{context}: splits {r['kv_splits']} {r['seconds'] * 1e3:.3f} ms vs "
                     f"1 split {one['seconds'] * 1e3:.3f} ms ({one['seconds'] / r['seconds']:.1f}x)")
    return text


def engine_numbers(d: dict) -> str:
    tok = ", ".join(f"b{e['batch']} {e['output_tok_s']:.0f} tok/s" for e in d["engine"])
    return (f"attention={d.get('attention_backend')} dtype={d.get('dtype')}; batch-1 decode step "
            f"{d['decode_step_ms']:.2f} ms; {tok}; startup {d['startup_s']:.0f} s; "
            f"compilations after warm-up {d.get('compilations_after_warmup')}")


def server_numbers(d: dict) -> str:
    if "error" in d:
        return d["error"]
    return (f"ready in {d['ready_s']:.0f} s; openai {d['openai_answer'][:40]!r}; "
            f"anthropic {d['anthropic_answer'][:40]!r}; exit {d['exit_code']}")


NUMBERS = {"kernel": kernel_numbers, "attention": attention_numbers, "engine": engine_numbers,
           "server": server_numbers}


def main() -> int:
    out, status_file, model, device = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    status: dict[str, dict] = {}
    for line in status_file.read_text().splitlines():
        name, rc, seconds, *note = line.split("\t")
        status[name] = dict(rc=int(rc), seconds=float(seconds), note=" ".join(note))
    kernel = load(out / "kernel.json")
    if kernel:
        device = f"{device}; jax {kernel['jax']} sees {kernel['device']}"
    lines, summary = [], dict(model=model, device=device, parts={})
    for name in PARTS:
        if name not in status:
            continue
        st = status[name]
        verdict = {0: "PASS", 124: "TIMEOUT", 137: "TIMEOUT", -1: "SKIP"}.get(st["rc"], "FAIL")
        data = load(out / f"{name}.json") if name in NUMBERS else None
        try:
            numbers = NUMBERS[name](data) if data else st["note"]
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            numbers = f"(numbers unreadable: {type(e).__name__} {e})"
        summary["parts"][name] = dict(verdict=verdict, seconds=st["seconds"], numbers=numbers)
        lines.append(f"{name:9s} {verdict:7s} {st['seconds']:5.0f} s  {numbers}")
    ran = [p["verdict"] for p in summary["parts"].values()]
    summary["overall"] = "PASS" if ran and all(v == "PASS" for v in ran) else "FAIL"
    print("=" * 30 + " GPU check summary " + "=" * 30)
    print(f"device {device}; model {model}")
    print("\n".join(lines))
    print(f"overall   {summary['overall']}")
    print("=" * 79)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary["overall"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
