"""Overlapped batch init: the next decode step's metadata filled on the host and copied while this step runs on the
device.

On a GPU a decode step's host work (KV growth, plan, build: a Python pass over the running sequences) would
otherwise sit between two device steps with the device idle: 0.12-0.58 ms of a 3.5-8 ms step on an H100's host
(docs/benchmarks.md). Once a decode step's kernels are queued, the next step is built from what it will be if every
sequence continues and its one copy is queued behind them; its input ids, the tokens being sampled, are written
by the sampler on the device (vLLM's async scheduling does the same), so nothing of it is left for the host. The
next step then takes that build if its sequences are exactly those (same set, admitted and released nothing since,
none finished): all it costs is that comparison. Otherwise it is dropped and the step builds as usual, its copy
queued after (and overwriting) the dropped one. Each step that runs is still fed by one host-to-device copy (two
host buffers: the spare is filled while the other's copy may still be queued), with no host synchronisation.
"""
from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

import torch

from ..kv_cache import KVCacheManager
from ..sequence import Sequence
from .batch_init import BatchInit, Planned, StepInputs
from .cuda_graphs import GraphShape


@dataclass
class DecodeAhead:
    planned: list[Planned]
    members: frozenset[int]     # id() of each sequence
    epoch: int                  # the engine's admission epoch it was built in
    merged: bool
    graph: GraphShape | None
    inputs: StepInputs
    buffer: int                 # host buffer holding it


class StepAhead:
    def __init__(self, batch_init: BatchInit, kv_cache: KVCacheManager,
                 graph_shape: Callable[[list[Planned]], GraphShape | None], max_seq_len: int):
        self.batch_init, self.kv_cache, self.graph_shape = batch_init, kv_cache, graph_shape
        self.max_seq_len = max_seq_len
        self.pending: DecodeAhead | None = None
        self.built = 0   # builds made ahead, each copied to the device once
        self.hits = 0    # steps that took a build made ahead
        self.misses = 0  # builds made ahead and dropped

    def prepare(self, single: list[Planned], merged: bool, epoch: int) -> None:
        """After a decode step's kernels are queued: build the step that follows if every sequence continues.
        Skipped where one surely ends (its length limit) or the KV pool has no block for a sequence's next
        position (the next step then grows, and may preempt, as usual); blocks taken here are the ones the next
        step would take."""
        nxt = []
        for p in single:
            seq = p.seq
            if len(seq.output_ids) + 1 >= seq.sampling.max_new_tokens or p.start + 2 >= self.max_seq_len:
                return
            if not self.kv_cache.grow(seq, p.start + 2):
                return
            nxt.append(Planned(seq, p.start + 1, 1))
        graph = self.graph_shape(nxt)
        inputs, buffer = self.batch_init.build_ahead(nxt, merged, graph)
        self.pending = DecodeAhead(nxt, frozenset(id(p.seq) for p in nxt), epoch, merged, graph, inputs, buffer)
        self.built += 1

    def next_input_ids(self) -> torch.Tensor | None:
        """Where the running step's sampler writes its tokens on the device: the input ids of the step built ahead
        (the same sequences in the same order), or None."""
        return None if self.pending is None else self.pending.inputs.input_ids[:len(self.pending.planned)]

    def drop(self) -> None:
        if self.pending is not None:
            self.pending = None
            self.misses += 1

    def take(self, seqs: SequenceLike[Sequence], epoch: int) -> DecodeAhead | None:
        """The build made ahead, already on the device with its input ids, if `seqs` is the step it was built for;
        else None. All a hit costs on the critical path is this comparison."""
        ahead, self.pending = self.pending, None
        if ahead is None:
            return None
        if ahead.epoch != epoch or len(seqs) != len(ahead.planned) or frozenset(map(id, seqs)) != ahead.members:
            self.misses += 1
            return None
        self.batch_init.take_ahead(ahead.buffer)
        self.hits += 1
        return ahead
