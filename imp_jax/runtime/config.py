"""EngineConfig: what to load and how big to make the batch, the KV pool and the context."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from imp_jax.model.config import ModelConfig


@dataclasses.dataclass
class EngineConfig:
    """Engine settings; the server's flags mirror these fields one to one (`--max-num-seqs` ...)."""

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"                        # auto | float32 | bfloat16
    model_class: str | None = None             # package.module:Class for a user model
    layer_loop: str | None = None              # scan | unroll (default per backend)
    max_model_len: int | None = None           # default: the model's max_position_embeddings
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None           # wins over kv_cache_memory
    kv_cache_memory: float | None = None       # GPU: fraction of free memory after weights; CPU: bytes
    compilation_cache_dir: str | None = None   # default: $IMP_JAX_HOME/jax_cache

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        return min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)

    def cache_dir(self) -> Path:
        home = Path(os.environ.get("IMP_JAX_HOME", Path.home() / ".cache" / "imp_jax"))
        return Path(self.compilation_cache_dir) if self.compilation_cache_dir else home / "jax_cache"


DEFAULT_CPU_KV_BYTES = 1 << 30   # 1 GiB
DEFAULT_GPU_KV_FRACTION = 0.9


def kv_bytes_per_block(model: ModelConfig, block_size: int, itemsize: int) -> int:
    """K and V bytes of one block across all layers."""
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * itemsize


def num_kv_blocks(config: EngineConfig, model: ModelConfig, itemsize: int, backend: str,
                  free_device_bytes: int | None) -> int:
    """Pool size from --num-kv-blocks, else --kv-cache-memory (fraction of free memory on GPU, bytes on CPU)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    per_block = kv_bytes_per_block(model, config.block_size, itemsize)
    mem = config.kv_cache_memory
    if backend == "cpu" or free_device_bytes is None:
        budget = int(mem) if mem and mem > 1 else DEFAULT_CPU_KV_BYTES
    else:
        frac = mem if mem and mem <= 1 else DEFAULT_GPU_KV_FRACTION
        budget = int(free_device_bytes * frac)
    return max(2, budget // per_block)
