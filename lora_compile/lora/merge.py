"""Steps whose every token uses one adapter run on that adapter merged into the packed base weights.

Why: on CPU a decode step streams every weight from memory, and one adapter's LoRA weights add a few per cent to
those bytes, so per-token LoRA stays below the base model's speed there; merged, a lone adapter runs the base
graph at its speed (dLoRA, OSDI '24, switches between merged and unmerged inference by batch in the same way;
measurements in docs/benchmarks.md). The base packs are kept, so going back to a mixed batch is free. Costs one
more packed copy of the projection weights: "auto" (the default) merges only where that copy fits in memory with
room to spare, and only for CPU float32 packed weights (the plain path, CUDA's, runs per-token LoRA kernels that
cost little). Only steps whose GEMMs all run on the packed weights are merged (a few rows of a decode step, see
packed_gemm.packed_rows); longer prefill chunks use per-token LoRA as usual.
"""
from __future__ import annotations

import logging
import math
import time

import torch

from ..host_memory import available_memory_bytes
from ..model import packed_gemm
from ..model.causal_lm import CausalLM
from ..model.layers import LoRALinear

log = logging.getLogger(__name__)

# "auto" merges when the merged copy takes at most this share of the memory available once the model is loaded.
AUTO_MAX_SHARE = 0.5


def merged_copy_bytes(model: CausalLM) -> int:
    """Memory that merging adds: one more packed copy of every projection weight."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, LoRALinear))


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
    if mode == "on" and not weights_packed:
        log.warning("merge_lone_adapter=on needs packed weights (CPU float32, prepack_weights): not merging")
    if mode != "auto" or not weights_packed:  # (nothing to size when no packed copy can be merged)
        enabled = should_merge(mode, weights_packed, 0, None)
    else:
        copy_bytes, available = merged_copy_bytes(model), available_memory_bytes()
        enabled = should_merge(mode, weights_packed, copy_bytes, available)
        log.info("lone-adapter merging %s (merge_lone_adapter=auto): a merged copy takes %.2f GB, %s available",
                 "on" if enabled else "off", copy_bytes / 1e9,
                 "unknown" if available is None else f"{available / 1e9:.1f} GB")
    return LoneAdapterMerger(model, slot_generation, after_steps) if enabled else None


class LoneAdapterMerger:
    """Chooses each step's packed weights, and merges a lone adapter into a copy of them a layer per step.

    A whole merge repacks every projection (oneDNN's reorder: 0.25-1 s for SmolLM2-135M's shape on 2 cores, many
    steps' time), so it is spread over steps, one decoder layer's projections each, and no step stalls for all of
    it; the steps before the last run per-token LoRA on the base packs as usual. An adapter is identified by
    (slot, generation): a slot reloaded with other weights is another adapter, and its old merge is dropped."""

    def __init__(self, model: CausalLM, slot_generation: list[int], after_steps: int):
        self._modules = [m for m in model.modules() if isinstance(m, LoRALinear)]
        self._per_step = math.ceil(len(self._modules) / len(model.layers))  # one layer's projections
        self._base = [m.weight_packed for m in self._modules]  # the packs prepack_weights made
        # The same projections with the adapter of `_merged_key` merged in; while `_pending_key` is set, the first
        # len(_merged) of them are done for that adapter.
        self._merged: list[torch.Tensor] = []
        self._merged_key: tuple[int, int] | None = None  # (slot, generation) the complete merged packs hold
        self._pending_key: tuple[int, int] | None = None  # (slot, generation) being merged
        self._current = self._base  # the packs the layers run on now
        self._slot_generation = slot_generation  # bumped by LoRAManager whenever a slot's contents change
        self.after_steps = after_steps  # consecutive steps on one adapter before merging it
        self._streak: tuple[tuple[int, int] | None, int] = (None, 0)  # (adapter, consecutive steps on it alone)
        self.merges = 0  # completed merges

    @property
    def steps_to_merge(self) -> int:
        """Steps on one adapter alone (on packed weights) until it runs merged: the streak, then a layer per step."""
        return self.after_steps - 1 + math.ceil(len(self._modules) / self._per_step)

    def select(self, lone_slot: int | None, rows: int) -> tuple[bool, float]:
        """Choose the weights of a step: merged (True) when every token uses `lone_slot` and its merge is complete,
        else the base weights; a step on a lone adapter whose merge is due also merges its next layer.
        Returns (merged, seconds spent merging this step)."""
        self._drop_stale()
        key = None if lone_slot is None else (lone_slot, self._slot_generation[lone_slot])
        last, count = self._streak
        self._streak = (key, count + 1 if key is not None and key == last else 1)
        if key is None or packed_gemm.packed_rows(rows) is None:
            self._use(self._base)
            return False, 0.0
        spent = 0.0
        if self._merged_key != key and self._streak[1] >= self.after_steps:
            spent = self._merge_next(key)
        merged = self._merged_key == key
        self._use(self._merged if merged else self._base)
        return merged, spent

    def _drop_stale(self) -> None:
        """Forget merges of adapters whose slot has since been reloaded: they can never run again."""
        key = self._merged_key or self._pending_key  # never both: a new merge drops the complete one
        if key is not None and self._slot_generation[key[0]] != key[1]:
            self._use(self._base)
            self._merged, self._merged_key, self._pending_key = [], None, None

    def _merge_next(self, key: tuple[int, int]) -> float:
        """Merge the adapter of `key` into the next layer's projections; the last of them completes the merge."""
        t0 = time.perf_counter()
        if self._pending_key != key:
            # A new merge: the layers go back to the base packs and the previous merged ones are freed first, so
            # that two merged copies never coexist.
            self._use(self._base)
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
        assert len(packs) == len(self._modules), "a partial merge must never be swapped in"
        for module, pack in zip(self._modules, packs):
            # Same shapes and kinds of tensor either way: the compiled graph takes them as inputs, no recompile.
            module.weight_packed = pack
        self._current = packs
