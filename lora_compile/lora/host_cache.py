"""The host tier: adapters whose weights are in host memory, least recently used first, bounded by bytes
(--max-cpu-lora-bytes). The newest always stays, so an adapter larger than the budget still serves its requests.

Not locked on its own: LoRAManager calls it under its lock (and reads `names` lock-free for metrics: a copy).
"""
from __future__ import annotations

from collections import OrderedDict

from ..host_memory import available_memory_bytes
from .adapters import LoRAAdapter

HOST_CACHE_SHARE = 8  # default budget: 1/8 of the memory available at start


def host_cache_bytes(max_cpu_lora_bytes: int | None) -> int:
    """The budget: --max-cpu-lora-bytes when set, else a share of the memory available now (1 GiB if unknown)."""
    if max_cpu_lora_bytes is not None:
        return max_cpu_lora_bytes
    available = available_memory_bytes()
    return available // HOST_CACHE_SHARE if available is not None else 1 << 30


class HostCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.nbytes = 0

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def get(self, name: str) -> LoRAAdapter | None:
        """The adapter, now the most recently used; None when it is not here."""
        adapter = self._adapters.get(name)
        if adapter is not None:
            self._adapters.move_to_end(name)
        return adapter

    def peek(self, name: str) -> LoRAAdapter | None:
        """The adapter without touching its place in the LRU order (for reports)."""
        return self._adapters.get(name)

    def put(self, adapter: LoRAAdapter) -> list[LoRAAdapter]:
        """Cache `adapter` (replacing one of its name); returns the adapters evicted to stay within the budget."""
        self.drop(adapter.name)
        self._adapters[adapter.name] = adapter
        self.nbytes += adapter.nbytes
        evicted = []
        while self.nbytes > self.max_bytes and len(self._adapters) > 1:
            _, old = self._adapters.popitem(last=False)
            self.nbytes -= old.nbytes
            evicted.append(old)
        return evicted

    def drop(self, name: str) -> None:
        old = self._adapters.pop(name, None)
        if old is not None:
            self.nbytes -= old.nbytes

    def names(self) -> list[str]:
        """Least recently used first (a copy)."""
        return list(self._adapters)
