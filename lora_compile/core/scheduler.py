"""Scheduler: which sequences run in the next step, and what they hold (vLLM v1's Scheduler, nano-vllm's).

It owns the waiting queue and the running batch and every decision between them:
- admission (`admit`): a sequence slot (max_num_seqs), its adapter pinned in a device slot, KV blocks for its
  prompt after prefix-cache hits, leaving the blocks the running sequences take at their next step;
- the queue's order (`schedule`, docs/architecture.md "Adapter-aware admission"): first come, first served
  across adapters, except that a sequence never holds up the ones behind it for something they do not need:
  its adapter still being read (it keeps its place), every adapter slot pinned (at most `max_overtakes`
  sequences whose adapter is resident pass it, then admission holds), a sibling choice whose shared prompt is not
  computed yet, a call (`Sequence.group`) that runs its share of the batch while another waits. No sequence slot
  or too few KV blocks stop admission: a shorter prompt behind does not pass;
- growth and preemption (`grow`): blocks for every position a running sequence computes next, oldest first;
  where none is free the newest gives its blocks back and waits first in line, recomputed on readmission;
- release: a finished or aborted sequence's blocks and adapter pin.
Each step it hands the model runner (Engine.step) one SchedulerOutput. It runs on the engine thread only.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass, field

from ..config import EngineConfig
from ..errors import AdapterNotReadyError
from ..kv_cache import KVCacheManager
from ..lora.manager import LoRAManager
from ..sequence import Sequence
from .step_output import AdmitOutcome


@dataclass
class SchedulerOutput:
    """One step's batch and how scheduling got there (the interface between the scheduler and the model runner)."""
    scheduled: list[Sequence] = field(default_factory=list)   # the step's batch: running ones, then new ones
    admitted: list[Sequence] = field(default_factory=list)    # admitted for this step (Sequence.admission_ns)
    # Left the queue without running, with what they fail with (an engine error; None: aborted by the caller).
    rejected: list[tuple[Sequence, Exception | None]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)   # gave their blocks back: first in line again


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, adapters: LoRAManager,
                 check_request: Callable[[Sequence], None], on_admitted: Callable[[Sequence], None]):
        self.config = config
        self.kv_cache = kv_cache
        self.adapters = adapters
        self._check_request = check_request   # what the engine could never serve (raises ValueError)
        self._on_admitted = on_admitted       # the engine's per-sequence set-up (random stream, grammar matcher)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._admitted: dict[int, Sequence] = {}  # id(seq): every sequence holding KV blocks
        self._admission_order = itertools.count()
        self._to_free: list[Sequence] = []
        self.epoch = 0  # admissions and releases so far: a step built ahead is for the sequences of its epoch
        self.num_preemptions = 0
        # Queue policy (the service sets them from its RequestLimits): passes of a sequence blocked on an adapter
        # slot, and the most sequences of one call running while another call waits (None: no cap).
        self.max_overtakes = 16
        self.max_running_per_group: int | None = None
        # Called (from a loader thread) when an adapter read that a waiting sequence needs is done.
        self.on_adapter_ready: Callable[[object], None] = lambda _future: None

    # --- the queue ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """The caller ended it (finished, failed or cancelled outside a step): it leaves at the next schedule."""
        seq.aborted = True
        self._to_free.append(seq)

    @property
    def num_running(self) -> int:
        """Sequences admitted and holding KV blocks."""
        return len(self._admitted)

    def holds(self, seq: Sequence) -> bool:
        return id(seq) in self._admitted

    def schedule(self) -> SchedulerOutput:
        """Release what ended, admit from the queue, grow the batch: the next step's SchedulerOutput."""
        out = SchedulerOutput()
        for seq in self._to_free:
            self.release(seq)
        self._to_free = []
        if any(s.aborted for s in self.waiting):  # (cancelled while queued: gone before any admission check)
            out.rejected += [(s, None) for s in self.waiting if s.aborted]
            self.waiting = deque(s for s in self.waiting if not s.aborted)
        for seq in self.running:
            if seq.aborted or seq.is_finished:
                self.release(seq)
        self.running = [s for s in self.running if not (s.aborted or s.is_finished)]
        self._admit_waiting(out)
        self.running.extend(out.admitted)
        out.scheduled, out.preempted = self.grow(self.running)  # (oldest first)
        if out.preempted:  # first in line again, oldest first
            gone = {id(s) for s in out.preempted}
            self.running = [s for s in self.running if id(s) not in gone]
            self.waiting.extendleft(reversed(sorted(out.preempted, key=lambda s: s.admitted_at)))
        return out

    def release_all(self) -> None:
        for seq in (*self.waiting, *self.running, *self._to_free):
            self.release(seq)
        self.waiting, self.running, self._to_free = deque(), [], []

    def start_load(self, seq: Sequence) -> bool:
        """Have the sequence's adapter read into host memory (a loader thread) if it is not there; True when a
        read is under way. Raises what a request for it fails with (a failed read remembered, an unknown name).
        Thread-safe: the service calls it as a request arrives, so the read overlaps its wait in the queue."""
        name = seq.adapter
        if not name or self.adapters.is_ready(name):
            return False
        asked_ns = time.time_ns()  # (before the read is queued: a loader thread may start it at once)
        future = self.adapters.prefetch(name)
        if future is None:
            return False
        if seq.adapter_wait_ns is None:
            seq.adapter_wait_ns = asked_ns
        seq.adapter_load = future
        future.add_done_callback(self.on_adapter_ready)
        return True

    def _admit_waiting(self, out: SchedulerOutput) -> None:
        blocked: Sequence | None = None  # the oldest sequence waiting for a device slot
        cap = self.max_running_per_group
        per_group = Counter(id(s.group) for s in self.running if s.group is not None and not s.aborted)
        if len({id(s.group) for s in self.waiting if not s.aborted}) < 2:
            cap = None  # one call waits alone: the batch's free places are its, not kept empty
        handled: set[int] = set()
        for seq in self.waiting:
            if self.num_running >= self.config.max_num_seqs:
                break
            if seq.aborted:
                out.rejected.append((seq, None))
                handled.add(id(seq))
                continue
            group = id(seq.group) if seq.group is not None else None
            if group is not None and cap is not None and per_group[group] >= cap:
                continue  # its call runs its share already: it keeps its place, the others go on
            if seq.waits_for is not None:  # a sibling choice (n > 1): it keeps its place, the others go on
                first = seq.waits_for
                if not (first.aborted or first.is_finished or first.output_ids):
                    continue
                seq.waits_for = None
            try:
                if not self._adapter_ready(seq):
                    continue  # its adapter is being read: it keeps its place, the others go on
            except Exception as exc:  # noqa: BLE001 - the read failed: the request's status
                out.rejected.append((seq, exc))
                handled.add(id(seq))
                continue
            resident = self.adapters.is_resident(seq.adapter)
            if blocked is not None and (not resident or blocked.overtaken >= self.max_overtakes):
                continue  # no slot for it either / the bound is reached: wait for the blocked sequence
            try:
                outcome = self.admit(seq, read_adapter=False)  # adapters are read on the loader, not here
            except AdapterNotReadyError:  # evicted from host memory since the check: read again, keep the place
                try:
                    if not self.start_load(seq):
                        self.on_adapter_ready(None)  # back in host memory already: try again next step
                except Exception as exc:  # noqa: BLE001 - the request's status
                    out.rejected.append((seq, exc))
                    handled.add(id(seq))
                continue
            except Exception as exc:  # noqa: BLE001 - e.g. the adapter was unloaded while it waited
                out.rejected.append((seq, exc))
                handled.add(id(seq))
                continue
            if outcome is AdmitOutcome.NO_ADAPTER_SLOT:
                blocked = blocked or seq
                continue
            if outcome is not AdmitOutcome.ADMITTED:  # no sequence slot or KV blocks: nobody behind it passes
                break
            if blocked is not None:
                blocked.overtaken += 1
            out.admitted.append(seq)
            handled.add(id(seq))
            if group is not None:
                per_group[group] += 1
        if handled:
            self.waiting = deque(s for s in self.waiting if id(s) not in handled)

    def _adapter_ready(self, seq: Sequence) -> bool:
        """Whether its adapter is in host memory (admission goes on); False while a read runs (one is started if it
        was evicted since). Raises the read's error: the sequence fails with it."""
        load = seq.adapter_load
        if load is not None:
            if not load.done():
                return False
            seq.adapter_load = None
            result = load.result()
            if result.error is not None:
                raise result.error.with_traceback(None)  # (one error for every request that waited on the read)
            seq.adapter_read = (result.start_ns, result.end_ns)
        return not self.start_load(seq)  # evicted from host memory since: read it again

    # --- what a sequence holds ----------------------------------------------------------------------
    def _kv_tokens_at_admission(self, seq: Sequence) -> int:
        """Positions whose blocks admission takes: its known tokens ("lazy": it grows as it decodes), or every
        position it may write ("reserve": prompt + max_new_tokens - 1, the last sampled token is never written)."""
        if self.config.kv_growth == "reserve":
            return min(len(seq.prompt_ids) + seq.sampling.max_new_tokens - 1, self.config.max_seq_len)
        return seq.num_tokens

    def admit(self, seq: Sequence, read_adapter: bool = True) -> AdmitOutcome:
        """Pin the sequence's adapter in a device slot and give it KV blocks for its prompt (cached ones where its
        prefix is cached): ADMITTED, or what it waits for (nothing changed). Sets seq.adapter_loaded: whether
        admission copied the adapter into a device slot. read_adapter=False: an adapter not in host memory raises
        AdapterNotReadyError instead of being read in this thread. A preempted sequence is admitted the same way
        and recomputes what the cache no longer holds."""
        assert not seq.is_admitted, "sequence already admitted"
        start_ns = time.time_ns()
        self._check_request(seq)
        if len(self._admitted) >= self.config.max_num_seqs:
            return AdmitOutcome.NO_SEQ_SLOT
        acquired = self.adapters.acquire(seq.adapter, read_adapter)
        if acquired is None:
            return AdmitOutcome.NO_ADAPTER_SLOT
        slot, loaded = acquired
        seq.adapter_start = self.adapters.activation_start(seq.adapter, seq.prompt_ids)
        if not self.kv_cache.allocate(seq, self.adapters.cache_key(slot), self._kv_tokens_at_admission(seq),
                                      self._blocks_due()):
            self.adapters.release(slot)
            return AdmitOutcome.NO_KV_BLOCKS
        seq.lora_slot, seq.adapter_loaded = slot, loaded
        seq.admitted_at = next(self._admission_order)
        seq.admission_ns = (start_ns, time.time_ns())
        self._admitted[id(seq)] = seq
        self.epoch += 1
        self._on_admitted(seq)
        return AdmitOutcome.ADMITTED

    def _blocks_due(self) -> int:
        """Blocks the running sequences take at their next step ("lazy": those whose next position starts a
        block). Admission leaves them free, as vLLM schedules running requests before waiting ones: a new
        sequence is not admitted only to be preempted by the next step's growth."""
        if self.config.kv_growth == "reserve":
            return 0
        bs = self.kv_cache.block_size
        return sum(1 for s in self._admitted.values() if len(s.block_table) * bs < s.num_tokens)

    def release(self, seq: Sequence) -> None:
        """Free the sequence's KV blocks (cached ones stay findable) and unpin its adapter; idempotent."""
        if self._admitted.pop(id(seq), None) is None:
            return
        self.epoch += 1
        self.kv_cache.free(seq)
        self.adapters.release(seq.lora_slot)
        seq.lora_slot = 0

    def grow(self, seqs: SequenceLike[Sequence]) -> tuple[list[Sequence], list[Sequence]]:
        """Blocks for every position each sequence computes next, oldest first; where none is free, the newest
        running sequence is preempted (vLLM's recompute preemption). Returns (runnable, preempted)."""
        runnable = sorted(seqs, key=lambda q: q.admitted_at)
        preempted: list[Sequence] = []
        i = 0
        while i < len(runnable):
            seq = runnable[i]
            if self.kv_cache.grow(seq, seq.num_tokens):
                i += 1
                continue
            victim = runnable.pop()  # the newest (possibly seq itself: then it waits)
            self.release(victim)
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.num_preemptions += 1
            preempted.append(victim)
        return runnable, preempted
