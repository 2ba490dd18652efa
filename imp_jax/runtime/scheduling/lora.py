"""Adapter slots: which LoRA adapter holds which slot of the model's slabs (model/lora.py), and for how long.

An adapter is loaded into a free slot (1..max_loras) by writing the slot's columns of every slab
(a device update of parameter values: no program changes shape, nothing compiles). Requests name
it; each running request holds it. Unloading takes the name away at once (new requests get
`lora_not_loaded`), waits until the requests holding it end, then zeroes and frees the slot; an
unload whose caller stopped waiting (`keep`) gives the name back instead. The prefix cache keys
an adapter's blocks by its name and content digest (`adapter_digest`, computed when it is read), so
blocks computed under an earlier adapter of the same name are never reused, in this process or, from
the disk tier, after a restart; a reload of the same weights reuses its blocks (they are the same
KV). Each load also gets a generation, the `id` the API shows. Engine thread only, like the rest of the core.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any, Callable

import numpy as np
import xxhash

from imp_jax.errors import ImpError, InvalidRequestError
from imp_jax.model.lora import LoraOptions
from imp_jax.model.formats.peft import Adapter, AdapterError, read_adapter

Reply = Callable[[Any], None]


@dataclasses.dataclass
class LoadedAdapter:
    name: str
    slot: int
    path: str
    generation: int                                 # the load's number in this process: the API's `id`
    rank: int
    modules: list[str]
    digest: str                                     # adapter_digest: its content, the same after a restart
    active: int = 0                                 # requests holding it
    unload_waiters: list[Reply] | None = None       # set once an unload was asked for

    @property
    def cache_key(self) -> tuple[str, str]:
        """What its sequences' prefix-cache key adds to the salt (kv_hash.durable_key: may go to disk)."""
        return self.name, self.digest

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "id": self.generation, "path": self.path, "slot": self.slot,
                "rank": self.rank, "target_modules": self.modules}


class AdapterSlots:
    """The slots of a model with LoRA slabs, written through `write_params` (CompiledStep.write_params)."""

    def __init__(self, model: Any, options: LoraOptions, write_params: Callable[[Callable[[Any], None]], None]):
        self.options = options
        self.targets = model.lora_targets()
        self.num_layers = model.config.num_layers
        self.slab_dtype = np.dtype(model.lora.slab(next(iter(model.lora.projections)), 0, "a").get_value().dtype)
        self._write_params = write_params
        self.by_name: dict[str, LoadedAdapter] = {}    # loaded and not being unloaded
        self.unloading: list[LoadedAdapter] = []
        self._free = list(range(1, options.max_loras + 1))
        self._generations = itertools.count(1)

    def read(self, path: str) -> Adapter:
        """The adapter at `path`, checked against the model (any thread); 400 lora_load_failed if it does not fit."""
        try:   # its values are bounded below float16's range, the slabs' type on a CPU (model/formats/peft.py)
            adapter = read_adapter(path, self.targets, self.num_layers, self.options.max_rank)
        except AdapterError as e:
            raise InvalidRequestError(str(e), code="lora_load_failed", param="path") from None
        return dataclasses.replace(adapter, digest=adapter_digest(adapter, self.slab_dtype))

    def load(self, name: str, adapter: Adapter) -> LoadedAdapter:
        """Put `adapter` in a free slot under `name`: 409 when the name is taken or every slot is."""
        if name in self.by_name or any(a.name == name for a in self.unloading):
            raise ImpError(f"a LoRA adapter named '{name}' is already loaded; unload it first",
                           code="lora_already_loaded", status=409, param="name")
        if not self._free:
            raise ImpError(f"all {self.options.max_loras} LoRA slots are taken (--max-loras); unload an adapter "
                           "first", code="lora_slots_full", status=409, param="name")
        slot = self._free.pop(0)
        try:
            self._write(slot, adapter)
        except BaseException:
            self._free.insert(0, slot)
            raise
        loaded = LoadedAdapter(name, slot, str(adapter.path), next(self._generations), adapter.rank, adapter.modules,
                               adapter.digest or adapter_digest(adapter, self.slab_dtype))
        self.by_name[name] = loaded
        return loaded

    def acquire(self, name: str) -> LoadedAdapter:
        """The adapter a request names, held until `release`; 400 lora_not_loaded when there is none."""
        adapter = self.by_name.get(name)
        if adapter is None:
            raise InvalidRequestError(f"no LoRA adapter named '{name}' is loaded (GET /v1/models lists them)",
                                      code="lora_not_loaded", param="lora")
        adapter.active += 1
        return adapter

    def release(self, adapter: LoadedAdapter) -> None:
        adapter.active -= 1
        self._finish_unloads()

    def unload(self, name: str, reply: Reply) -> None:
        """Take `name` away now and free its slot once no request holds it; `reply` gets its description,
        or None when no adapter has that name."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            reply(None)
            return
        adapter.unload_waiters = [reply]
        self.unloading.append(adapter)
        self._finish_unloads()

    def keep(self, name: str) -> int | None:
        """Call off `name`'s pending unload (its timeout ran out): the adapter serves again, the unload's
        reply is never called. The number of requests still holding it, or None when the unload has
        already finished (then its reply has been called)."""
        adapter = next((a for a in self.unloading if a.name == name), None)
        if adapter is None:
            return None
        self.unloading.remove(adapter)
        adapter.unload_waiters = None
        self.by_name[name] = adapter
        return adapter.active

    def _finish_unloads(self) -> None:
        for adapter in [a for a in self.unloading if a.active == 0]:
            self._write(adapter.slot, None)
            self.unloading.remove(adapter)
            self._free.append(adapter.slot)
            for reply in adapter.unload_waiters or ():
                reply(adapter.describe())

    def _write(self, slot: int, adapter: Adapter | None) -> None:
        """Slot `slot` of every slab set to `adapter` (zeros where it has no module, or for None)."""
        r = self.options.max_rank
        by_part = {(t.fused, t.part): name for name, t in self.targets.items()}

        def edit(model: Any) -> None:
            slabs = model.lora
            for fused, (_, outs) in slabs.projections.items():
                bounds = np.cumsum((0,) + tuple(outs))
                if fused in slabs.GLOBAL:   # the model-wide modules: one "layer", and a per-slot flag
                    on_var = getattr(slabs, fused + "_on")
                    on = np.array(on_var.get_value())
                    on[slot] = adapter is not None and (by_part[(fused, 0)], 0) in adapter.weights
                    on_var.set_value(on)
                for layer in range(len(getattr(slabs, fused + "_a"))):
                    a_var, b_var = slabs.slab(fused, layer, "a"), slabs.slab(fused, layer, "b")
                    a = np.array(a_var.get_value())          # [N, P * r, in]
                    bt = np.array(b_var.get_value())         # [N, r, sum(out_p)]
                    a[slot - 1] = 0
                    bt[slot - 1] = 0
                    for p in range(len(outs)):
                        w = adapter.weights.get((by_part[(fused, p)], layer)) if adapter else None
                        if w is not None:
                            k = w[0].shape[0]
                            a[slot - 1, p * r:p * r + k] = w[0]
                            bt[slot - 1, :k, bounds[p]:bounds[p + 1]] = w[1].T
                    a_var.set_value(a)
                    b_var.set_value(bt)

        self._write_params(edit)

    def describe(self) -> list[dict[str, Any]]:
        """The loaded adapters (any thread: the dict is copied in one step under the GIL)."""
        return [a.describe() for a in list(self.by_name.values())]


def adapter_digest(adapter: Adapter, slab_dtype: np.dtype) -> str:
    """32 hex digits naming what an adapter's KV depends on: every (module, layer)'s A and scaled B (shape,
    dtype, bytes; the alpha / r scale is folded in) and the slabs' dtype they are cast to. Its path is not in it."""
    h = xxhash.xxh3_128(json.dumps(["lora-v1", np.dtype(slab_dtype).name]).encode())
    for (module, layer), pair in sorted(adapter.weights.items()):
        for w in pair:
            h.update(json.dumps([module, layer, w.dtype.str, list(w.shape)]).encode())
            h.update(np.ascontiguousarray(w).tobytes())
    return h.hexdigest()
