"""What the engine hands back: a step's outcome (StepOutput) and an admission's (AdmitOutcome)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from ..errors import AdapterOutputError
from ..sequence import Sequence


class AdmitOutcome(enum.Enum):
    """What Engine.admit did with a sequence, and when it did not, what it waits for."""
    ADMITTED = "admitted"
    NO_SEQ_SLOT = "max_num_seqs sequences are running"
    NO_KV_BLOCKS = "too few free KV blocks for its prompt"
    NO_ADAPTER_SLOT = "every adapter slot is pinned by running sequences"


@dataclass
class StepOutput:
    seq_ids: list[int]          # sequences that received a token this step, in order
    token_ids: list[int]
    logits: torch.Tensor | None = None  # (len(seq_ids), vocab) when asked for
    num_tokens: int = 0         # tokens processed (prefill chunks + decodes)
    num_adapters: int = 0       # distinct adapters in the step
    # Adapters this step found producing non-finite values, now refused (LoRAManager.mark_failed): every
    # sequence using one should end (those that ended here have finish_reason "error").
    failed_adapters: dict[str, AdapterOutputError] = field(default_factory=dict)
    # Sequences whose KV blocks this step took back to let older ones grow (kv_growth "lazy"): no longer admitted,
    # they wait to be admitted again (first in line) and are then recomputed, their prefix from the cache.
    preempted: list[int] = field(default_factory=list)
    merged: bool = False        # ran on its one adapter merged into the weights (lora/merge.py)
    cuda_graph: bool = False    # replayed a decode CUDA graph (cuda_graphs)
    kind: str = "decode"        # "decode", "prefill" or "mixed"
    start_ns: int = 0           # wall clock (time.time_ns) at the start of the step, for tracing
    batch_init_s: float = 0.0
    merge_s: float = 0.0        # merging an adapter into the weights, when this step did (not in batch_init_s)
    forward_s: float = 0.0
    sample_s: float = 0.0
    # Host time this step spent building the next one while the device ran it (step_ahead): not in forward_s, and
    # off the critical path on a GPU; the next step's batch_init_s is then only its completion and copy.
    batch_init_ahead_s: float = 0.0

    @property
    def end_ns(self) -> int:
        """Wall clock at the end of sampling (the phases back to back, as the step span lays them out)."""
        return (self.start_ns + int(self.batch_init_s * 1e9) + int(self.merge_s * 1e9) + int(self.forward_s * 1e9)
                + int(self.batch_init_ahead_s * 1e9) + int(self.sample_s * 1e9))


def non_finite_message(seq: Sequence) -> str:
    return (f"the base model produced non-finite logits (NaN or infinity) at position {seq.num_tokens}: its "
            "weights overflow on this input; the sequence was ended (other requests are unaffected)")


def adapter_output_error(seq: Sequence, registered: bool) -> AdapterOutputError:
    fix = ("load it again (LoadAdapter) or restart the server" if registered
           else "the adapter directory's copy is read again once its files change")
    return AdapterOutputError(
        f"adapter {seq.adapter!r} produces non-finite values (NaN or infinity) at run time: its weights overflow "
        f"(first seen at position {seq.num_tokens} of a request). Its requests are refused until its weights are "
        f"fixed or replaced: {fix}")
