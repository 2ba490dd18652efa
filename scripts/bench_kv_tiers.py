"""KV tiers on a multi-turn agent workload (issue 40, item 5): TTFT of returning sessions and their throughput with
the device pool only, + the host tier, + host and disk tiers, and in a fresh process with the disk tier warm.

    python scripts/bench_kv_tiers.py [--model smollm2-135m-instruct] [--out kv_tiers.json] [--quick]

Workload, scaled to a 2-core CPU (issue 40 names a 4k-token system prompt and 64 sessions on a GPU): a shared
system prompt (+ tools) of --system tokens, --sessions sessions whose first turn adds --history tokens of their
own (user turn and tool output) and --first-tokens generated, then each returns with --followup new tokens. The
device pool (--pool-blocks) holds the system prompt and a few sessions, far less than all of them. Phase 1 runs
the first turns, --concurrency at a time; phase 2 brings every session back, one at a time, and measures its TTFT
(submit to first token) and the phase's generated tokens per second. The restart case: the host+disk process
shuts down (its cached prefixes go to disk), a fresh process over the same --kv-disk-dir brings every session
back with another new turn. Token ids are random (greedy, ignore_eos),
so only lengths matter. References: `device hit` (the last session back at once with another new turn: its first turn is still in the
pool, so it prefills what a returning session prefills) and
`recompute` (device only: the session's own history is prefilled again; the system prompt stays cached).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

FULL = dict(system=1024, sessions=16, history=512, first_tokens=16, followup=64, second_tokens=8,
            pool_blocks=144, host_gib=1.0, small_host_gib=0.0625, concurrency=4, max_model_len=2048, batch=256)
QUICK = dict(system=48, sessions=4, history=32, first_tokens=4, followup=8, second_tokens=2,
             pool_blocks=10, host_gib=None, small_host_gib=None, concurrency=2, max_model_len=256, batch=64)


def build(args, kv_host_gib: float, disk_dir: str | None):
    from imp_jax.runtime.core.builder import build_engine
    from imp_jax.runtime.config import EngineConfig

    config = EngineConfig(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.concurrency,
                          max_num_batched_tokens=args.batch, num_kv_blocks=args.pool_blocks, kv_host_gib=kv_host_gib,
                          kv_disk_dir=disk_dir, speculative="off", seed=0)
    return build_engine(config)


def sessions(args, vocab: int) -> tuple[list[int], list[list[int]], list[list[int]]]:
    rng = np.random.default_rng(0)
    ids = lambda n: [int(t) for t in rng.integers(4, vocab, n)]   # noqa: E731
    system = ids(args.system)
    return system, [ids(args.history) for _ in range(args.sessions)], [ids(args.followup) for _ in range(args.sessions)]


def drive(core, prompts: list[list[int]], max_tokens: int, concurrency: int) -> tuple[list[dict], float]:
    """Run the prompts, `concurrency` at a time: per prompt its TTFT (s), output ids and cached tokens; and the wall."""
    from imp_jax.runtime.request import GenerationRequest, SamplingParams

    results: list[dict] = [{} for _ in prompts]
    todo, live = list(enumerate(prompts)), {}
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            i, prompt = todo.pop(0)
            rid = f"bench-{id(results)}-{i}"
            r = results[i]
            r.update(start=time.perf_counter(), tokens=[])

            def emit(ev, r=r):
                if ev.token_ids and "ttft" not in r:
                    r["ttft"] = time.perf_counter() - r["start"]
                r["tokens"] += list(ev.token_ids)
                if ev.usage is not None:
                    r["cached"] = ev.usage.cached_tokens
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            core.add_request(GenerationRequest(rid, list(prompt), params), emit)
            live[rid] = i
        core.step()
        for rid in [rid for rid in live if rid not in core.requests]:
            del live[rid]
    return results, time.perf_counter() - t0


def returning(core, args, prompts: list[list[int]]) -> dict:
    """Phase 2: every session back, one at a time."""
    res, wall = drive(core, prompts, args.second_tokens, 1)
    ttfts = [r["ttft"] for r in res]
    return dict(ttft_ms_p50=1000 * statistics.median(ttfts), ttft_ms_mean=1000 * statistics.fmean(ttfts),
                tokens_per_s=sum(len(r["tokens"]) for r in res) / wall,
                cached_tokens_mean=statistics.fmean(r["cached"] for r in res),
                prompt_tokens_mean=statistics.fmean(len(p) for p in prompts))


def tier_stats(core) -> dict:
    s = core.stats()
    keys = ("kv_lower_tier_hits_total", "kv_host_spills_total", "kv_disk_hits", "kv_disk_writes", "kv_disk_files",
            "kv_evicted_tokens_total", "compilations_after_warmup")
    return {k: s[k] for k in keys}


def run_config(args, name: str, host_gib: float, disk_dir: str | None) -> tuple[dict, dict]:
    core = build(args, host_gib, disk_dir)
    system, history, followup = sessions(args, core.loaded.config.vocab_size)
    first, wall1 = drive(core, [system + h for h in history], args.first_tokens, args.concurrency)
    state = {"first_turns": [system + h + r["tokens"] for h, r in zip(history, first)]}
    back = [p + f for p, f in zip(state["first_turns"], followup)]
    out = returning(core, args, back)
    out["first_turn_tokens_per_s"] = sum(len(r["tokens"]) for r in first) / wall1
    if name == "device":   # the reference: the last session back again at once with another new turn, its
        rng = np.random.default_rng(2)   # first turn still in the pool: the same prefill as a returning session
        fresh = state["first_turns"][-1] + [int(t) for t in rng.integers(4, core.loaded.config.vocab_size,
                                                                         args.followup)]
        hit, _ = drive(core, [fresh], 1, 1)
        out["device_hit_ttft_ms"], out["device_hit_cached_tokens"] = 1000 * hit[0]["ttft"], hit[0]["cached"]
    out.update(tier_stats(core))
    if core.tiers is not None:
        core.tiers.close(core.pool)   # as AsyncEngine.shutdown does: the prefixes go down to disk
    return out, state


def restart_child(args) -> None:
    """--restart-child: a fresh process over the warm disk directory brings every session back with a new turn (not
    the one the first process already served, so only the first turns can be cached) and prints its JSON."""
    state = json.loads(Path(args.state).read_text())
    core = build(args, args.small_host_gib, args.disk_dir)
    rng = np.random.default_rng(1)
    vocab = core.loaded.config.vocab_size
    out = returning(core, args, [p + [int(t) for t in rng.integers(4, vocab, args.followup)]
                                 for p in state["first_turns"]])
    out.update(tier_stats(core))
    core.tiers.close()
    print("RESULT " + json.dumps(out))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--quick", action="store_true", help="a smoke run of seconds (a tiny --model is best)")
    ap.add_argument("--out", type=Path)
    for k, v in FULL.items():
        ap.add_argument(f"--{k.replace('_', '-')}", type=type(v) if v is not None else float, default=None)
    ap.add_argument("--restart-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--state", help=argparse.SUPPRESS)
    ap.add_argument("--disk-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.quick:   # host tiers of a few blocks: the KV of a tiny model is small
        args.host_gib = args.host_gib or 64 / 1024
        args.small_host_gib = args.small_host_gib or 2 * 2 * 2 * 16 * 2 * 16 * 4 / (1 << 30)
    if args.restart_child:
        restart_child(args)
        return {}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="kv-tiers-bench-") as tmp:
        disk = os.path.join(tmp, "disk")
        os.makedirs(disk, mode=0o700)
        results["device"], _ = run_config(args, "device", 0, None)
        results["host"], _ = run_config(args, "host", args.host_gib, None)
        results["host+disk"], state = run_config(args, "host+disk", args.small_host_gib, disk)
        state_path = Path(tmp) / "state.json"
        state_path.write_text(json.dumps(state))
        child = [sys.executable, __file__, "--restart-child", "--state", str(state_path), "--disk-dir", disk,
                 *(argv if argv is not None else sys.argv[1:])]
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH"))))}
        done = subprocess.run(child, capture_output=True, text=True, env=env)
        if done.returncode:
            raise RuntimeError(f"the restart process failed:\n{done.stderr[-3000:]}")
        line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        results["restart (disk warm)"] = json.loads(line[len("RESULT "):])
    hit, recompute = results["device"]["device_hit_ttft_ms"], results["device"]["ttft_ms_p50"]
    restart = results["restart (disk warm)"]["ttft_ms_p50"]
    report = dict(workload={k: getattr(args, k) for k in preset}, model=args.model, configs=results,
                  goal=dict(device_hit_ttft_ms=hit, recompute_ttft_ms=recompute, restart_ttft_ms=restart,
                            restart_vs_device_hit=restart / hit, recompute_vs_restart=recompute / restart,
                            met=restart <= 2 * hit and recompute >= 3 * restart))
    print(f"{'config':<20} {'TTFT p50 ms':>12} {'TTFT mean ms':>13} {'cached/prompt':>15} {'tok/s':>7} "
          f"{'disk hits':>9}")
    for name, r in results.items():
        print(f"{name:<20} {r['ttft_ms_p50']:>12.1f} {r['ttft_ms_mean']:>13.1f} "
              f"{r['cached_tokens_mean']:>7.0f}/{r['prompt_tokens_mean']:<7.0f} {r['tokens_per_s']:>7.1f} "
              f"{r['kv_disk_hits']:>9}")
    g = report["goal"]
    print(f"device hit {hit:.1f} ms, recompute {recompute:.1f} ms, restart {restart:.1f} ms: restart/hit "
          f"{g['restart_vs_device_hit']:.2f}x (goal <= 2), recompute/restart {g['recompute_vs_restart']:.2f}x "
          f"(goal >= 3): {'met' if g['met'] else 'not met'}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
