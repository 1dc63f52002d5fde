"""The device slots of the LoRA layers: which adapter each slot holds, how many admitted sequences pin it, and
which to reuse (the lowest empty slot, else the least recently used unpinned one). Slot 0 is the base model.

Not locked on its own: LoRAManager calls it under its lock.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from ..model.causal_lm import CausalLM
from .adapters import LoRAAdapter


class DeviceSlots:
    def __init__(self, model: CausalLM, max_loras: int, device: torch.device):
        self._model = model
        self.max_loras = max_loras
        self._device = device
        self._pin = device.type == "cuda"
        self.slot_of: dict[str, int] = {}
        self._adapter_in: list[str | None] = [None] * (max_loras + 1)
        self._pins = [0] * (max_loras + 1)
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))
        # Bumped whenever a slot's weights change, so that what was derived from them (merged packs) is redone.
        self.generation = [0] * (max_loras + 1)
        # What the prefix cache keys each slot's KV by: the name and weights digest of the adapter in it.
        self.cache_key: list[bytes | None] = [None] * (max_loras + 1)
        if self._pin:
            self._copy_stream = torch.cuda.Stream(device)
            self._copy_done: dict[int, tuple[torch.cuda.Event, LoRAAdapter]] = {}

    def residents(self) -> tuple[str, ...]:
        """The adapters in a slot, sorted (a copy of one small list: safe without the lock, for metrics)."""
        return tuple(sorted(n for n in list(self._adapter_in) if n is not None))

    def free_slot(self) -> int | None:
        """The lowest empty slot, else the least recently used unpinned one."""
        empty = next((s for s in range(1, self.max_loras + 1) if self._adapter_in[s] is None), None)
        if empty is not None:
            return empty
        return next((s for s in self._lru if self._pins[s] == 0), None)

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1
        self._lru.move_to_end(slot)

    def release(self, slot: int) -> None:
        self._pins[slot] -= 1
        assert self._pins[slot] >= 0, "adapter slot released more often than acquired"

    def pins_of(self, name: str) -> int:
        slot = self.slot_of.get(name)
        return self._pins[slot] if slot is not None else 0

    @property
    def num_free(self) -> int:
        return sum(1 for s in range(1, self.max_loras + 1) if self._pins[s] == 0)

    def load(self, slot: int, adapter: LoRAAdapter) -> str | None:
        """Copy `adapter` into `slot` (unpinned); returns the adapter it evicted, if any."""
        evicted = self._adapter_in[slot]
        if evicted is not None:
            del self.slot_of[evicted]
        if self._pin:
            # On a side stream from pinned memory, without a host sync: the copy waits for the steps already
            # queued (one may still read the slot's old weights), and the next step waits for the copy.
            current = torch.cuda.current_stream(self._device)
            self._copy_stream.wait_stream(current)
            with torch.cuda.stream(self._copy_stream):
                self._copy_layers(slot, adapter)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
            current.wait_event(done)
            self._copy_done[slot] = (done, adapter)  # the host tensors stay alive until the copy has run
        else:
            self._copy_layers(slot, adapter)
        self._adapter_in[slot] = adapter.name
        self.slot_of[adapter.name] = slot
        self.generation[slot] += 1
        self.cache_key[slot] = b"adapter\0" + adapter.name.encode() + b"\0" + adapter.digest
        return evicted

    def forget(self, name: str) -> int | None:
        """Mark the slot of `name` (unpinned) empty, its weights left as they are (no torch op: any thread, under
        the manager's lock); the next adapter copied in clears them first. Returns the slot."""
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self._adapter_in[slot] = None
            self.generation[slot] += 1
            self.cache_key[slot] = None
        return slot

    def drop(self, name: str) -> None:
        """Empty the slot of `name` (unpinned), if it has one, its weights zeroed (the engine thread, between
        steps)."""
        slot = self.forget(name)
        if slot is None:
            return
        for layer in self._model.layers:
            for projection, _ in layer.projections():
                projection.clear_slot(slot)

    def _copy_layers(self, slot: int, adapter: LoRAAdapter) -> None:
        magnitudes = adapter.magnitudes or [{}] * len(adapter.weights)
        for layer, weights, layer_magnitudes in zip(self._model.layers, adapter.weights, magnitudes):
            for projection, modules in layer.projections():
                projection.load_slot(slot, [weights.get(m) for m in modules],
                                     [layer_magnitudes.get(m) for m in modules] if layer_magnitudes else None)
