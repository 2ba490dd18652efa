"""What `--gemm auto` picks (kernels_pallas/backends.py): on an x86-64 CPU, `cpu_q8` for a model whose
matrices stay GGML blocks (a quantised GGUF), `exact` for float weights, XLA on other devices; one log
line says which and why; `cpu` is still the exact kernel's name at the edge (EngineConfig)."""
from __future__ import annotations

import logging
import types

import jax
import jax.numpy as jnp
import pytest

from imp_jax.kernels_pallas import AttentionShape, Kernels, select_kernels
from imp_jax.kernels_pallas.cpu import gemm as cpu_gemm
from imp_jax.runtime.config import EngineConfig

needs_kernels = pytest.mark.skipif(not cpu_gemm.available(int8_activations=True), reason="CPU GEMM kernels not built")
CPU = jax.local_devices()[0]
F32 = AttentionShape(jnp.dtype(jnp.float32), jnp.dtype(jnp.float32), 9, 3, 64, 16)
BF16 = AttentionShape(jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.bfloat16), 9, 3, 64, 16)


def gemm_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "imp_jax.kernels" and r.getMessage().startswith("gemm: ")]


@needs_kernels
def test_auto_on_a_cpu_is_cpu_q8_for_kept_blocks_and_exact_for_float_weights(caplog):
    with caplog.at_level(logging.INFO, logger="imp_jax.kernels"):
        assert select_kernels(CPU, F32, ggml_blocks=True).gemm == "cpu_q8"
    assert gemm_lines(caplog) == [(logging.INFO, "gemm: cpu_q8 (auto: quantised GGUF matrices on an x86-64 CPU; "
                                                 "--gemm exact for bit-parity)")]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="imp_jax.kernels"):
        assert select_kernels(CPU, F32).gemm == "exact"
    [(level, line)] = gemm_lines(caplog)
    assert level == logging.INFO and line.startswith("gemm: exact (auto: float weights")
    # blocks dequantised at load, or a bfloat16 model (its matrices widened to bf16): no blocks to meet
    assert select_kernels(CPU, F32, ggml_blocks=True, quantized="dequantize").gemm == "exact"
    assert select_kernels(CPU, BF16, ggml_blocks=True).gemm == "exact"
    # named, a choice stands whatever the weights
    assert select_kernels(CPU, F32, ggml_blocks=True, gemm="exact").gemm == "exact"
    assert select_kernels(CPU, F32, gemm="cpu_q8").gemm == "cpu_q8"
    assert select_kernels(CPU, F32, ggml_blocks=True, gemm="xla").gemm == "xla"


def test_auto_on_a_gpu_is_xla_whatever_the_weights():
    gpu = types.SimpleNamespace(platform="gpu", compute_capability="8.0", device_kind="A100")
    assert select_kernels(gpu, BF16, ggml_blocks=True) == Kernels(quantized="keep", dynamic_skips=False)
    assert select_kernels(gpu, BF16).gemm == "xla"


@needs_kernels
def test_auto_falls_back_to_exact_with_one_warning_when_the_q8_library_did_not_build(monkeypatch, caplog):
    monkeypatch.setattr(cpu_gemm, "available", lambda int8_activations=False: not int8_activations)
    with caplog.at_level(logging.INFO, logger="imp_jax.kernels"):
        assert select_kernels(CPU, F32, ggml_blocks=True).gemm == "exact"
    [(level, line)] = gemm_lines(caplog)
    assert level == logging.WARNING and "did not build" in line and line.startswith("gemm: exact (auto: ")
    with pytest.raises(ValueError, match="--gemm cpu_q8 needs"):
        select_kernels(CPU, F32, gemm="cpu_q8")


def test_cpu_is_the_old_name_of_exact():
    from imp_jax.server.cli import parse_config

    assert EngineConfig(gemm="cpu").gemm == "exact" and EngineConfig().gemm == "auto"
    assert parse_config(["--gemm", "cpu"], EngineConfig).engine.gemm == "exact"
    assert parse_config(["--gemm", "exact"], EngineConfig).engine.gemm == "exact"
    with pytest.raises(ValueError, match="'cpu': expected xla, exact or cpu_q8"):
        Kernels(gemm="cpu")   # inside, one name: a stale one is an error, never a silent XLA
    with pytest.raises(ValueError, match="--gemm 'cpu': expected one of auto, xla, exact, cpu_q8"):
        select_kernels(CPU, F32, gemm="cpu")   # below the edge the old name is not read


@needs_kernels
def test_load_model_picks_cpu_q8_for_a_quantised_gguf_and_exact_for_a_float_checkpoint(tmp_path, tiny_hf_dir):
    from support.gguf_models import write_gguf

    from imp_jax.model.formats.loader import load_model, open_checkpoint

    write_gguf(tmp_path / "q.gguf")   # Q8_0 / Q4_0 / Q4_1 matrices beside float ones
    assert open_checkpoint(tmp_path / "q.gguf").ggml_blocks and not open_checkpoint(tiny_hf_dir).ggml_blocks
    assert load_model(tmp_path / "q.gguf", dtype="float32").model.options.kernels.gemm == "cpu_q8"
    assert load_model(tmp_path / "q.gguf", dtype="float32", gemm="exact").model.options.kernels.gemm == "exact"
    assert load_model(tiny_hf_dir, dtype="float32").model.options.kernels.gemm == "exact"


@pytest.mark.parametrize("flag", ["--gemm", "--attention", "--quantized-weights"])
def test_an_unknown_kernel_name_is_refused_before_anything_starts(flag, tmp_path, capsys):
    from imp_jax.server.cli import parse_config

    with pytest.raises(SystemExit):   # argparse's one-line refusal, before the HTTP server or the engine
        parse_config([flag, "cpuq8"], EngineConfig)
    assert f"argument {flag}: invalid choice: 'cpuq8'" in capsys.readouterr().err
    cfg = tmp_path / "imp.toml"   # a config file's value is checked as well
    cfg.write_text(f'{flag[2:].replace("-", "_")} = "cpuq8"\n')
    with pytest.raises(SystemExit):
        parse_config(["--config", str(cfg)], EngineConfig)
    assert f"bad engine setting: {flag} 'cpuq8'" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"{flag} 'cpuq8': expected one of auto"):
        EngineConfig(**{flag[2:].replace("-", "_"): "cpuq8"})   # the offline API, LLM(gemm=...)
