"""LoRA adapters (runtime/scheduling/lora.py) as a feature: the request holds its adapter's slot until it ends, and
its sequences compute (and key their prefix-cache blocks) under it."""
from __future__ import annotations

from typing import Any, Callable

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.features.base import Feature, Services
from imp_jax.runtime.scheduling.lora import AdapterSlots


class AdapterFeature(Feature):
    name = "lora"

    def __init__(self, services: Services):
        super().__init__(services)
        slabs = getattr(services.model, "lora", None)
        self.slots = (AdapterSlots(services.model, slabs.options, services.step_fn.write_params)
                      if slabs is not None else None)   # None: started without --max-loras

    def check(self, req, params):
        if req.lora is not None and self.slots is None:
            raise InvalidRequestError(f"no LoRA adapter named '{req.lora}' is loaded (this server has no adapter "
                                      "slots: --max-loras 0)", code="lora_not_loaded", param="lora")
        return params

    def acquire(self, state) -> None:
        if state.request.lora is not None:
            state.ext[self.name] = self.slots.acquire(state.request.lora)

    def start(self, seq, state) -> None:
        adapter = state.ext.get(self.name)
        if adapter is not None:
            seq.lora_slot, seq.lora_key = adapter.slot, adapter.cache_key

    def release(self, state) -> None:
        adapter = state.ext.pop(self.name, None)
        if adapter is not None:
            self.slots.release(adapter)

    # the admin commands (AsyncEngine): load, unload, keep
    def load(self, name: str, adapter: Any) -> dict:
        """Put a read adapter (AdapterSlots.read) in a free slot; 400 when the server has no slots."""
        if self.slots is None:
            raise InvalidRequestError("this server has no LoRA adapter slots; start it with --max-loras N",
                                      code="lora_disabled", param="name")
        return self.slots.load(name, adapter).describe()

    def unload(self, name: str, reply: Callable) -> None:
        """Free `name`'s slot once the requests using it end; `reply` gets its description, or None."""
        if self.slots is None:
            reply(None)
        else:
            self.slots.unload(name, reply)

    def keep(self, name: str) -> int | None:
        """Call off `name`'s pending unload (AdapterSlots.keep)."""
        return self.slots.keep(name) if self.slots is not None else None
