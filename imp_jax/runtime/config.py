"""EngineConfig: what to load and how big to make the batch, the KV pool and the context."""
from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from imp_jax.kernels_pallas.choices import ATTENTION_BACKENDS, GEMM_BACKENDS, QUANTIZED_CHOICES
from imp_jax.model.config import ModelConfig
from imp_jax.model.formats.hub import DEFAULT_MODEL
from imp_jax.paths import compilation_cache_dir
from imp_jax.runtime.request import SEED_RANGE

GEMM_ALIASES = {"cpu": "exact"}   # --gemm cpu named the exact C++ GEMM before cpu_q8 became a default


def _field(default, help: str, choices: tuple[str, ...] | None = None):
    """A flag's default and help; `choices` makes argparse refuse any other value in one line."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def overlaps_steps(async_scheduling: str) -> bool:
    """Whether `--async-scheduling` overlaps steps: `auto` does on every backend. On a CPU the host thread
    shares the cores with the step, and still the overlap wins at 1-32 rows there (PERF.md, "Asynchronous
    scheduling on a CPU too")."""
    return async_scheduling != "off"


@dataclasses.dataclass
class EngineConfig:
    """Engine settings; the server's flags mirror these fields one to one (`--max-num-seqs` ...)."""

    model: str = _field(DEFAULT_MODEL, "path (HF dir, .gguf, converted) or alias")
    mmproj: str | None = _field(None, "a llama.cpp vision projector GGUF (general.architecture clip) giving a "
                                "GGUF --model its image side, as llama-server's --mmproj: projector types "
                                "idefics3 (SmolVLM / Idefics3, with a llama text GGUF), qwen2.5vl_merger "
                                "(Qwen2.5-VL, with a qwen2vl text GGUF) and gemma3 (Gemma 3, with a gemma3 "
                                "text GGUF); anything else is refused at start-up")
    dtype: str = _field("auto", "auto | float32 | bfloat16; auto = bf16 on GPU, f32 on CPU")
    model_class: str | None = _field(None, "package.module:Class serving a user Flax NNX model")
    layer_loop: str | None = _field(None, "scan | unroll; default scan on CPU, unroll on GPU (docs/PERF.md)")
    attention: str = _field("auto", "attention kernel: auto | xla | cpu | pallas; auto = pallas on a Hopper "
                            "GPU, the C++ kernel on an x86-64 CPU, else xla", choices=ATTENTION_BACKENDS)
    gemm: str = _field("auto", "projection GEMM: auto | exact | cpu_q8 | xla (cpu: the old name of exact). exact: "
                       "the x86-64 C++ kernel, transformers' float32 products bit for bit; cpu_q8: the same kernel, but "
                       "GGUF matrices kept as blocks (every format: Q4_0-Q8_0, Q2_K-Q6_K, IQ4_x, MXFP4) meet "
                       "activations rounded to int8 (llama.cpp's arithmetic): 1.3-2x faster decode, outputs differ "
                       "slightly. auto = cpu_q8 for a quantised "
                       "GGUF kept as blocks on an x86-64 CPU, exact for float weights there, else xla (the start-up "
                       "log says which and why)", choices=(*GEMM_BACKENDS, *GEMM_ALIASES))
    quantized_weights: str = _field(
        "auto", "a GGUF's quantised matrices: auto | keep | dequantize. keep: stored as the file's blocks (the "
        "CPU GEMM kernel reads them; XLA dequantises each one inside the step, matrix by matrix); auto = keep "
        "where the CPU GEMM kernel runs, dequantize (at load) under --gemm xla on a CPU, and on a GPU dequantize "
        "to bf16 when the widened weights and the KV cache of two full-length contexts fit in free memory, "
        "else keep (the start-up log says which)", choices=QUANTIZED_CHOICES)
    max_model_len: int | None = _field(None, "context length; default the model's max_position_embeddings")
    max_num_seqs: int = _field(32, "sequences in one step at most")
    max_num_batched_tokens: int = _field(512, "tokens in one step at most (chunked prefill budget)")
    fair_tenants: bool = _field(True, "admit waiting sequences round-robin across tenants (API keys, else client "
                                "addresses) within a priority, so one tenant's burst cannot starve another's "
                                "request; --no-fair-tenants: by rank alone (docs/ARCHITECTURE.md)")
    block_size: int = _field(16, "tokens per KV block")
    num_kv_blocks: int | None = _field(None, "KV pool size in blocks; wins over --kv-cache-memory")
    kv_cache_memory: float | None = _field(
        None, "GPU: fraction of free device memory after weights (0.9); CPU: bytes (1 GiB)")
    kv_cache_dtype: str = _field(
        "auto", "auto | float32 | bfloat16; auto = the model's dtype (bfloat16 under --gemm cpu_q8). bfloat16 under "
        "a float32 model halves the KV bytes (twice the blocks, faster long-context decode) at bf16 precision for K/V")
    kv_host_gib: float | None = _field(
        None, "host KV tier in GiB per engine replica: preempted sequences swap their KV there and blocks evicted "
        "from the prefix cache spill there, a later hit copying them back (docs/ARCHITECTURE.md, KV tiers); "
        "default min(10%% of RAM, 4 GiB) on an accelerator, 0 (off) on a CPU, where the pool is host memory "
        "already (raise --kv-cache-memory instead); 0 turns it off")
    kv_swap_min_tokens: int | None = _field(
        None, "with a host tier, a preempted sequence with at least this many computed tokens swaps its KV to "
        "the host instead of recomputing it; default 16 on a CPU (one block: the measured break-even is below "
        "1 token), 64 on a GPU (an estimate): docs/ARCHITECTURE.md, KV tiers")
    kv_disk_dir: str | None = _field(
        None, "directory for a disk KV tier under the host tier: prefix blocks the host tier evicts are written "
        "to <dir>/<model fingerprint>/, read back (checked) on a later hit, and reused after a restart with the "
        "same model; owned by the server's user, not writable by others. On a CPU it turns on a host tier of "
        "min(10%% of RAM, 1 GiB) unless --kv-host-gib says otherwise (docs/ARCHITECTURE.md, KV tiers)")
    kv_disk_gib: float = _field(16.0, "the disk KV tier's size in GiB (split between data-parallel replicas, "
                                "each in its own subdirectory); least recently used blocks are removed first")
    tensor_parallel_size: int = _field(
        1, "devices one model is split over, of this host (with --num-processes: of all processes together); "
        "tensor parallelism: heads, MLP rows, vocabulary and the KV cache's kv heads; each holds ~1/N of the "
        "weights and KV cache (docs/DEPLOYMENT.md)")
    compilation_cache_dir: str | None = _field(None, "JAX compilation cache; default $IMP_JAX_HOME/jax_cache")
    session_ttl_s: float = _field(600.0, "seconds a session_id's pinned KV blocks wait for its next turn")
    idle_unload_seconds: float = _field(0.0, "park the weights and KV cache in host memory after this many "
                                        "seconds without a request (0 = never); the next request resumes them")
    lora: list[str] = dataclasses.field(default_factory=list, metadata={"help": (
        "NAME=PATH: a PEFT LoRA adapter directory loaded at start-up under NAME (repeatable)")})
    max_loras: int = _field(0, "LoRA adapter slots on the device (0 = no slabs, no LoRA cost; --lora alone "
                            "implies max(4, its count)); POST /admin/lora/load fills them at run time")
    max_lora_rank: int = _field(16, "the largest LoRA rank a slot holds (smaller ranks are zero-padded)")
    data_parallel_size: int = _field(1, "engine replicas, one per device, each with its own weights, KV pool "
                                     "and scheduler; requests are routed by prefix-cache affinity and load "
                                     "(docs/DEPLOYMENT.md). On CPU: XLA_FLAGS=--xla_force_host_platform_device_count")
    coordinator: str | None = _field(None, "HOST:PORT of process 0's jax.distributed coordinator: serve one "
                                     "tensor-parallel model across --num-processes hosts (docs/DEPLOYMENT.md)")
    coordinator_insecure_ok: bool = _field(False, "allow a --coordinator that is not a private or loopback "
                                           "address: the coordinator and the collectives are unauthenticated "
                                           "and carry every prompt's token ids in the clear (docs/SECURITY.md)")
    num_processes: int = _field(1, "processes (hosts) one model spans with --coordinator; "
                                "--tensor-parallel-size counts the devices of all of them")
    async_scheduling: str = dataclasses.field(default="auto", metadata={"choices": ("auto", "on", "off"), "help": (
        "on: launch step N+1 before reading step N's tokens, so the device never waits for the host in "
        "steady decode (grammar rows, think budgets, prompt_logprobs and multi-host fall back per step); "
        "off: schedule, launch, read, one step at a time; auto (the default): on, on every backend, a CPU "
        "included (docs/PERF.md)")})
    speculative: str = dataclasses.field(default="on", metadata={"choices": ("on", "off"), "help": (
        "on: decoding sequences draft tokens by n-gram lookup in their prompt and output and verify them "
        "in the same step (output unchanged; faster on text that repeats its input); off: plain decoding "
        "unless a request sends speculative: true (docs/PERF.md)")})
    speculative_max_draft: int = _field(7, "the most tokens one sequence drafts per step (0..16)")
    speculative_max_batch: int = _field(2, (
        "draft only in steps of at most this many decoding sequences (0: no limit): in larger batches the "
        "draft rows cost more than they save, and a drafting row stops the step overlap (docs/PERF.md, "
        "\"Asynchronous scheduling on a CPU too\")"))
    process_id: int = _field(0, "this process's rank with --coordinator: 0 serves HTTP and schedules, "
                             "the others run its steps")
    image_cache_rows: int = _field(
        8192, "image models (Idefics3 / SmolVLM, Qwen2.5-VL): rows of encoder output kept on the device, in the "
        "model's dtype (rows x hidden size; whole frames of image_seq_len rows, e.g. 64 for SmolVLM, 169 for "
        "Idefics3; units of 16 rows for Qwen2.5-VL, about one row per 28 x 28 pixels of a resized image). A "
        "request's images hold their rows until it ends; a picture seen before is served from them without "
        "encoding it again, the least recently used leaving first. A request whose images need more is refused")
    seed: int | None = _field(None, "base of the sampling keys of requests that send no seed (taken modulo "
                              "2**32); default a random one per process, logged at start-up: set it to "
                              "repeat a run's samples. Seeded requests do not depend on it")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):   # the offline API and config files skip argparse's choices
            allowed = f.metadata.get("choices")
            if allowed and getattr(self, f.name) not in allowed:
                raise ValueError(f"--{f.name.replace('_', '-')} {getattr(self, f.name)!r}: expected one of "
                                 f"{', '.join(allowed)}")
        self.gemm = GEMM_ALIASES.get(self.gemm, self.gemm)   # the one place an old name is read
        if self.seed is None:
            self.seed = secrets.randbits(32)   # unseeded samples differ from one process to the next
        elif not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise ValueError(f"--seed must fit in 64 bits, got {self.seed}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
        self.lora = list(self.lora or [])
        for spec in self.lora:
            name, _, path = spec.partition("=")
            if not name or not path:
                raise ValueError(f"--lora {spec!r}: expected NAME=PATH")
        if not 0 <= self.speculative_max_draft <= 16:
            raise ValueError(f"--speculative-max-draft must be in 0..16, got {self.speculative_max_draft}")
        if self.speculative_max_batch < 0:
            raise ValueError(f"--speculative-max-batch must be 0 or more, got {self.speculative_max_batch}")
        if self.image_cache_rows < 1:
            raise ValueError(f"--image-cache-rows must be >= 1, got {self.image_cache_rows}")
        if self.kv_disk_gib <= 0:
            raise ValueError(f"--kv-disk-gib must be > 0, got {self.kv_disk_gib}")
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"--process-id {self.process_id} must be in [0, --num-processes {self.num_processes})")
        if (self.num_processes > 1) != (self.coordinator is not None):
            raise ValueError("--coordinator HOST:PORT and --num-processes > 1 go together (multi-host)")
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ValueError("--max-loras must be >= 0 and --max-lora-rank >= 1")
        if self.lora and not self.max_loras:
            self.max_loras = max(4, len(self.lora))
        if len(self.lora) > self.max_loras:
            raise ValueError(f"{len(self.lora)} --lora adapters but --max-loras {self.max_loras}")

    @property
    def multi_host(self) -> bool:
        return self.num_processes > 1

    def lora_adapters(self) -> list[tuple[str, str]]:
        """The start-up adapters as (name, path)."""
        return [(name, path) for name, path in (spec.split("=", 1) for spec in self.lora)]

    def async_scheduling_on(self) -> bool:
        """Whether steps overlap (`overlaps_steps`)."""
        return overlaps_steps(self.async_scheduling)

    def resolved_max_model_len(self, model: ModelConfig) -> int:
        return min(self.max_model_len or model.max_position_embeddings, model.max_position_embeddings)

    def cache_dir(self) -> Path:
        return Path(self.compilation_cache_dir) if self.compilation_cache_dir else compilation_cache_dir()


def models_in(directory: Path) -> dict[str, Path]:
    """name -> path of every model an EngineConfig's `model` could name in `directory` (a `.gguf` file,
    an HF or converted directory; named as the loader serves it: the entry's name), sorted by name."""
    from imp_jax.errors import ModelLoadError
    from imp_jax.model.formats.hub import classify_path

    found: dict[str, Path] = {}
    for path in sorted(directory.iterdir()):
        try:
            classify_path(path)
        except ModelLoadError:
            continue
        found[path.name] = path
    return found


KV_CACHE_DTYPES = ("auto", "float32", "bfloat16")
DEFAULT_CPU_KV_BYTES = 1 << 30   # 1 GiB
DEFAULT_GPU_KV_FRACTION = 0.9


def kv_bytes_per_block(model: ModelConfig, block_size: int, itemsize: int, kv_heads: int | None = None) -> int:
    """K and V bytes of one block across all layers, for `kv_heads` (default: all the model's; with
    tensor parallelism, one device's)."""
    return 2 * model.num_layers * block_size * (kv_heads or model.num_kv_heads) * model.head_dim * itemsize


KV_FLOOR_BLOCKS = 2   # the pool's rescue floor: what a memory budget too small for it still gets


def kv_budget_blocks(config: EngineConfig, model: ModelConfig, itemsize: int, backend: str,
                     free_device_bytes: int | None, kv_heads_per_device: int | None = None) -> int:
    """Blocks --kv-cache-memory pays for (fraction of free memory on GPU, bytes on CPU), a budget per
    device: each device holds `kv_heads_per_device` of every block. May be below KV_FLOOR_BLOCKS."""
    per_block = kv_bytes_per_block(model, config.block_size, itemsize, kv_heads_per_device)
    mem = config.kv_cache_memory
    if backend == "cpu" or free_device_bytes is None:
        budget = int(mem) if mem and mem > 1 else DEFAULT_CPU_KV_BYTES
    else:
        frac = mem if mem and mem <= 1 else DEFAULT_GPU_KV_FRACTION
        budget = int(free_device_bytes * frac)
    return budget // per_block


def num_kv_blocks(config: EngineConfig, model: ModelConfig, itemsize: int, backend: str,
                  free_device_bytes: int | None, kv_heads_per_device: int | None = None) -> int:
    """Pool size from --num-kv-blocks, else the budget's blocks (kv_budget_blocks), at least the floor."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    return max(KV_FLOOR_BLOCKS, kv_budget_blocks(config, model, itemsize, backend, free_device_bytes,
                                                 kv_heads_per_device))


def kv_pool_floored(config: EngineConfig, model: ModelConfig, itemsize: int, backend: str,
                    free_device_bytes: int | None, kv_heads_per_device: int | None = None) -> bool:
    """The budget paid for fewer blocks than the floor, so the pool got the floor (/health kv_pool_floored)."""
    return not config.num_kv_blocks and kv_budget_blocks(
        config, model, itemsize, backend, free_device_bytes, kv_heads_per_device) < KV_FLOOR_BLOCKS
