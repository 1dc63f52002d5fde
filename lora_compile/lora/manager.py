"""Adapters from name to device slot, in three tiers: disk → host cache (LRU, bounded by bytes) → device slots
(LRU, pinned).

Names come from the registry (register: name → directory) or, on demand, from the adapter directories: a name
that is not registered is looked up as `<adapter dir>/<name>/` after the name itself has been checked (no file is
touched for a bad name). Reading an adapter into the host cache runs on the loader's threads (loader.py),
once however many requests ask for it; only the copy into a device slot runs in the engine thread, between steps.
A device slot is pinned while any admitted sequence uses its adapter; only unpinned slots are evicted, so a
running sequence never loses its weights (the slots themselves: slots.py). A load that fails is remembered
with the files' identity: requests for that adapter fail at once with the same error until its files change
(never retried in a loop); so is an adapter whose weights overflow at run time (mark_failed), a registered one
until it is registered again or unloaded.

Paths: an adapter that LoadAdapter registers must lie under a root (`roots`: --adapter-root and --adapter-dir)
whenever any is set; adapters the operator registers at start (`register(..., confined=False)`) may lie anywhere.
Each entry keeps the roots it was confined to, and its files are held to them whenever they are read again.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..config import ModelConfig
from ..errors import AdapterError, AdapterInUseError, AdapterNotFoundError, AdapterNotReadyError, AdapterPathError
from ..kv_cache.hashing import BASE_MODEL_KEY
from ..model.causal_lm import CausalLM
from .adapters import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapter, check_adapter_name, load_adapter
from .loader import AdapterLoader, LoadResult
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


@dataclass(frozen=True)
class AdapterEvent:
    """What the manager did, for telemetry: "load" (disk read + validation, fields start/end), "load_failed",
    "device_copy" (into a slot, between steps), "evict_host", "evict_device"."""

    kind: str
    name: str
    start_ns: int
    end_ns: int
    nbytes: int = 0


@dataclass
class _Entry:
    path: Path
    meta: LoRAAdapter | None  # weights dropped; None until an on-demand adapter was read once
    on_demand: bool
    roots: tuple[str, ...]    # its files must stay under these whenever they are read (empty: anywhere)


def _files_identity(path: Path) -> tuple:
    """Changes when the adapter's files are replaced or edited (a failed load is retried only then)."""
    out = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (path / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class LoRAManager:
    def __init__(self, model: CausalLM, cfg: ModelConfig, max_loras: int, max_rank: int,
                 max_cpu_lora_bytes: int, roots: tuple[str, ...] = (), adapter_dirs: tuple[str, ...] = (),
                 loader_threads: int = 2, device: torch.device | None = None):
        self._cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_lora_bytes = max_cpu_lora_bytes
        self.adapter_dirs = tuple(str(Path(d).expanduser().resolve()) for d in adapter_dirs)
        # Every adapter directory is an adapter root too: with either set, LoadAdapter stays inside them.
        self.roots = tuple(dict.fromkeys((*roots, *self.adapter_dirs)))
        self._device = device or torch.device("cpu")
        self._pin = self._device.type == "cuda"
        self._entries: dict[str, _Entry] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._host_bytes = 0
        # name: (files' identity, or None for "until registered again or unloaded"; the error its requests get)
        self._failed: dict[str, tuple[tuple | None, AdapterError]] = {}
        self._slots = DeviceSlots(model, max_loras, self._device)
        self.slot_generation = self._slots.generation
        self._events: list[AdapterEvent] = []
        self._lock = threading.RLock()  # the engine thread, the event loop and the loader threads all come here
        self.loader = AdapterLoader(self._read, self._on_loaded, loader_threads)

    # --- registry -----------------------------------------------------------------------------------
    def read(self, name: str, path: str | Path, roots: tuple[str, ...] | None = None) -> LoRAAdapter:
        """Read and validate an adapter (any thread: no torch op; pinned on CUDA for non-blocking copies), its
        files under `roots` (None: the manager's roots; empty: anywhere). The name follows the one rule
        (adapters.check_adapter_name) whatever the source."""
        check_adapter_name(name)
        adapter = load_adapter(name, path, self._cfg, self.max_rank, self.roots if roots is None else roots)
        if self._pin:
            adapter.weights = [{m: (a.pin_memory(), b.pin_memory()) for m, (a, b) in layer.items()}
                               for layer in adapter.weights]
        return adapter

    def _read(self, name: str, path: str | Path) -> LoRAAdapter:
        # A registered adapter is held to the roots it was registered under; one found on demand must stay
        # inside the adapter directories, its files too (symlinks).
        entry = self._entries.get(name)
        return self.read(name, path, entry.roots if entry is not None and not entry.on_demand else self.adapter_dirs)

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
            if name in self._entries and self._slots.pins_of(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by running requests; unload it first")
            self._forget(name)
            self._entries[name] = _Entry(adapter.path, replace(adapter, weights=[]), on_demand=False,
                                         roots=self.roots if roots is None else roots)
            self._cache_host(adapter)
            return self._info(name)

    def unregister(self, name: str) -> None:
        check_adapter_name(name)
        with self._lock:
            if name not in self._entries:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            if self._slots.pins_of(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by {self._slots.pins_of(name)} running requests")
            self._forget(name)

    def __contains__(self, name: str) -> bool:
        """Registered or already read on demand (no file access)."""
        return name in self._entries

    def knows(self, name: str) -> bool:
        """Registered, or found in an adapter directory. Raises AdapterNameError for a name that could not be
        a directory there (before touching any file), AdapterPathError for one that leads out of it."""
        check_adapter_name(name)  # (a name the rule refuses is no adapter's, registered or on disk)
        return name in self._entries or self._find_on_disk(name) is not None

    def is_registered(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and not entry.on_demand

    def list(self) -> list[AdapterInfo]:
        with self._lock:
            return [self._info(n) for n in sorted(self._entries) if self._entries[n].meta is not None]

    def _find_on_disk(self, name: str) -> Path | None:
        if not self.adapter_dirs:
            return None
        check_adapter_name(name)
        for root in self.adapter_dirs:
            candidate = Path(root) / name
            resolved = candidate.resolve()
            if not resolved.is_relative_to(root):  # a symlink out of the adapter directory
                raise AdapterPathError(f"adapter {name!r}: {candidate} leads outside the adapter directory {root}")
            if (resolved / CONFIG_FILE).is_file():
                return resolved
        return None

    # --- failures -----------------------------------------------------------------------------------
    def mark_failed(self, name: str, error: AdapterError) -> None:
        """`name` was read but is bad (e.g. its weights overflow at run time): its requests fail with `error`
        from now on, until its files change (found on demand) or it is registered again or unloaded."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None:
                return
            self._failed[name] = (_files_identity(entry.path) if entry.on_demand else None, error)
            self._drop_host(name)

    def _check_failed(self, name: str) -> None:
        """Raise the remembered failure of `name`, unless its files changed since (then forget it)."""
        failed = self._failed.get(name)
        if failed is None:
            return
        identity, error = failed
        entry = self._entries.get(name)
        path = entry.path if entry is not None else self._find_on_disk(name)
        # (a slot still pinned holds the old weights: the failure stands until it is released)
        if identity is None or (path is not None and identity == _files_identity(path)) or self._slots.pins_of(name):
            raise error.with_traceback(None)  # (raised again and again: no traceback piling up)
        del self._failed[name]  # (the files changed: whatever was read of them before goes)
        self._drop_host(name)
        self._slots.forget(name)  # (no torch op: this may be the event loop)

    # --- host tier ----------------------------------------------------------------------------------
    def prefetch(self, name: str) -> Future[LoadResult] | None:
        """Start reading `name` into the host cache unless it is there (None) or in a device slot (None); the
        load under way if one is. Raises AdapterNotFoundError, AdapterNameError, or the error of an earlier
        failure when the files have not changed since."""
        with self._lock:
            self._check_failed(name)
            if name in self._host:
                self._host.move_to_end(name)
                return None
            if name in self._slots.slot_of:
                return None
            entry = self._entries.get(name)
            path = entry.path if entry is not None else self._find_on_disk(name)
            if path is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            return self.loader.submit(name, str(path))

    def is_ready(self, name: str | None) -> bool:
        """In host memory or a device slot, and not failed: admission needs no file read."""
        return not name or (name not in self._failed and (name in self._host or name in self._slots.slot_of))

    def _on_loaded(self, result: LoadResult) -> None:
        """In the loader thread, before the load's future resolves."""
        with self._lock:
            name = result.name
            if result.error is not None:
                entry = self._entries.get(name)
                path = entry.path if entry is not None else None
                if path is None:
                    try:
                        path = self._find_on_disk(name)
                    except Exception:  # noqa: BLE001 - gone meanwhile: remember nothing
                        path = None
                # The adapter's own fault is remembered; anything else (e.g. MemoryError) may pass: read again.
                if path is not None and isinstance(result.error, AdapterError):
                    self._failed[name] = (_files_identity(path), result.error)
                self._events.append(AdapterEvent("load_failed", name, result.start_ns, result.end_ns))
                return
            adapter = result.adapter
            entry = self._entries.get(name)
            if entry is None:
                entry = self._entries[name] = _Entry(adapter.path, None, on_demand=True, roots=self.adapter_dirs)
            if entry.path != adapter.path:  # re-registered elsewhere while this read ran
                return
            entry.meta = replace(adapter, weights=[])
            self._failed.pop(name, None)
            self._cache_host(adapter)
            self._events.append(AdapterEvent("load", name, result.start_ns, result.end_ns, adapter.nbytes))

    def _cache_host(self, adapter: LoRAAdapter) -> None:
        self._drop_host(adapter.name)
        self._host[adapter.name] = adapter
        self._host_bytes += adapter.nbytes
        now = time.time_ns()
        # LRU by bytes; the newest always stays (an adapter larger than the budget still serves its requests).
        while self._host_bytes > self.max_cpu_lora_bytes and len(self._host) > 1:
            name, evicted = self._host.popitem(last=False)
            self._host_bytes -= evicted.nbytes
            self._events.append(AdapterEvent("evict_host", name, now, now, evicted.nbytes))

    def _drop_host(self, name: str) -> None:
        old = self._host.pop(name, None)
        if old is not None:
            self._host_bytes -= old.nbytes

    @property
    def host_bytes(self) -> int:
        return self._host_bytes

    def host_names(self) -> list[str]:
        """Host cache, least recently used first."""
        with self._lock:
            return list(self._host)

    # --- device slots -------------------------------------------------------------------------------
    def residency(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(adapters in a device slot, adapters whose weights are in host memory), each sorted; lock-free
        snapshot for metrics (a copy of two small containers)."""
        return self._slots.residents(), tuple(sorted(list(self._host)))

    def acquire(self, name: str | None, read: bool = True) -> tuple[int, bool] | None:
        """Pin `name` in a device slot, copying it in if needed: (slot, whether this call copied it); None when
        every slot is pinned by others. An adapter in neither tier is read here, in this thread (offline use);
        read=False (the server, which reads on the loader): AdapterNotReadyError instead."""
        if not name:
            return 0, False
        with self._lock:
            if name not in self._entries and self._find_on_disk(name) is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            self._check_failed(name)
            slot = self._slots.slot_of.get(name)
            loaded = slot is None
            if loaded:
                slot = self._slots.free_slot()
                if slot is None:
                    return None
                self._load_into(slot, self._host_copy(name, read))
            self._slots.pin(slot)
            return slot, loaded

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
            events, self._events = self._events, []
            return events

    def tier_counts(self) -> dict[str, int]:
        """Adapters per tier, each counted where it is fastest to use: device, else host, else disk (known only)."""
        with self._lock:
            device = len(self._slots.slot_of)
            host = sum(1 for n in self._host if n not in self._slots.slot_of)
            known = sum(1 for e in self._entries.values() if e.meta is not None)
            return {"device": device, "host": host, "disk": max(0, known - device - host)}

    # --- internals ----------------------------------------------------------------------------------
    def _forget(self, name: str) -> None:
        self._entries.pop(name, None)
        self._failed.pop(name, None)
        self._drop_host(name)
        self._slots.drop(name)

    def _host_copy(self, name: str, read: bool) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # not in host memory: read (and validate) the files now
            if not read:
                raise AdapterNotReadyError(f"adapter {name!r} is not in host memory")
            entry = self._entries.get(name)
            path = entry.path if entry is not None else self._find_on_disk(name)
            adapter = self._read(name, path)
            if entry is None:
                self._entries[name] = _Entry(adapter.path, replace(adapter, weights=[]), on_demand=True,
                                             roots=self.adapter_dirs)
            elif entry.meta is None:
                entry.meta = replace(adapter, weights=[])
            self._cache_host(adapter)
        else:
            self._host.move_to_end(name)
        return adapter

    def _load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        start_ns = time.time_ns()
        evicted = self._slots.load(slot, adapter)
        if evicted is not None:
            self._events.append(AdapterEvent("evict_device", evicted, start_ns, start_ns))
        self._events.append(AdapterEvent("device_copy", adapter.name, start_ns, time.time_ns(), adapter.nbytes))

    def _info(self, name: str) -> AdapterInfo:
        entry = self._entries[name]
        meta, slot = entry.meta, self._slots.slot_of.get(name)
        host = self._host.get(name)
        tier = "device" if slot is not None else ("host" if host is not None else "disk")
        return AdapterInfo(name, str(entry.path), meta.rank, meta.alpha, meta.target_modules, slot,
                           self._slots.pins_of(name), tier, entry.on_demand, host.nbytes if host is not None else 0)
