"""The compiled step: forward + gather of the rows to sample + sampler, one program per shape bucket.

Every (token-count, sequence-count) bucket is compiled ahead of time; serving looks executables
up and never traces. Start-up can compile just the serving set (the largest bucket, which holds
any step, and the smallest) and compile the rest in the background: until a bucket is compiled,
a step that would fit it runs in the smallest compiled bucket that holds it. A counter of
compilations after warm-up (the background compiles done) proves serving never compiles.

Context buckets: where the attention walks the block tables to a static bound (XLA without dynamic skips:
`Kernels.bucketed_context`, GPUs without the Pallas kernel) each (T, S) bucket has one program per power
of two of block-table columns, from MIN_CONTEXT_BLOCKS up to the whole table, and a step runs the
smallest that reaches its longest sequence: a short-context step reads a few blocks, not max_model_len's.
Elsewhere the one context bucket is the whole table (the attention stops at `seq_lens` by itself).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from imp_jax.runtime.execution.batch import StepBatch, pow2_buckets
from imp_jax.runtime.scheduling.block_tables import DeviceTables, edit_capacity
from imp_jax.runtime.kv.kv_blocks import BlockTable
from imp_jax.runtime.decoding.logit_lens import supports_lens
from imp_jax.runtime.parallel.multihost import SCORE, STEP, TABLES, Leader
from imp_jax.runtime.execution.program_inputs import ProgramInputs, StepShapes
from imp_jax.runtime.execution.sampling import SamplerOutput, SamplingTensors
from imp_jax.runtime.parallel.sharding import kv_sharding, replicated, state_shardings
from imp_jax.runtime.execution.step_programs import step_programs

log = logging.getLogger("imp_jax.step")
Progress = Callable[[int, int, tuple[int, int, int], float], None]   # (i, n, (T, S, context), seconds)
MIN_CONTEXT_BLOCKS = 16   # the smallest context bucket: below it, fewer blocks save less than a program costs


class CompiledStep:
    """Owns the model state and the KV cache; runs one donated, in-place step per call.

    Three programs share the forward pass: `step` (logits of the sampled rows -> sampler) per
    (T, S, context) bucket, `score` (raw logprobs of every row, for prompt_logprobs) for one bucket, and
    `lens` (one token's per-layer readout, for logit_lens: runtime/decoding/logit_lens.py) when the model
    returns per-layer residuals.
    Both read the block tables from device-resident rows (runtime/scheduling/block_tables.py) that they edit
    in place; a third, tiny program writes the edits a step has no room for.
    Every array has an explicit sharding on `mesh` (runtime/parallel/sharding.py). On a mesh of more than
    one device the forward and the LM head run per shard under `shard_map` (the model's kernels are
    custom calls GSPMD cannot split; the model sums its row-parallel outputs itself) and the
    sampler runs on the gathered logits.
    With `image_pool` = (rows, hidden) (a model that sees images) it also owns the image row pool
    (runtime/scheduling/image_rows.py) that the encoder writes and the step reads: one more step input, and each token
    row's `embed_src` in the packed ints (-1: its token's own embedding). Without, the step is unchanged.
    With `mrope` (Qwen2.5-VL's image side served) the step program's positions are [3, T] (temporal, height,
    width: runtime/features/images.py fills them; all three the row's index when not given); the score and
    lens programs keep [T] (they refuse prompts with images, whose positions differ from the index).
    With `bidirectional_images` (Gemma 3: an image's tokens see each other during prefill) the step program
    also takes `key_limit` [T] in the packed ints, after embed_src, into its AttentionMetadata (each row's last
    key past its own position, -1: causal; runtime/features/images.py fills it); the score and lens programs
    take none (they refuse images).
    """

    def __init__(self, model: Any, kv: tuple[jax.Array, jax.Array], shapes: StepShapes,
                 buckets: list[tuple[int, int]], mesh: Mesh, image_pool: tuple[int, int] | None = None,
                 mrope: bool = False, bidirectional_images: bool = False):
        if bidirectional_images and not image_pool:
            raise ValueError("bidirectional_images needs an image pool (a model that sees images)")
        self.graphdef, state = nnx.split(model)
        self.shapes = shapes
        self.mrope = mrope
        self.bidirectional_images = bidirectional_images
        self.context_buckets = context_buckets(shapes.max_blocks, model.options.kernels.bucketed_context)
        self.buckets = sorted((T, S, C) for T, S in buckets for C in self.context_buckets)
        self.mesh = mesh
        state_sh, kv_sh, rep = state_shardings(state, mesh), kv_sharding(mesh), replicated(mesh)
        self.state = jax.device_put(state, state_sh)
        if mesh.size > 1:   # the loader left the weights on the host, shard-major: keep only the placed shards
            nnx.update(model, self.state)
        self.kv = jax.device_put(kv, (kv_sh, kv_sh))
        self.max_rows = max(s for _, s, _ in self.buckets)   # the previous step's tokens, padded to this
        # every running sequence's block table, a row each; twice the rows a step holds, so finished and
        # preempted sequences' rows are reclaimed in batches (block_tables.py)
        self.device_tables = DeviceTables(2 * self.max_rows + 2, shapes.max_blocks)
        self.tables = jax.device_put(np.zeros((self.device_tables.num_slots, shapes.max_blocks), np.int32), rep)
        self.image_pool = (jax.device_put(np.zeros(image_pool, jnp.dtype(model.options.dtype)), rep)
                           if image_pool else None)   # encoder rows, replaced whole by each encoder launch
        self._block_size = self.kv[0].shape[2]
        self.inputs = ProgramInputs(shapes, self._block_size, images=image_pool is not None, mrope=mrope,
                                    bidirectional_images=bidirectional_images,
                                    with_lora=getattr(model, "lora", None) is not None)
        # the programs take the parameters as a flat list (flattening nnx Variables on every call
        # cost more host time than the rest of the dispatch) and every host input as two packed
        # buffers (packing.py); they are lowered from specs, never from the live (donated) buffers,
        # so a background thread can compile while the engine thread steps
        self._leaves, treedef = jax.tree.flatten(self.state)
        self._treedef = treedef
        self._parked: tuple[list[np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None   # suspend()
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
        self._leaf_specs, self._kv_spec = [spec(a) for a in self._leaves], jax.tree.map(spec, self.kv)
        self._tables_spec = spec(self.tables)
        self._exec: dict[tuple[int, int, int], Any] = {}
        self._compiled: list[tuple[int, int, int]] = []   # sorted; replaced whole, so readers need no lock
        self._unrun: list[tuple[int, int, int]] = []      # compiled, not yet run once (under _unrun_lock)
        self._compile_lock = threading.Lock()
        self._stop_compiling = threading.Event()
        self._unrun_lock = threading.Lock()
        self._score_unrun = False                      # the score program compiled, not yet run once
        self.compilations_after_warmup = 0
        self.compile_seconds: dict[tuple[int, int, int], float] = {}   # per step bucket, as start-up compiled it
        self._warm = False
        self.leader: Leader | None = None   # multi-host process 0: announces each program (runtime/parallel/multihost.py)
        # runs before every program reading or writing the cache: the host KV tier's queued copies (kv_tiers.py)
        self.before_programs: Callable[[], None] = lambda: None
        self.base_seed = 0   # unseeded rows' keys are fold_in(key(base_seed), step number): EngineConfig.seed
        programs = step_programs(model, self.graphdef, treedef, self._leaves, mesh, self.max_rows,
                                 bidirectional_images)
        # params, kv, block tables, ints, floats, the previous step's tokens (`last_tokens`)
        ins = ([a.sharding for a in self._leaves], (kv_sh, kv_sh), rep, rep, rep, rep)
        self.no_prev = jax.device_put(np.zeros(self.max_rows, np.int32), rep)
        self.last_tokens = self.no_prev   # the tokens of the step launched last, padded to max_rows
        jit = lambda f, ins=ins: jax.jit(f, static_argnums=(6, 7), donate_argnums=(1, 2), in_shardings=ins,
                                         out_shardings=(rep, (kv_sh, kv_sh), rep))
        self._step_jit = jit(programs["step"], ins + ((rep,) if image_pool else ()))   # the pool: not donated
        self._score_jit = jit(programs["score"])
        self._jits = {"step": self._step_jit, "score": self._score_jit, "lens": jit(programs["lens"])}
        self._score_exec: Any = None
        self.supports_lens = supports_lens(model)   # logit_lens: the model returns per-layer residuals
        self._lens_exec: Any = None
        # the edits a step has no room for, `table_chunk` at a time, before it
        self.table_chunk = max(shapes.max_blocks, 64)
        self.table_writes = 0   # runs of that program
        write = lambda tables, edits: tables.at[edits[0], edits[1]].set(edits[2], mode="drop")
        self._write_exec = jax.jit(write, donate_argnums=(0,), in_shardings=(rep, rep), out_shardings=rep).lower(
            self._tables_spec, jax.ShapeDtypeStruct((3, self.table_chunk), jnp.int32)).compile()
        self.score_tokens = self.buckets[-1][0]   # prompt logprobs run one sequence, chunk by chunk

    def serving_set(self) -> list[tuple[int, int, int]]:
        """The buckets start-up compiles before serving: the largest (holds any step) and the smallest."""
        return sorted({self.buckets[-1], self.buckets[0]}, reverse=True)

    def warm_up(self, progress: Progress | None = None) -> None:
        """Compile every program now (from the persistent cache when it has them) and run each step
        bucket once, so serving never compiles and no request pays a program's first run."""
        self.compile_serving_set(progress)
        self.compile_rest(progress)
        while self.run_one_unrun():
            pass

    def compile_serving_set(self, progress: Progress | None = None) -> None:
        """Compile `serving_set()`: enough to serve any step (others are waited for by nobody)."""
        for i, bucket in enumerate(self.serving_set()):
            self._compile_timed(bucket, i + 1, progress)

    def compile_rest(self, progress: Progress | None = None) -> None:
        """Compile every other program (safe on a background thread); warm-up is over when it returns."""
        rest = [b for b in self.buckets if b not in self._exec]
        done = len(self.buckets) - len(rest)
        for i, bucket in enumerate(rest):
            if self._stop_compiling.is_set():
                return
            self._compile_timed(bucket, done + i + 1, progress)
        self._score_program(counted=False)
        if self.supports_lens:
            self._lens_program(counted=False)
        self._warm = True

    def stop_compiling(self) -> None:
        """Make a running `compile_rest` return after the program it is compiling (shutdown)."""
        self._stop_compiling.set()

    def run_one_unrun(self) -> bool:
        """Engine thread: run one compiled, never-run bucket on an all-padding batch (it writes no
        KV). A program's first run costs more than later ones (docs/PERF.md): start-up, or idle
        time, pays it instead of the first request in the bucket. Whether one ran."""
        with self._unrun_lock:
            bucket = self._unrun[0] if self._unrun else None
            score = bucket is None and self._score_unrun
            self._score_unrun = self._score_unrun and not score
        if bucket is None and not score:
            return False
        T, S, C = bucket or (self.score_tokens, 1, self.shapes.max_blocks)
        batch = self.inputs.empty_batch(T, S)
        if score:   # its first run keeps ~55 MiB of buffers: at start-up, not mid-traffic
            self.score(batch, np.zeros(T, np.int32), [])
        else:
            fetch(self.launch(batch, self.inputs.dummy_sampling(S), 0, [], context=C))
        return True

    def has_unrun(self) -> bool:
        return not self.suspended and (bool(self._unrun) or self._score_unrun)

    @property
    def kv_spec(self) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """The K and V caches' shape, storage dtype and sharding: [layers, blocks, block_size, kv_heads, head_dim]."""
        return self._kv_spec

    @property
    def num_compiled(self) -> int:
        """Step programs compiled so far (all of `buckets` once warm)."""
        return len(self._compiled)

    @property
    def warm(self) -> bool:
        """Every program compiled: from now on a compilation is counted."""
        return self._warm

    def _compile_timed(self, bucket: tuple[int, int, int], i: int, progress: Progress | None) -> None:
        t0 = time.perf_counter()
        self._compile(bucket, counted=False)
        self.compile_seconds[bucket] = time.perf_counter() - t0
        if progress:
            progress(i, len(self.buckets), bucket, self.compile_seconds[bucket])

    def lowered(self, program: str, T: int, S: int, context: int | None = None) -> Any:
        """The `program` ("step", "score" or "lens") for T tokens over S sequence slots reading `context`
        block-table columns (default: all), lowered, not compiled."""
        layout = self.inputs.layout(program, T, S, lambda batch: self._attach_tables(batch, []))
        jitted = self._jits[program]
        pool = self.image_pool
        images = (jax.ShapeDtypeStruct(pool.shape, pool.dtype, sharding=pool.sharding),) if (
            program == "step" and pool is not None) else ()
        return jitted.lower(self._leaf_specs, self._kv_spec, self._tables_spec,
                            jax.ShapeDtypeStruct((layout.int_size,), jnp.int32),
                            jax.ShapeDtypeStruct((layout.float_size,), jnp.float32),
                            jax.ShapeDtypeStruct((self.max_rows,), jnp.int32, sharding=self.no_prev.sharding),
                            layout, context or self.shapes.max_blocks, *images)

    def _lower(self, program: str, T: int, S: int, context: int | None = None, counted: bool = True) -> Any:
        """Compile `program` for T tokens over S sequence slots and `context` table columns (counted once
        warm-up is over)."""
        exe = self.lowered(program, T, S, context).compile()
        if counted and self._warm:
            self.compilations_after_warmup += 1
            log.warning("compiled a %s program for T=%d S=%d context=%s after warm-up", program, T, S, context)
        return exe

    def _compile(self, bucket: tuple[int, int, int], counted: bool = True) -> Any:
        with self._compile_lock:
            if bucket in self._exec:
                return self._exec[bucket]
            exe = self._lower("step", *bucket, counted=counted)
            self._exec[bucket] = exe
            self._compiled = sorted(self._exec)
            with self._unrun_lock:
                self._unrun.append(bucket)
            return exe

    def _score_program(self, counted: bool = True) -> Any:
        """The prompt-scoring program, compiled on first need (warm-up compiles it)."""
        with self._compile_lock:
            if self._score_exec is None:
                self._score_exec = self._lower("score", self.score_tokens, 1, counted=counted)
                self._score_unrun = True
            return self._score_exec

    def _lens_program(self, counted: bool = True) -> Any:
        """The logit_lens program (one token, one sequence), compiled on first need (warm-up compiles it)."""
        with self._compile_lock:
            if self._lens_exec is None:
                self._lens_exec = self._lower("lens", 1, 1, counted=counted)
            return self._lens_exec

    def lens(self, batch: StepBatch, token: int, tables: list[BlockTable]) -> tuple[np.ndarray, ...]:
        """Per layer: the raw logprob, rank and entropy of `token` and the top LENS_TOP, at the one-token
        `batch` (runtime/decoding/logit_lens.py lens_batch; `tables`: its sequence's BlockTable)."""
        if self.leader is not None:
            raise ValueError("logit_lens does not run multi-host")
        exe = self._lens_program()
        self.before_programs()
        self._attach_tables(batch, tables)
        ints, floats = self.inputs.pack("lens", self.inputs.lens(batch, token))
        out, self.kv, self.tables = exe(self._leaves, self.kv, self.tables, ints, floats, self.no_prev)
        return tuple(np.asarray(x) for x in out)

    def score(self, batch: StepBatch, targets: np.ndarray, tables: list[BlockTable]) -> tuple[np.ndarray, ...]:
        """Raw logprob and rank of `targets` [T] at every row, plus the top 20, for a one-sequence batch
        (`batch` built without tables; `tables`: its sequence's BlockTable)."""
        return tuple(np.asarray(x) for x in self.launch_score(batch, targets, tables))

    def launch_score(self, batch: StepBatch, targets: np.ndarray, tables: list[BlockTable]) -> tuple[jax.Array, ...]:
        """`score`, returning at once with device arrays (the host reads them later)."""
        exe = self._score_program()
        self.before_programs()
        self._attach_tables(batch, tables)
        ints, floats = self.inputs.pack("score", self.inputs.score(batch, targets))
        if self.leader is not None:
            self.leader.send(SCORE, (len(batch.input_ids), 1, self.shapes.max_blocks), ints, floats)
        out, self.kv, self.tables = exe(self._leaves, self.kv, self.tables, ints, floats, self.no_prev)
        return out

    def run_packed(self, program: str, bucket: tuple[int, int, int], ints: np.ndarray, floats: np.ndarray) -> None:
        """A multi-host follower: run the program the leader announced on its packed inputs, to the end."""
        if program == "tables":
            self.tables = self._write_exec(self.tables, ints.reshape(3, -1))
            return
        exe = (self._exec.get(bucket) or self._compile(bucket)) if program == "step" else self._score_program()
        images = self._images() if program == "step" else ()
        out, self.kv, self.tables = exe(self._leaves, self.kv, self.tables, ints, floats, self.no_prev, *images)
        jax.block_until_ready(out)

    def _attach_tables(self, batch: StepBatch, tables: list[BlockTable]) -> None:
        """Give `batch` (built without tables) its rows of the device tables and the edits that bring
        them up to date: as many as its program takes, the rest written now by the table program (it
        runs first: the tables pass through the programs in launch order)."""
        T, S = len(batch.input_ids), len(batch.seq_lens)
        rows, edits = self.device_tables.edits(tables, S)
        room = edit_capacity(T, S, self._block_size)
        while len(edits) > room:
            n = min(len(edits) - room, self.table_chunk)
            chunk, edits = edits[:n], edits[n:]
            packed = self.device_tables.pack(chunk, self.table_chunk)
            if self.leader is not None:
                self.leader.send(TABLES, (0, 0, 0), packed.ravel(), np.zeros(0, np.float32))
            self.tables = self._write_exec(self.tables, packed)
            self.table_writes += 1
        batch.table_rows, batch.table_edits = rows, self.device_tables.pack(edits, room)

    def fault_message(self, error: BaseException) -> str:
        """The engine's error when running a program raised (a lost process, when multi-host)."""
        return self.leader.fault_message(error) if self.leader is not None else f"device fault: {error}"

    @property
    def suspended(self) -> bool:
        return self._parked is not None

    def suspend(self) -> int:
        """Copy the parameters and the KV cache (prefix cache included) to host memory and free their
        device buffers; returns the bytes freed. Nothing may run until `resume()`."""
        arrays = [*self._leaves, *self.kv]   # the block tables (a few hundred KiB) stay
        host = [np.array(a, copy=True) for a in arrays]   # a copy: on a CPU the array may be the buffer
        freed = sum(a.nbytes for a in arrays)
        for a in arrays:
            a.delete()
        n = len(self._leaves)
        self._parked = (host[:n], (host[n], host[n + 1]))
        self._leaves, self.kv, self.state = [], (None, None), None
        return freed

    def resume(self) -> None:
        """Put the parked parameters and KV cache back on their devices, with their shardings."""
        leaves, kv = self._parked
        self._leaves = [jax.device_put(h, s.sharding) for h, s in zip(leaves, self._leaf_specs)]
        self.kv = tuple(jax.device_put(h, s.sharding) for h, s in zip(kv, self._kv_spec))
        self.state = jax.tree.unflatten(self._treedef, self._leaves)
        self._parked = None

    def _images(self) -> tuple[jax.Array, ...]:
        """The step program's image input: the row pool, when it has one."""
        return () if self.image_pool is None else (self.image_pool,)

    def write_params(self, edit: Callable[[Any], None]) -> None:
        """Engine thread, between steps: `edit(model)` sets some parameters to host arrays of their
        shapes and dtypes (LoRA slots: runtime/scheduling/lora.py); those go to the device with their shardings.
        The programs take parameters as inputs, so nothing compiles."""
        if self.suspended:
            raise RuntimeError("parameters cannot change while suspended")
        model = nnx.merge(self.graphdef, self.state)
        edit(model)
        leaves = jax.tree.leaves(nnx.split(model)[1])
        new = []
        for old, leaf, spec in zip(self._leaves, leaves, self._leaf_specs):
            if leaf is not old:
                if tuple(np.shape(leaf)) != tuple(spec.shape):
                    raise ValueError(f"a parameter of shape {spec.shape} was set to {np.shape(leaf)}")
                leaf = jax.device_put(np.asarray(leaf, spec.dtype), spec.sharding)
            new.append(leaf)
        self._leaves = new
        self.state = jax.tree.unflatten(self._treedef, new)

    def bucket_for(self, num_tokens: int, num_seqs: int, longest: int = 0) -> tuple[int, int]:
        """The (T, S) of the smallest compiled bucket holding this many tokens and sequences, with a program
        for sequences of `longest` tokens (every bucket once warm; before, the largest is always compiled)."""
        need = -(-longest // self._block_size)
        for T, S, C in self._compiled or self.buckets:
            if T >= num_tokens and S >= num_seqs and C >= need:
                return T, S
        raise ValueError(f"no bucket holds {num_tokens} tokens and {num_seqs} sequences")

    def _program_key(self, T: int, S: int, longest: int) -> tuple[int, int, int]:
        """The step program for a (T, S) batch whose longest sequence has `longest` tokens: the smallest
        compiled context bucket reaching it (`bucket_for` saw one), else the one to compile."""
        need = -(-longest // self._block_size)
        compiled = [key for key in self._compiled if key[:2] == (T, S) and key[2] >= need]
        return compiled[0] if compiled else (T, S, next(c for c in self.context_buckets if c >= need))

    def launch(self, batch: StepBatch, sampling: SamplingTensors, step_no: int, tables: list[BlockTable],
               follow: tuple[np.ndarray, np.ndarray] | None = None, prev: jax.Array | None = None,
               cfg: tuple[np.ndarray, np.ndarray] | None = None, context: int | None = None,
               embed_src: np.ndarray | None = None, mrope_positions: np.ndarray | None = None,
               key_limit: np.ndarray | None = None) -> SamplerOutput:
        """Start one step and return at once (JAX dispatches asynchronously): its output as device
        arrays, which `fetch` waits for. The host may work meanwhile; the next launch follows it.
        `batch` is built without tables (`with_tables=False`); `tables` are its sequences' BlockTables.

        `follow` = (src [T], hist_pos [S]) with `prev` (an earlier launch's `last_tokens`): token row t
        takes prev[src[t]] when src[t] >= 0, and sampling row r's history slot hist_pos[r] (>= 0) gets
        its last token's id (the engine's asynchronous scheduling). `last_tokens` is this step's.
        `cfg` = (shadow row [S], scale [S]) guides row r's logits by row shadow[r] >= 0 (runtime/decoding/cfg.py).
        `embed_src` [T] (with an image pool): token row t's embedding is pool row embed_src[t] when >= 0.
        `mrope_positions` [3, T] (with `mrope`): the rows' M-RoPE positions (default: each row's index, thrice).
        `key_limit` [T] (with `bidirectional_images`): each row's last key past its own position (default -1).
        `context`: the program's context bucket (default: the smallest reaching the batch's sequences)."""
        T, S = len(batch.input_ids), len(batch.seq_lens)
        bucket = (T, S, context) if context else self._program_key(T, S, int(batch.seq_lens.max(initial=0)))
        exe = self._exec.get(bucket) or self._compile(bucket)
        with self._unrun_lock:
            if bucket in self._unrun:
                self._unrun.remove(bucket)
        self.before_programs()
        self._attach_tables(batch, tables)
        ints, floats = self.inputs.pack("step", self.inputs.step(batch, sampling, (self.base_seed, step_no), follow,
                                                                 cfg, embed_src, mrope_positions, key_limit))
        if self.leader is not None:
            if follow is not None:
                raise ValueError("a multi-host leader runs its steps synchronously (followers get no prev)")
            self.leader.send(STEP, bucket, ints, floats)
        (out, self.last_tokens), self.kv, self.tables = exe(self._leaves, self.kv, self.tables, ints, floats,
                                                            self.no_prev if prev is None else prev, *self._images())
        return SamplerOutput(*out)


def fetch(out: SamplerOutput) -> SamplerOutput:
    """A launched step's output on the host (waits for the step)."""
    return SamplerOutput(*(np.asarray(x) for x in out))


def step_buckets(max_num_batched_tokens: int, max_num_seqs: int, min_tokens: int = 16) -> list[tuple[int, int]]:
    """(T, S) buckets: T powers of two from 16 to the token budget, each with S = min(T, max_num_seqs)
    sequence slots, plus the decode diagonal T = S below 16.

    One program per token count: S only sizes the metadata and the rows sampled (the LM head and
    the sampler run S rows), a few percent of a step of 16+ tokens, where a (T, S) grid would
    multiply start-up compiles by the sequence counts. The diagonal matters on CPU, where a
    batch-1 decode padded to 16 rows runs its GEMMs several times slower than at 1 row
    (docs/PERF.md), and a pure-decode step has one token per sequence.
    """
    ts = pow2_buckets(min(min_tokens, max_num_batched_tokens), max_num_batched_tokens)
    grid = [(t, min(t, max_num_seqs)) for t in ts]
    diagonal = [(s, s) for s in pow2_buckets(1, max_num_seqs) if s < ts[0]]
    return sorted(set(grid + diagonal))


def context_buckets(max_blocks: int, bucketed: bool) -> list[int]:
    """The block-table widths step programs are compiled for: the whole table, or with `bucketed`
    (`Kernels.bucketed_context`) powers of two from MIN_CONTEXT_BLOCKS up to it (the module docstring)."""
    return pow2_buckets(min(MIN_CONTEXT_BLOCKS, max_blocks), max_blocks) if bucketed else [max_blocks]
