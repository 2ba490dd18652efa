"""Cold start, as a new user meets it: an empty $IMP_JAX_HOME (no model, no kernels, no JAX cache), the
README's install step (`python -m imp_jax.kernels_pallas.cpu.build`, timed on its own), then
`python -m imp_jax.server` until its first `GET /ready` 200. Prints one line per run and writes JSON.

    PYTHONPATH=. python scripts/bench_cold_start.py [--model ALIAS] [--runs 2] [--no-install-step]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from loopback import free_port


def ready_after(env: dict[str, str], model: str | None, timeout: float, log: Path) -> float:
    """Seconds from starting the server to its first /ready 200 (the server is stopped after)."""
    port = free_port()
    cmd = [sys.executable, "-m", "imp_jax.server", "--port", str(port)] + (["--model", model] if model else [])
    t0 = time.perf_counter()
    with open(log, "w") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while time.perf_counter() - t0 < timeout:
                if server.poll() is not None:
                    raise RuntimeError(f"the server exited with {server.returncode}: see {log}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                        if r.status == 200:
                            return time.perf_counter() - t0
                except OSError:
                    pass
                time.sleep(0.2)
            raise RuntimeError(f"not ready after {timeout:.0f} s: see {log}")
        finally:
            server.terminate()
            server.wait(30)


def one_run(args: argparse.Namespace, i: int) -> dict[str, float | None]:
    with tempfile.TemporaryDirectory(prefix="imp-cold-") as home:
        env = dict(os.environ, IMP_JAX_HOME=home)
        install = None
        if args.install_step:
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-m", "imp_jax.kernels_pallas.cpu.build"], env=env, check=True,
                           capture_output=True)
            install = time.perf_counter() - t0
        ready = ready_after(env, args.model, args.timeout, Path(args.log_dir) / f"cold_start_{i}.log")
    load = os.getloadavg()[0]
    print(f"run {i}: install step {'-' if install is None else f'{install:.1f} s'}, ready after {ready:.1f} s "
          f"(load average {load:.2f})", flush=True)
    return {"install_step_s": install, "ready_s": ready, "load_average": load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="alias or path (default: the server's default model)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--no-install-step", dest="install_step", action="store_false",
                        help="start the server with no kernels built (it compiles them itself)")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--log-dir", default="bench_results")
    parser.add_argument("--out", default="bench_results/cold_start.json")
    args = parser.parse_args()
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    runs = [one_run(args, i) for i in range(1, args.runs + 1)]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model": args.model or "default", "install_step": args.install_step,
                                          "runs": runs}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
