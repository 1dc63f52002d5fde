"""Steps whose every token uses one adapter can run on that adapter merged into the packed base weights.

When a batch has settled on a single adapter (no base-model tokens, no second adapter), W + B·A is packed once
per projection and the step runs the base graph on it: no LoRA work at all, as dLoRA (OSDI '24) switches between
merged and unmerged inference by batch. The base packs are kept, so going back to a mixed batch is free; the
merged packs stay valid until their slot is reloaded. Costs one more packed copy of the projection weights, so it
is opt-in (EngineConfig.merge_lone_adapter), and only for CPU float32 packed weights: the plain path (CUDA) runs
per-token LoRA kernels that cost little. Only steps whose GEMMs all run on the packed weights are merged (a few
rows of a decode step, see packed_gemm.packed_rows); longer prefill chunks use the per-token LoRA as usual.
"""
from __future__ import annotations

import logging
import time

import torch

from . import packed_gemm
from .layers import LoRALinear
from .model import CausalLM

log = logging.getLogger(__name__)


class LoneAdapterMerger:
    def __init__(self, model: CausalLM, slot_generation: list[int], after_steps: int):
        self._modules = [m for m in model.modules() if isinstance(m, LoRALinear)]
        self._base = [m.weight_packed for m in self._modules]  # the packs prepack_weights made
        self._merged: list[torch.Tensor] = []  # the same projections with the adapter of `_merged_key` merged in
        self._merged_key: tuple[int, int] | None = None  # (slot, generation) the merged packs hold
        self._current = self._base  # the packs the layers run on now
        self._slot_generation = slot_generation  # bumped by LoRAManager whenever a slot's contents change
        self.after_steps = after_steps  # consecutive steps on one adapter before merging it
        self._streak: tuple[int | None, int] = (None, 0)  # (slot, consecutive steps on it alone)
        self.merges = 0

    def select(self, lone_slot: int | None, rows: int) -> tuple[bool, float]:
        """Choose the weights of a step: merged (True) when every token uses `lone_slot` and the merge is ready or
        due, else the base weights. Returns (merged, seconds spent merging this step)."""
        slot, count = self._streak
        self._streak = (lone_slot, count + 1 if lone_slot is not None and lone_slot == slot else 1)
        if lone_slot is None or packed_gemm.packed_rows(rows) is None:
            self._use(self._base)
            return False, 0.0
        spent = 0.0
        if self._merged_key != (lone_slot, self._slot_generation[lone_slot]):
            if self._streak[1] < self.after_steps:
                self._use(self._base)
                return False, 0.0
            spent = self._merge(lone_slot)
        self._use(self._merged)
        return True, spent

    def _merge(self, slot: int) -> float:
        t0 = time.perf_counter()
        # Made as the base packs were (outside inference mode): an inference tensor has other dispatch keys,
        # which the compiled graph's guards would see as a new input kind and recompile for.
        with torch.inference_mode(False), torch.no_grad():
            self._merged = [packed_gemm.prepack(m.merged_weight(slot)) for m in self._modules]
        self._merged_key = (slot, self._slot_generation[slot])
        self.merges += 1
        spent = time.perf_counter() - t0
        log.info("merged the adapter in LoRA slot %d into the packed weights in %.0f ms", slot, 1000 * spent)
        return spent

    def _use(self, packs: list[torch.Tensor]) -> None:
        if packs is self._current:
            return
        for module, pack in zip(self._modules, packs):
            # Same shapes and kinds of tensor either way: the compiled graph takes them as inputs, no recompile.
            module.weight_packed = pack
        self._current = packs
