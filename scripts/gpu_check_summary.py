"""The one summary block of scripts/gpu_check.sh: pass/fail per part and its key numbers, read from
the parts' JSON files; also written as summary.json (each part's line and its numbers as values).

    python scripts/gpu_check_summary.py OUT_DIR STATUS_FILE MODEL_LABEL DEVICE_LABEL
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PARTS = ("install", "model", "kernel", "attention", "engine", "logits", "server")
VERDICTS = {0: "PASS", 124: "TIMEOUT", 137: "TIMEOUT", -1: "NOT RUN", -2: "SKIP"}   # SKIP: by design, not a failure


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def kernel_numbers(d: dict) -> tuple[str, dict]:
    rows = d["rows"]
    ok = sum(r["ok"] for r in rows)
    errs = [r["max_abs_err"] for r in rows if "max_abs_err" in r]
    values = dict(shapes=len({r["case"] for r in rows}), variants=len(rows), variants_ok=ok,
                  max_abs_err=max(errs) if errs else None)
    text = (f"{values['shapes']} shapes, {ok}/{len(rows)} variants within tolerance "
            f"({sum(r['kv_splits'] > 1 for r in rows)} with splits > 1)")
    text += f"; max err {max(errs):.1e}" if errs else ""
    for r in rows:
        o = r.get("other_mode")
        if not r["ok"] and o:   # does pinning the other lowering mode fix it?
            text += (f"; FAIL {r['case']} splits {r['kv_splits']}: " + (o["note"] if o["mode"] is None else
                     f"under {o['mode']} {'passes' if o['ok'] else 'fails too'}"))
    values["other_mode"] = next((r["other_mode"].get("mode") or r["other_mode"]["note"]
                                 for r in rows if "other_mode" in r), "not needed")
    big = {r["kv_splits"]: r.get("call_ms") for r in rows if r["case"] == "gpu_decode_32k"}
    if big.get(1) and len(big) > 1:
        n = max(big)
        text += f"; 32k decode one call: splits {n} {big[n]:.3f} ms, 1 split {big[1]:.3f} ms"
    return text, values


def attention_numbers(d: dict) -> tuple[str, dict]:
    """Decode GB/s per backend (its best step size) against the bandwidth measured in the same run."""
    hbm = d["meta"]["measured_bandwidth"]
    decode = [r for r in d["results"] if "seconds" in r and r["mode"] == "decode"]
    best: dict[str, dict] = {}
    for r in decode:
        if r["bandwidth"] > best.get(r["backend"], {}).get("bandwidth", 0):
            best[r["backend"]] = r
    errors = [r for r in d["results"] if "error" in r]
    values = dict(measured_gb_s=hbm / 1e9, decode_gb_s={b: r["bandwidth"] / 1e9 for b, r in best.items()},
                  errors=len(errors))
    text = f"measured x + 1 {hbm / 1e9:.0f} GB/s; decode best: " + ", ".join(
        f"{b} {r['bandwidth'] / 1e9:.1f} GB/s ({100 * r['bandwidth'] / hbm:.0f}%, b{r['batch']} ctx{r['context']})"
        for b, r in sorted(best.items()))
    text += f"; {len(errors)} errors" + (f" ({errors[0]['backend']}: {errors[0]['error'][:80]})" if errors else "")
    return text, values


def engine_numbers(d: dict) -> tuple[str, dict]:
    per = d["compile_s_per_program"]
    mem = d.get("device_memory")
    long = d.get("long_context")
    values = dict(load_s=d["load_s"], compile_s=d["compile_s"], compile_s_per_program=per,
                  device_memory_gib={k: v / 2**30 for k, v in mem.items()} if mem else None,
                  tok_s={e["batch"]: e["output_tok_s"] for e in d["engine"]},
                  long_context=dict(context=long["context"], tok_s=long["output_tok_s"],
                                    decode_step_ms=1e3 * long["decode_step_s"]) if long else None)
    memory = (f"device memory {mem.get('peak_bytes_in_use', 0) / 2**30:.1f} GiB peak of "
              f"{mem.get('bytes_limit', 0) / 2**30:.1f}" if mem else "device memory n/a (no allocator stats)")
    text = (f"load {d['load_s']:.1f} s, compile {d['compile_s']:.1f} s ({len(per)} programs: "
            + ", ".join(f"{k} {v:.1f}" for k, v in per.items()) + f" s); {memory}; "
            + ", ".join(f"{e['batch']} streams {e['output_tok_s']:.0f} tok/s" for e in d["engine"]))
    if long:
        text += (f"; 1 stream at {long['context']} context {long['output_tok_s']:.0f} tok/s "
                 f"(decode step {1e3 * long['decode_step_s']:.2f} ms)")
    return text + f"; compilations after warm-up {d.get('compilations_after_warmup')}", values


def logits_numbers(d: dict) -> tuple[str, dict]:
    values = {k: d[k] for k in ("max_abs_diff", "max_abs_logit", "prefill_max_abs_diff", "decode_max_abs_diff",
                                "top1_agreement", "positions")}
    return (f"Pallas vs XLA attention, {d['positions']} positions: max |diff| {d['max_abs_diff']:.2e} "
            f"(prefill {d['prefill_max_abs_diff']:.2e}, decode {d['decode_max_abs_diff']:.2e}) of max |logit| "
            f"{d['max_abs_logit']:.2f}; top-1 agreement {100 * d['top1_agreement']:.0f}%"), values


def server_numbers(d: dict, serving: dict | None) -> tuple[str, dict]:
    if "error" in d:
        return d["error"], {}
    levels = serving["levels"] if serving else []
    values = dict(ready_s=d["ready_s"], exit_code=d["exit_code"],
                  serving={lv["concurrency"]: dict(output_tok_s=lv["output_tok_per_s"], ttft_p50_ms=lv["ttft_p50_ms"],
                                                   failed=lv["failed"]) for lv in levels})
    text = (f"ready in {d['ready_s']:.0f} s; openai {d['openai_answer'][:20]!r}; "
            f"anthropic {d['anthropic_answer'][:20]!r}; exit {d['exit_code']}")
    for lv in levels:
        text += (f"; bench_serving c={lv['concurrency']}: {lv['completed']}/{lv['requests']} ok, "
                 f"{lv['output_tok_per_s']:.0f} out tok/s, TTFT p50 {lv['ttft_p50_ms'] or 0:.0f} ms")
    return text, values


def numbers(name: str, out: Path) -> tuple[str, dict] | None:
    """The part's summary line and values from its JSON files; None when it wrote none."""
    data = load(out / f"{name}.json")
    if not data:
        return None
    if name == "server":
        return server_numbers(data, load(out / "serving.json"))
    return {"kernel": kernel_numbers, "attention": attention_numbers, "engine": engine_numbers,
            "logits": logits_numbers}[name](data)


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
        verdict = VERDICTS.get(st["rc"], "FAIL")
        try:
            text, values = (numbers(name, out) if name not in ("install", "model") else None) or (st["note"], {})
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            text, values = f"(numbers unreadable: {type(e).__name__} {e})", {}
        if verdict != "PASS" and text != st["note"]:
            text = f"{st['note']}; {text}"
        summary["parts"][name] = dict(verdict=verdict, seconds=st["seconds"], numbers=text, values=values)
        lines.append(f"{name:9s} {verdict:7s} {st['seconds']:5.0f} s  {text}")
    ran = [p["verdict"] for p in summary["parts"].values()]
    summary["overall"] = "PASS" if "PASS" in ran and all(v in ("PASS", "SKIP") for v in ran) else "FAIL"
    print("=" * 30 + " GPU check summary " + "=" * 30)
    print(f"device {device}; model {model}")
    print("\n".join(lines))
    print(f"overall   {summary['overall']}")
    print("=" * 79)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0 if summary["overall"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
