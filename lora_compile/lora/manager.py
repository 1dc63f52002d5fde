"""Adapters from name to device slot, in three tiers: disk → host cache → device slots; the one front the engine
and the scheduler call, under one lock (the engine thread, the event loop and the loader threads all come here).

Each tier and concern has a file of its own, this one only composes them:
- registry.py: name → directory and metadata, on-demand lookup in the adapter directories, path confinement;
- loader.py: reads on a small thread pool, once however many requests ask (single-flight);
- host_cache.py: weights in host memory, LRU by bytes;
- slots.py: the device slots (LRU, pinned while an admitted sequence uses them; only unpinned ones are evicted,
  so a running sequence never loses its weights); the copy into a slot runs in the engine thread, between steps;
- quarantine.py: failed adapters, refused at once until their files change;
- mixes.py: weighted mixes, composed from their members' host copies into a slot of their own;
- events.py: what happened, for telemetry.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import AdapterError, AdapterInUseError, AdapterNotFoundError, AdapterNotReadyError
from ..kv_cache.hashing import BASE_MODEL_KEY
from ..model.causal_lm import CausalLM
from .adapters import LoRAAdapter, activation_start, check_adapter_name, load_adapter
from .events import AdapterEvent, AdapterEventLog
from .host_cache import HostCache
from .loader import AdapterLoader, LoadResult, gather
from .mixes import AdapterMix, check_members, compose
from .quarantine import Quarantine
from .registry import AdapterRegistry
from .slots import DeviceSlots

TIERS = ("disk", "host", "device")


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    device_slot: int | None
    active_sequences: int
    tier: str = "disk"          # where its weights are now: "device" (a slot), "host" (the cache) or "disk"
    on_demand: bool = False     # found in an adapter directory (not registered)
    host_bytes: int = 0
    id: int = 0                 # its number for the server's life (llama.cpp's /lora-adapters ids)


class LoRAManager:
    def __init__(self, model: CausalLM, cfg: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_lora_bytes: int, roots: tuple[str, ...] = (), adapter_dirs: tuple[str, ...] = (),
                 loader_threads: int = 2, device: torch.device | None = None, dora: bool = True):
        self._cfg = cfg
        self._dora = dora  # False: DoRA adapters are refused (a quantized base: no full-width rows to take norms of)
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._device = device or torch.device("cpu")
        self._pin = self._device.type == "cuda"
        self._registry = AdapterRegistry(roots, adapter_dirs)
        self.roots, self.adapter_dirs = self._registry.roots, self._registry.adapter_dirs
        self._host = HostCache(max_cpu_lora_bytes)
        self._quarantine = Quarantine()
        self._slots = DeviceSlots(model, max_loras, self._device)
        self.slot_generation = self._slots.generation
        self._events = AdapterEventLog()
        self._lock = threading.RLock()
        self.loader = AdapterLoader(self._read, self._on_loaded, loader_threads)

    @property
    def max_cpu_lora_bytes(self) -> int:
        return self._host.max_bytes

    # --- registry -----------------------------------------------------------------------------------
    def read(self, name: str, path: str | Path, roots: tuple[str, ...] | None = None) -> LoRAAdapter:
        """Read and validate an adapter (any thread: no torch op; pinned on CUDA for non-blocking copies), its
        files under `roots` (None: the manager's roots; empty: anywhere). The name follows the one rule
        (adapters.check_adapter_name) whatever the source."""
        check_adapter_name(name)
        adapter = load_adapter(name, path, self._cfg, self.max_rank, self.roots if roots is None else roots,
                               self._dora)
        if self._pin:
            adapter.weights = [{m: (a.pin_memory(), b.pin_memory()) for m, (a, b) in layer.items()}
                               for layer in adapter.weights]
            if adapter.magnitudes is not None:
                adapter.magnitudes = [{m: v.pin_memory() for m, v in layer.items()} for layer in adapter.magnitudes]
        return adapter

    def _read(self, name: str, path: str | Path) -> LoRAAdapter:
        return self.read(name, path, self._registry.read_roots(name))

    def register(self, name: str, path: str, *, confined: bool = True) -> AdapterInfo:
        """Validate and read the adapter now (in this thread), so a bad one fails here and not in a request.
        confined=False: the operator's own adapter (--adapter at start), which need not lie under the roots."""
        if not name:
            raise ValueError("adapter name must not be empty")
        roots = self.roots if confined else ()
        return self.register_loaded(self.read(name, path, roots), roots)

    def register_loaded(self, adapter: LoRAAdapter, roots: tuple[str, ...] | None = None) -> AdapterInfo:
        """Register an adapter read by `read` under `roots` (None: the manager's) (e.g. on a loader thread).
        Replacing one clears its device slot: call between steps."""
        name = adapter.name
        with self._lock:
            if name in self._registry and self._pins_with(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by running requests; unload it first")
            self._forget(name)
            self._registry.add(adapter, roots)
            self._cache_host(adapter)
            return self._info(name)

    def unregister(self, name: str) -> None:
        check_adapter_name(name)
        with self._lock:
            if name not in self._registry:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            if pins := self._pins_with(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by {pins} running requests")
            self._forget(name)

    def __contains__(self, name: str) -> bool:
        """Registered or already read on demand (no file access)."""
        return name in self._registry

    def knows(self, name: str) -> bool:
        """Registered, or found in an adapter directory. Raises AdapterNameError for a name that could not be
        a directory there (before touching any file), AdapterPathError for one that leads out of it."""
        check_adapter_name(name)  # (a name the rule refuses is no adapter's, registered or on disk)
        return name in self._registry or self._registry.find_on_disk(name) is not None

    def is_registered(self, name: str) -> bool:
        return self._registry.is_registered(name)

    def name_of(self, adapter_id: int) -> str | None:
        """The known adapter numbered `adapter_id` (AdapterInfo.id), if any."""
        with self._lock:
            return self._registry.name_of(adapter_id)

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(n) for n in self._registry.known_names()]

    # --- failures -----------------------------------------------------------------------------------
    def mark_failed(self, name: str, error: AdapterError) -> None:
        """`name` was read but is bad (e.g. its weights overflow at run time): its requests fail with `error`
        from now on, until its files change (found on demand) or it is registered again or unloaded."""
        with self._lock:
            entry = self._registry.get(name)
            if entry is None:
                return
            self._quarantine.add(name, entry.path if entry.on_demand else None, error)
            self._host.drop(name)

    def _check_failed(self, name: str) -> None:
        """Raise the remembered failure of `name`, unless its files changed since (then forget it)."""
        if name not in self._quarantine:
            return
        if self._quarantine.check(name, self._registry.path_of(name), pinned=bool(self._pins_with(name))):
            self._host.drop(name)     # (the files changed: whatever was read of them before goes)
            for gone in (name, *self._mixes_with(name)):
                self._slots.forget(gone)  # (no torch op: this may be the event loop)

    # --- host tier ----------------------------------------------------------------------------------
    def prefetch(self, name: str) -> Future[LoadResult] | None:
        """Start reading `name` into the host cache unless it is there (None) or in a device slot (None); the
        load under way if one is. Raises AdapterNotFoundError, AdapterNameError, or the error of an earlier
        failure when the files have not changed since."""
        mix = AdapterMix.parse(name)
        if mix is not None:
            with self._lock:
                for member in mix.names:
                    self._check_failed(member)
                if name in self._slots.slot_of:
                    return None
                futures = [f for f in map(self.prefetch, mix.names) if f is not None]
            return gather(name, futures) if futures else None
        with self._lock:
            self._check_failed(name)
            if self._host.get(name) is not None or name in self._slots.slot_of:
                return None
            path = self._registry.path_of(name)
            if path is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            return self.loader.submit(name, str(path))

    def is_ready(self, name: str | None) -> bool:
        """In host memory or a device slot, and not failed: admission needs no file read. A mix: in a slot, or
        every member ready."""
        if not name:
            return True
        mix = AdapterMix.parse(name)
        if mix is not None:  # a failed member fails the mix, even one in a slot (prefetch raises its error)
            if any(m in self._quarantine for m in mix.names):
                return False
            return name in self._slots.slot_of or all(map(self.is_ready, mix.names))
        return name not in self._quarantine and (name in self._host or name in self._slots.slot_of)

    def _on_loaded(self, result: LoadResult) -> None:
        """In the loader thread, before the load's future resolves."""
        with self._lock:
            name = result.name
            if result.error is not None:
                try:
                    path = self._registry.path_of(name)
                except Exception:  # noqa: BLE001 - gone meanwhile: remember nothing
                    path = None
                # The adapter's own fault is remembered; anything else (e.g. MemoryError) may pass: read again.
                if path is not None and isinstance(result.error, AdapterError):
                    self._quarantine.add(name, path, result.error)
                self._events.add("load_failed", name, result.start_ns, result.end_ns)
                return
            adapter = result.adapter
            if not self._registry.note_read(adapter):  # re-registered elsewhere while this read ran
                return
            self._quarantine.forget(name)
            self._cache_host(adapter)
            self._events.add("load", name, result.start_ns, result.end_ns, adapter.nbytes)

    def _cache_host(self, adapter: LoRAAdapter) -> None:
        now = time.time_ns()
        for evicted in self._host.put(adapter):
            self._events.add("evict_host", evicted.name, now, now, evicted.nbytes)

    @property
    def host_bytes(self) -> int:
        return self._host.nbytes

    def host_names(self) -> list[str]:
        """Host cache, least recently used first."""
        with self._lock:
            return self._host.names()

    # --- device slots -------------------------------------------------------------------------------
    def residency(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(adapters in a device slot, adapters whose weights are in host memory), each sorted; lock-free
        snapshot for metrics (a copy of two small containers)."""
        return self._slots.residents(), tuple(sorted(self._host.names()))

    def acquire(self, name: str | None, read: bool = True) -> tuple[int, bool] | None:
        """Pin `name` in a device slot, copying it in if needed: (slot, whether this call copied it); None when
        every slot is pinned by others. An adapter in neither tier is read here, in this thread (offline use);
        read=False (the server, which reads on the loader): AdapterNotReadyError instead."""
        if not name:
            return 0, False
        with self._lock:
            mix = AdapterMix.parse(name)
            for member in mix.names if mix is not None else (name,):
                if member not in self._registry and self._registry.find_on_disk(member) is None:
                    raise AdapterNotFoundError(f"adapter {member!r} is not loaded")
                self._check_failed(member)
            slot = self._slots.slot_of.get(name)
            loaded = slot is None
            if loaded:
                slot = self._slots.free_slot()
                if slot is None:
                    return None
                if mix is None:
                    adapter = self._host_copy(name, read)
                else:  # composed from the members' host copies (a concatenation: the size of one slot copy)
                    adapter = compose(mix, [self._host_copy(m, read) for m in mix.names], self.max_rank)
                self._load_into(slot, adapter)
            self._slots.pin(slot)
            return slot, loaded

    def activation_start(self, name: str | None, prompt_ids: list[int]) -> int:
        """Where `name` starts acting on a sequence with this prompt (0 but for an activated LoRA); the adapter has
        been read (acquire)."""
        entry = self._registry.get(name) if name else None
        meta = entry.meta if entry is not None else None
        return activation_start(prompt_ids, meta.invocation_tokens if meta is not None else None)

    def check_mix(self, mix: AdapterMix) -> None:
        """Raise AdapterMixError now where the members already read show that `mix` cannot be served (ranks over
        max_lora_rank, an activated or DoRA member); members never read yet are checked when the mix is composed."""
        with self._lock:
            entries = [self._registry.get(m) for m in mix.names]
            known = [e.meta for e in entries if e is not None and e.meta is not None]
        check_members(known, self.max_rank)  # (the known members' ranks alone may already add up past the limit)

    def cache_key(self, slot: int) -> bytes:
        """The prefix cache's key for KV computed with `slot`'s weights (slot 0: the base model)."""
        if slot == 0:
            return BASE_MODEL_KEY
        key = self._slots.cache_key[slot]
        assert key is not None, "cache key of an empty adapter slot"
        return key

    def can_acquire(self, name: str | None) -> bool:
        """Whether `acquire` would get a slot now (resident, or an unpinned slot to take)."""
        with self._lock:
            return not name or name in self._slots.slot_of or self._slots.free_slot() is not None

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        with self._lock:
            self._slots.release(slot)

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    def is_resident(self, name: str | None) -> bool:
        """In a device slot (the base model always is): admitting it takes no slot."""
        return not name or name in self._slots.slot_of

    def device_names(self) -> list[str]:
        with self._lock:
            return sorted(self._slots.slot_of)

    # --- telemetry ----------------------------------------------------------------------------------
    def take_events(self) -> list[AdapterEvent]:
        with self._lock:
            return self._events.take()

    def tier_counts(self) -> dict[str, int]:
        """Adapters per tier, each counted where it is fastest to use: device, else host, else disk (known only)."""
        with self._lock:
            device = sum(1 for n in self._slots.slot_of if AdapterMix.parse(n) is None)  # (mixes are no adapter)
            host = sum(1 for n in self._host.names() if n not in self._slots.slot_of)
            known = len(self._registry.known_names())
            return {"device": device, "host": host, "disk": max(0, known - device - host)}

    # --- internals ----------------------------------------------------------------------------------
    def _forget(self, name: str) -> None:
        self._registry.remove(name)
        self._quarantine.forget(name)
        self._host.drop(name)
        for gone in (name, *self._mixes_with(name)):  # a mix holds the member's old weights: composed anew
            self._slots.drop(gone)

    def _mixes_with(self, name: str) -> list[str]:
        """The mixes in a device slot that have `name` among their members."""
        return [n for n in list(self._slots.slot_of) if (m := AdapterMix.parse(n)) is not None and name in m.names]

    def _pins_with(self, name: str) -> int:
        """Running sequences that use `name`, alone or in a mix."""
        return self._slots.pins_of(name) + sum(self._slots.pins_of(m) for m in self._mixes_with(name))

    def _host_copy(self, name: str, read: bool) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # not in host memory: read (and validate) the files now
            if not read:
                raise AdapterNotReadyError(f"adapter {name!r} is not in host memory")
            adapter = self._read(name, self._registry.path_of(name))
            self._registry.note_read(adapter)
            self._cache_host(adapter)
        return adapter

    def _load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        start_ns = time.time_ns()
        evicted = self._slots.load(slot, adapter)
        if evicted is not None:
            self._events.add("evict_device", evicted, start_ns, start_ns)
        self._events.add("device_copy", adapter.name, start_ns, time.time_ns(), adapter.nbytes)

    def _info(self, name: str) -> AdapterInfo:
        entry = self._registry.get(name)
        meta, slot = entry.meta, self._slots.slot_of.get(name)
        host = self._host.peek(name)
        tier = "device" if slot is not None else ("host" if host is not None else "disk")
        return AdapterInfo(name, str(entry.path), meta.rank, meta.alpha, meta.target_modules, slot,
                           self._slots.pins_of(name), tier, entry.on_demand, host.nbytes if host is not None else 0,
                           self._registry.id_of(name))
