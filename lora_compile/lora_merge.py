"""Steps whose every token uses one adapter can run on that adapter merged into the packed base weights.

When a batch has settled on a single adapter (no base-model tokens, no second adapter), W + B·A is packed once
per projection and the step runs the base graph on it: no LoRA work at all, as dLoRA (OSDI '24) switches between
merged and unmerged inference by batch. On CPU a decode step streams every weight from memory, and the LoRA
weights of one adapter add ~4.6 % to that (rank 16, SmolLM2-135M's shapes), so per-token LoRA cannot get close to
the base model's speed there; merged, a lone adapter runs at it (docs/benchmarks.md). The base packs are kept, so
going back to a mixed batch is free; the merged packs stay valid until their slot is reloaded. Costs one more
packed copy of the projection weights, so "auto" (the default) merges only where that copy fits in memory with
room to spare, and only for CPU float32 packed weights: the plain path (CUDA) runs per-token LoRA kernels that
cost little. Only steps whose GEMMs all run on the packed weights are merged (a few rows of a decode step, see
packed_gemm.packed_rows); longer prefill chunks use the per-token LoRA as usual.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from . import packed_gemm
from .layers import LoRALinear
from .model import CausalLM

log = logging.getLogger(__name__)


# "auto" merges when the merged copy takes at most this share of the memory available once the model is loaded.
AUTO_MAX_SHARE = 0.5


def merged_copy_bytes(model: CausalLM) -> int:
    """Memory that merging adds: one more packed copy of every projection weight."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, LoRALinear))


def available_memory_bytes() -> int | None:
    """Memory this process may still take: the system's MemAvailable, capped by a cgroup v2 limit (containers see
    the host's meminfo). None where neither can be read."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            room = int(limit) - int((cgroup / "memory.current").read_text())
            available = room if available is None else min(available, room)
    except (OSError, ValueError):
        pass
    return available


def should_merge(mode: str, weights_packed: bool, copy_bytes: int, available: int | None) -> bool:
    """EngineConfig.merge_lone_adapter's decision: "on" / "off" as said (on needs packed weights), "auto" when the
    merged copy fits in AUTO_MAX_SHARE of the available memory."""
    if mode == "off" or not weights_packed:
        return False
    if mode == "on":
        return True
    return available is not None and copy_bytes <= AUTO_MAX_SHARE * available


def build_merger(model: CausalLM, mode: str, weights_packed: bool, slot_generation: list[int],
                 after_steps: int) -> LoneAdapterMerger | None:
    copy_bytes, available = merged_copy_bytes(model), available_memory_bytes()
    enabled = should_merge(mode, weights_packed, copy_bytes, available)
    if mode == "auto" and weights_packed:
        log.info("lone-adapter merging %s (merge_lone_adapter=auto): a merged copy takes %.2f GB, %s available",
                 "on" if enabled else "off", copy_bytes / 1e9,
                 "unknown" if available is None else f"{available / 1e9:.1f} GB")
    return LoneAdapterMerger(model, slot_generation, after_steps) if enabled else None


class LoneAdapterMerger:
    """Chooses each step's packed weights, and merges a lone adapter into a copy of them a few projections per step.

    A whole merge repacks every projection (oneDNN's reorder: 0.25-1 s for SmolLM2-135M's shape on 2 cores, many
    steps' time), so it is spread over steps, one decoder layer's projections each, and no step stalls for all of
    it; until it completes, steps run per-token LoRA on the base packs as usual."""

    def __init__(self, model: CausalLM, slot_generation: list[int], after_steps: int):
        self._modules = [m for m in model.modules() if isinstance(m, LoRALinear)]
        self._per_step = max(1, len(self._modules) // len(model.layers))  # one layer's projections
        self._base = [m.weight_packed for m in self._modules]  # the packs prepack_weights made
        # The same projections with the adapter of `_merged_key` merged in; while `_pending_key` is set, the first
        # len(_merged) of them are done for that adapter.
        self._merged: list[torch.Tensor] = []
        self._merged_key: tuple[int, int] | None = None  # (slot, generation) the complete merged packs hold
        self._pending_key: tuple[int, int] | None = None  # (slot, generation) being merged
        self._current = self._base  # the packs the layers run on now
        self._slot_generation = slot_generation  # bumped by LoRAManager whenever a slot's contents change
        self.after_steps = after_steps  # consecutive steps on one adapter before merging it
        self._streak: tuple[int | None, int] = (None, 0)  # (slot, consecutive steps on it alone)
        self.merges = 0  # completed merges

    def select(self, lone_slot: int | None, rows: int) -> tuple[bool, float]:
        """Choose the weights of a step: merged (True) when every token uses `lone_slot` and its merge is complete,
        else the base weights; a step on a lone adapter whose merge is due also merges its next projections.
        Returns (merged, seconds spent merging this step)."""
        slot, count = self._streak
        self._streak = (lone_slot, count + 1 if lone_slot is not None and lone_slot == slot else 1)
        if lone_slot is None or packed_gemm.packed_rows(rows) is None:
            self._use(self._base)
            return False, 0.0
        key = (lone_slot, self._slot_generation[lone_slot])
        spent = 0.0
        if self._merged_key != key and self._streak[1] >= self.after_steps:
            spent = self._merge_next(key)
        merged = self._merged_key == key
        self._use(self._merged if merged else self._base)
        return merged, spent

    def _merge_next(self, key: tuple[int, int]) -> float:
        """Merge the adapter of `key` into the next layer's projections; the last of them completes the merge."""
        t0 = time.perf_counter()
        if self._pending_key != key:
            # A new merge: drop the previous merged packs first, so that two merged copies never coexist.
            self._merged, self._merged_key, self._pending_key = [], None, key
        done = len(self._merged)
        # Made as the base packs were (outside inference mode): an inference tensor has other dispatch keys,
        # which the compiled graph's guards would see as a new input kind and recompile for.
        with torch.inference_mode(False), torch.no_grad():
            for module in self._modules[done : done + self._per_step]:
                self._merged.append(packed_gemm.prepack(module.merged_weight(key[0])))
        if len(self._merged) == len(self._modules):
            self._merged_key, self._pending_key = key, None
            self.merges += 1
            log.info("merged the adapter in LoRA slot %d into the packed weights", key[0])
        return time.perf_counter() - t0

    def _use(self, packs: list[torch.Tensor]) -> None:
        if packs is self._current:
            return
        for module, pack in zip(self._modules, packs):
            # Same shapes and kinds of tensor either way: the compiled graph takes them as inputs, no recompile.
            module.weight_packed = pack
        self._current = packs
