"""Adapters from name to device slot, in three tiers: disk → host cache (LRU, bounded by bytes) → device slots
(LRU, pinned).

Names come from the registry (register: name → directory) or, on demand, from the adapter directories: a name
that is not registered is looked up as `<adapter dir>/<name>/` after the name itself has been checked (no file is
touched for a bad name). Reading an adapter into the host cache runs on the loader's threads (adapter_loader.py),
once however many requests ask for it; only the copy into a device slot runs in the engine thread, between steps.
A device slot is pinned while any admitted sequence uses its adapter; only unpinned slots are evicted, so a
running sequence never loses its weights. A load that fails is remembered with the files' identity: requests for
that adapter fail at once with the same error until its files change (never retried in a loop).
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .adapter_loader import AdapterLoader, LoadResult
from .adapters import CONFIG_FILE, WEIGHTS_FILE, LoRAAdapter, check_adapter_name, load_adapter
from .config import ModelConfig
from .errors import AdapterInUseError, AdapterNotFoundError, AdapterPathError
from .model import CausalLM

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
        self._model = model
        self._cfg = cfg
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.max_cpu_lora_bytes = max_cpu_lora_bytes
        self.adapter_dirs = tuple(str(Path(d).expanduser().resolve()) for d in adapter_dirs)
        self.roots = tuple(roots) + tuple(d for d in self.adapter_dirs if d not in roots) if roots else ()
        self._device = device or torch.device("cpu")
        self._pin = self._device.type == "cuda"
        self._entries: dict[str, _Entry] = {}
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._host_bytes = 0
        self._failed: dict[str, tuple[tuple, Exception]] = {}
        self._slot_of: dict[str, int] = {}
        self._adapter_in: list[str | None] = [None] * (max_loras + 1)  # slot 0 is the base model
        self._pins = [0] * (max_loras + 1)
        self._slot_lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, max_loras + 1))
        # Bumped whenever a slot's weights change, so that what was derived from them (merged packs) is redone.
        self.slot_generation = [0] * (max_loras + 1)
        self._events: list[AdapterEvent] = []
        self._lock = threading.RLock()  # the engine thread, the event loop and the loader threads all come here
        self.loader = AdapterLoader(self._read, self._on_loaded, loader_threads)
        if self._pin:
            self._copy_stream = torch.cuda.Stream(self._device)
            self._copy_done: dict[int, tuple[torch.cuda.Event, LoRAAdapter]] = {}

    # --- registry -----------------------------------------------------------------------------------
    def read(self, name: str, path: str | Path, roots: tuple[str, ...] | None = None) -> LoRAAdapter:
        """Read and validate an adapter (any thread: no torch op; pinned on CUDA for non-blocking copies)."""
        adapter = load_adapter(name, path, self._cfg, self.max_rank, self.roots if roots is None else roots)
        if self._pin:
            adapter.weights = [{m: (a.pin_memory(), b.pin_memory()) for m, (a, b) in layer.items()}
                               for layer in adapter.weights]
        return adapter

    def _read(self, name: str, path: str | Path) -> LoRAAdapter:
        # An adapter found on demand must stay inside the adapter directories, its files too (symlinks).
        return self.read(name, path, None if self.is_registered(name) else (self.roots or self.adapter_dirs))

    def register(self, name: str, path: str) -> AdapterInfo:
        """Validate and read the adapter now (in this thread), so a bad one fails here and not in a request."""
        if not name:
            raise ValueError("adapter name must not be empty")
        return self.register_loaded(self.read(name, path))

    def register_loaded(self, adapter: LoRAAdapter) -> AdapterInfo:
        """Register an adapter read by `read` (e.g. on a loader thread). Replacing one clears its device slot:
        call between steps."""
        name = adapter.name
        with self._lock:
            if name in self._entries and self._pin_count(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by running requests; unload it first")
            self._forget(name)
            self._entries[name] = _Entry(adapter.path, replace(adapter, weights=[]), on_demand=False)
            self._cache_host(adapter)
            return self._info(name)

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._entries:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            if self._pin_count(name):
                raise AdapterInUseError(f"adapter {name!r} is in use by {self._pin_count(name)} running requests")
            self._forget(name)

    def __contains__(self, name: str) -> bool:
        """Registered or already read on demand (no file access)."""
        return name in self._entries

    def knows(self, name: str) -> bool:
        """Registered, or found in an adapter directory. Raises AdapterNameError for a name that could not be
        a directory there (before touching any file), AdapterPathError for one that leads out of it."""
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

    # --- host tier ----------------------------------------------------------------------------------
    def prefetch(self, name: str) -> Future[LoadResult] | None:
        """Start reading `name` into the host cache unless it is there (None) or in a device slot (None); the
        load under way if one is. Raises AdapterNotFoundError, AdapterNameError, or the error of an earlier
        failed load when the files have not changed since."""
        with self._lock:
            if name in self._host:
                self._host.move_to_end(name)
                return None
            if name in self._slot_of:
                return None
            entry = self._entries.get(name)
            path = entry.path if entry is not None else self._find_on_disk(name)
            if path is None:
                raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
            failed = self._failed.get(name)
            if failed is not None:
                if failed[0] == _files_identity(path):
                    raise failed[1]
                del self._failed[name]
            return self.loader.submit(name, str(path))

    def is_ready(self, name: str | None) -> bool:
        """In host memory or a device slot: admission needs no file read."""
        return not name or name in self._host or name in self._slot_of

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
                if path is not None and isinstance(result.error, Exception):
                    self._failed[name] = (_files_identity(path), result.error)
                self._events.append(AdapterEvent("load_failed", name, result.start_ns, result.end_ns))
                return
            adapter = result.adapter
            entry = self._entries.get(name)
            if entry is None:
                entry = self._entries[name] = _Entry(adapter.path, None, on_demand=True)
            if entry.path != adapter.path:  # re-registered elsewhere while this read ran
                return
            entry.meta = replace(adapter, weights=[])
            self._failed.pop(name, None)
            self._cache_host(adapter)
            self._events.append(AdapterEvent("load", name, result.start_ns, result.end_ns, adapter.nbytes))

    def _cache_host(self, adapter: LoRAAdapter) -> None:
        old = self._host.pop(adapter.name, None)
        if old is not None:
            self._host_bytes -= old.nbytes
        self._host[adapter.name] = adapter
        self._host_bytes += adapter.nbytes
        now = time.time_ns()
        # LRU by bytes; the newest always stays (an adapter larger than the budget still serves its requests).
        while self._host_bytes > self.max_cpu_lora_bytes and len(self._host) > 1:
            name, evicted = self._host.popitem(last=False)
            self._host_bytes -= evicted.nbytes
            self._events.append(AdapterEvent("evict_host", name, now, now, evicted.nbytes))

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
        device = tuple(sorted(n for n in list(self._adapter_in) if n is not None))
        return device, tuple(sorted(list(self._host)))

    def acquire(self, name: str | None) -> tuple[int, bool] | None:
        """Pin `name` in a device slot, copying it in if needed: (slot, whether this call copied it); None when
        every slot is pinned by others. An adapter in neither tier is read here, in this thread (offline use;
        the server reads it on the loader first)."""
        if not name:
            return 0, False
        with self._lock:
            if name not in self._entries and self._find_on_disk(name) is None:
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

    def can_acquire(self, name: str | None) -> bool:
        """Whether `acquire` would get a slot now (resident, or an unpinned slot to take)."""
        with self._lock:
            return not name or name in self._slot_of or self._free_slot() is not None

    def release(self, slot: int) -> None:
        if slot == 0:
            return
        with self._lock:
            self._pins[slot] -= 1
            assert self._pins[slot] >= 0, "adapter slot released more often than acquired"

    @property
    def num_free_slots(self) -> int:
        return sum(1 for s in range(1, self.max_loras + 1) if self._pins[s] == 0)

    def is_resident(self, name: str | None) -> bool:
        """In a device slot (the base model always is): admitting it takes no slot."""
        return not name or name in self._slot_of

    def device_names(self) -> list[str]:
        with self._lock:
            return sorted(self._slot_of)

    # --- telemetry ----------------------------------------------------------------------------------
    def take_events(self) -> list[AdapterEvent]:
        with self._lock:
            events, self._events = self._events, []
            return events

    def tier_counts(self) -> dict[str, int]:
        """Adapters per tier, each counted where it is fastest to use: device, else host, else disk (known only)."""
        with self._lock:
            device = len(self._slot_of)
            host = sum(1 for n in self._host if n not in self._slot_of)
            known = sum(1 for e in self._entries.values() if e.meta is not None)
            return {"device": device, "host": host, "disk": max(0, known - device - host)}

    # --- internals ----------------------------------------------------------------------------------
    def _pin_count(self, name: str) -> int:
        slot = self._slot_of.get(name)
        return self._pins[slot] if slot is not None else 0

    def _forget(self, name: str) -> None:
        self._entries.pop(name, None)
        self._failed.pop(name, None)
        old = self._host.pop(name, None)
        if old is not None:
            self._host_bytes -= old.nbytes
        slot = self._slot_of.pop(name, None)
        if slot is not None:
            self._adapter_in[slot] = None
            self.slot_generation[slot] += 1
            for layer in self._model.layers:
                for projection, _ in layer.projections():
                    projection.clear_slot(slot)

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self._host.get(name)
        if adapter is None:  # not in host memory: read (and validate) the files now
            entry = self._entries.get(name)
            path = entry.path if entry is not None else self._find_on_disk(name)
            adapter = self._read(name, path)
            if entry is None:
                self._entries[name] = _Entry(adapter.path, replace(adapter, weights=[]), on_demand=True)
            elif entry.meta is None:
                entry.meta = replace(adapter, weights=[])
            self._cache_host(adapter)
        else:
            self._host.move_to_end(name)
        return adapter

    def _load_into(self, slot: int, adapter: LoRAAdapter) -> None:
        start_ns = time.time_ns()
        evicted = self._adapter_in[slot]
        if evicted is not None:
            del self._slot_of[evicted]
            self._events.append(AdapterEvent("evict_device", evicted, start_ns, start_ns))
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
        self._slot_of[adapter.name] = slot
        self.slot_generation[slot] += 1
        self._events.append(AdapterEvent("device_copy", adapter.name, start_ns, time.time_ns(), adapter.nbytes))

    def _copy_layers(self, slot: int, adapter: LoRAAdapter) -> None:
        for layer, weights in zip(self._model.layers, adapter.weights):
            for projection, modules in layer.projections():
                projection.load_slot(slot, [weights.get(m) for m in modules])

    def _info(self, name: str) -> AdapterInfo:
        entry = self._entries[name]
        meta, slot = entry.meta, self._slot_of.get(name)
        host = self._host.get(name)
        tier = "device" if slot is not None else ("host" if host is not None else "disk")
        return AdapterInfo(name, str(entry.path), meta.rank, meta.alpha, meta.target_modules, slot,
                           self._pin_count(name), tier, entry.on_demand, host.nbytes if host is not None else 0)
