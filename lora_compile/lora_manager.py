"""Adapters from name to device slot: registry (name → dir) → host cache (LRU) → device slots (LRU, pinned).

A device slot is pinned while any admitted sequence uses its adapter; only unpinned slots are evicted,
so a running sequence never loses its weights.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

from .adapters import LoRAAdapter, load_adapter
from .config import ModelConfig
from .errors import AdapterInUseError, AdapterNotFoundError
from .model import CausalLM


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    device_slot: int | None
    active_sequences: int


class LoRAManager:
    def __init__(self, model: CausalLM, cfg: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_loras: int, roots: tuple[str, ...] = ()):
        self._model = model
        self._cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self.roots = roots
        self._paths: dict[str, Path] = {}
        self._meta: dict[str, LoRAAdapter] = {}           # weights dropped when evicted from the host cache
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._slot_of: dict[str, int] = {}
        self._adapter_in: list[str | None] = [None] * (max_loras + 1)  # slot 0 is the base model
        self._pins = [0] * (max_loras + 1)
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))
        # Bumped whenever a slot's weights change, so that what was derived from them (merged packs) is redone.
        self.slot_generation = [0] * (max_loras + 1)
        self._lock = threading.Lock()  # library callers may register/unregister from any thread

    # --- registry -----------------------------------------------------------------------------------
    def register(self, name: str, path: str) -> AdapterInfo:
        """Validate and read the adapter now, so a bad one fails here and not in a request."""
        if not name:
            raise ValueError("adapter name must not be empty")
        adapter = load_adapter(name, path, self._cfg, self.max_rank, self.roots)
        with self._lock:
            if name in self._paths and self._pin_count(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by running requests; unload it first")
            self._forget(name)
            self._paths[name] = adapter.path
            self._meta[name] = replace(adapter, weights=[])  # metadata only; weights live in _host
            self._cache_host(adapter)
            return self._info(name)

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._paths:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            if self._pin_count(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by {self._pin_count(name)} running requests")
            self._forget(name)

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(n) for n in sorted(self._paths)]

    # --- device slots -------------------------------------------------------------------------------
    def residency(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(adapters in a device slot, adapters whose weights are in host memory), each sorted; lock-free
        snapshot for metrics (a copy of two small containers)."""
        device = tuple(sorted(n for n in list(self._adapter_in) if n is not None))
        return device, tuple(sorted(list(self._host)))

    def acquire(self, name: str | None) -> tuple[int, bool] | None:
        """Pin `name` in a device slot, loading it if needed: (slot, whether this call loaded it); None when
        every slot is pinned by others."""
        if not name:
            return 0, False
        with self._lock:
            if name not in self._paths:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            slot = self._slot_of.get(name)
            loaded = slot is None
            if loaded:
                slot = self._free_slot()
                if slot is None:
                    return None
                self._load_into(slot, self._host_copy(name))
            self._pins[slot] += 1
            self._slot_lru.move_to_end(slot)
            return slot, loaded

    def _free_slot(self) -> int | None:
        """The lowest empty slot, else the least recently used unpinned one."""
        empty = next((s for s in range(1, self.max_loras + 1) if self._adapter_in[s] is None), None)
        if empty is not None:
            return empty
        return next((s for s in self._slot_lru if self._pins[s] == 0), None)

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        with self._lock:
            self._pins[slot] -= 1
            assert self._pins[slot] >= 0, "adapter slot released more often than acquired"

    @property
    def num_free_slots(self) -> int:
        return sum(1 for s in range(1, self.max_loras + 1) if self._pins[s] == 0)

    # --- internals ----------------------------------------------------------------------------------
    def _pin_count(self, name: str) -> int:
        slot = self._slot_of.get(name)
        return self._pins[slot] if slot is not None else 0

    def _forget(self, name: str) -> None:
        self._paths.pop(name, None)
        self._meta.pop(name, None)
        self._host.pop(name, None)
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._adapter_in[slot] = None
            self.slot_generation[slot] += 1
            for layer in self._model.layers:
                for projection, _ in layer.projections():
                    projection.clear_slot(slot)

    def _cache_host(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # evicted from host memory: read (and validate) the files again
            adapter = load_adapter(name, self._paths[name], self._cfg, self.max_rank, self.roots)
            self._cache_host(adapter)
        else:
            self._host.move_to_end(name)
        return adapter

    def _load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        evicted = self._adapter_in[slot]
        if evicted is not None:
            del self._slot_of[evicted]
        for layer, weights in zip(self._model.layers, adapter.weights):
            for projection, modules in layer.projections():
                projection.load_slot(slot, [weights.get(m) for m in modules])
        self._adapter_in[slot] = adapter.name
        self._slot_of[adapter.name] = slot
        self.slot_generation[slot] += 1

    def _info(self, name: str) -> AdapterInfo:
        meta = self._meta[name]
        return AdapterInfo(name, str(self._paths[name]), meta.rank, meta.alpha, meta.target_modules,
                           self._slot_of.get(name), self._pin_count(name))

