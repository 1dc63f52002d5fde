"""Adapters that failed: a load whose files are bad, or weights that overflowed at run time (mark_failed). Their
requests fail at once with the same error, never retried in a loop, until the files change (an adapter found on
demand, by the files' identity) or the adapter is registered again or unloaded (identity None).

Not locked on its own: LoRAManager calls it under its lock.
"""
from __future__ import annotations

from pathlib import Path

from ..errors import AdapterError
from .adapters import CONFIG_FILE, WEIGHTS_FILE


def files_identity(path: Path) -> tuple:
    """Changes when the adapter's files are replaced or edited."""
    out = []
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        try:
            st = (path / name).stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


class Quarantine:
    def __init__(self) -> None:
        # name: (files' identity, or None for "until registered again or unloaded"; the error its requests get)
        self._failed: dict[str, tuple[tuple | None, AdapterError]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._failed

    def add(self, name: str, path: Path | None, error: AdapterError) -> None:
        """Remember `error` for `name`; path None: until registered again or unloaded, whatever its files do."""
        self._failed[name] = (files_identity(path) if path is not None else None, error)

    def check(self, name: str, path: Path | None, pinned: bool) -> bool:
        """Raise the remembered failure of `name` unless its files changed since; True when a failure was
        forgotten just now (what was read of the old files must go too). A slot still `pinned` holds the old
        weights: the failure stands until it is released."""
        failed = self._failed.get(name)
        if failed is None:
            return False
        identity, error = failed
        if identity is None or (path is not None and identity == files_identity(path)) or pinned:
            raise error.with_traceback(None)  # (raised again and again: no traceback piling up)
        del self._failed[name]
        return True

    def forget(self, name: str) -> None:
        self._failed.pop(name, None)
