"""The adapter registry: name → where its files are and what they hold (rank, alpha, targets; no weights).

A name comes from `register` (the operator at start, or LoadAdapter) or, on demand, from the adapter directories:
a name that is not registered is looked up as `<adapter dir>/<name>/` after the name itself has been checked (no
file is touched for a bad name).

Paths: an adapter that LoadAdapter registers must lie under a root (`roots`: --adapter-root and --adapter-dir)
whenever any is set; adapters the operator registers at start (confined=False) may lie anywhere. Each entry keeps
the roots it was confined to, and its files are held to them whenever they are read again.

Not locked on its own: LoRAManager calls it under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import AdapterPathError
from .adapters import CONFIG_FILE, LoRAAdapter, check_adapter_name


@dataclass
class AdapterEntry:
    path: Path
    meta: LoRAAdapter | None  # weights dropped; None until an on-demand adapter was read once
    on_demand: bool
    roots: tuple[str, ...]    # its files must stay under these whenever they are read (empty: anywhere)


def _without_weights(adapter: LoRAAdapter) -> LoRAAdapter:
    """What the registry keeps of an adapter read: its facts, not its tensors (the host cache holds those)."""
    return replace(adapter, weights=[], magnitudes=None if adapter.magnitudes is None else [])


class AdapterRegistry:
    def __init__(self, roots: tuple[str, ...] = (), adapter_dirs: tuple[str, ...] = ()):
        self.adapter_dirs = tuple(str(Path(d).expanduser().resolve()) for d in adapter_dirs)
        # Every adapter directory is an adapter root too: with either set, LoadAdapter stays inside them.
        self.roots = tuple(dict.fromkeys((*roots, *self.adapter_dirs)))
        self._entries: dict[str, AdapterEntry] = {}
        # A number per name, given when the name is first registered or read and kept for the process's life (a
        # name unloaded and loaded again keeps it): what llama.cpp's /lora-adapters and per-request `lora` use.
        self._ids: dict[str, int] = {}
        self._names: list[str] = []  # the reverse: _names[id]

    def __contains__(self, name: str) -> bool:
        """Registered or already read on demand (no file access)."""
        return name in self._entries

    def get(self, name: str) -> AdapterEntry | None:
        return self._entries.get(name)

    def is_registered(self, name: str) -> bool:
        entry = self._entries.get(name)
        return entry is not None and not entry.on_demand

    def add(self, adapter: LoRAAdapter, roots: tuple[str, ...] | None) -> None:
        """Register `adapter` (read under `roots`; None: the registry's)."""
        self._entries[adapter.name] = AdapterEntry(adapter.path, _without_weights(adapter), on_demand=False,
                                                   roots=self.roots if roots is None else roots)
        self._number(adapter.name)

    def note_read(self, adapter: LoRAAdapter) -> bool:
        """An adapter was read from disk: remember what it holds (an on-demand one gets its entry now). False when
        its name was registered elsewhere meanwhile (the read is stale)."""
        entry = self._entries.get(adapter.name)
        if entry is None:
            entry = self._entries[adapter.name] = AdapterEntry(adapter.path, None, on_demand=True,
                                                               roots=self.adapter_dirs)
        if entry.path != adapter.path:
            return False
        entry.meta = _without_weights(adapter)
        self._number(adapter.name)
        return True

    def _number(self, name: str) -> None:
        if name not in self._ids:
            self._ids[name] = len(self._names)
            self._names.append(name)

    def id_of(self, name: str) -> int:
        """The name's number (known_names' adapters all have one)."""
        return self._ids[name]

    def name_of(self, adapter_id: int) -> str | None:
        """The known adapter with this number, if any."""
        name = self._names[adapter_id] if 0 <= adapter_id < len(self._names) else None
        entry = self._entries.get(name) if name is not None else None
        return name if entry is not None and entry.meta is not None else None

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    def known_names(self) -> list[str]:
        """Sorted; those read at least once (an on-demand name found but never read has nothing to report)."""
        return sorted(n for n, e in self._entries.items() if e.meta is not None)

    def read_roots(self, name: str) -> tuple[str, ...]:
        """Where `name`'s files must lie when read: a registered adapter's own roots; one found on demand must
        stay inside the adapter directories, its files too (symlinks)."""
        entry = self._entries.get(name)
        return entry.roots if entry is not None and not entry.on_demand else self.adapter_dirs

    def path_of(self, name: str) -> Path | None:
        """The entry's directory, else the adapter directories' (None when neither has it)."""
        entry = self._entries.get(name)
        return entry.path if entry is not None else self.find_on_disk(name)

    def find_on_disk(self, name: str) -> Path | None:
        """Raises AdapterNameError for a name that could not be a directory there (before touching any file),
        AdapterPathError for one that leads out of it."""
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
