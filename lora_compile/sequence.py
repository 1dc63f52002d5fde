"""One request's state as the engine sees it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .sample.logits_processors import SequenceSamplerState
from .sample.sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # None or "": the base model
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With sampling.prompt_logprobs: entry i is prompt token i + 1's log-probability given the tokens before it
    # (the first token has none), and the top sampling.prompt_logprobs alternatives there, filled as the prompt is
    # prefilled (prompt_logprobs_pending counts what is left).
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # "length", "eos", "stop", "grammar" (its structured output is complete), or "error" (then `error` says why)
    finish_reason: str | None = None
    error: str | None = None
    failure: Exception | None = None  # with "error": the request's own cause, where there is one (its grammar)
    # Owned by the engine while the sequence is admitted (kv_cache.KVCacheManager).
    block_table: list[int] = field(default_factory=list)  # KV blocks holding positions 0, bs, 2bs, ...
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks of known tokens
    cache_root: bytes | None = None  # the root of those hashes: whose weights compute its KV
    cache_adapter_start: int = 0     # the adapter_start they were computed for
    num_cached_blocks: int = 0    # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0    # prompt tokens its first admission found in the prefix cache
    num_preemptions: int = 0      # times its blocks were taken back (it is recomputed on readmission)
    admitted_at: int = -1         # admission order: the newest running sequence is preempted first
    lora_slot: int = 0
    # The first position its adapter acts on: 0, or for an activated LoRA where its invocation starts (set at
    # admission: lora/adapters.activation_start); positions before it are the base model's, KV included.
    adapter_start: int = 0
    adapter_loaded: bool = False  # try_admit copied the adapter into a device slot (it was not resident)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    generator: torch.Generator | None = None
    sampler_state: SequenceSamplerState | None = None  # logit_bias and penalties (logits_processors)
    grammar: Any = None  # sampling.structured_output's matcher (llguidance.LLMatcher), set at admission
    # Scheduling (core/scheduler.py): the call it belongs to (its share of the batch; None: its own), the sibling
    # choice whose prefill computes its shared prompt (n > 1), whether its caller ended it, its adapter's read
    # into host memory (a Future; when it began waiting, the read's wall-clock (start, end)), the sequences
    # admitted past it while it waited for an adapter slot, and the wall clock (time.time_ns) at the start and the
    # end of its admission (the end after any adapter copy into a device slot).
    group: Any = None
    waits_for: Sequence | None = None
    aborted: bool = False
    adapter_load: Any = None
    adapter_wait_ns: int | None = None
    adapter_read: tuple[int, int] | None = None
    overtaken: int = 0
    admission_ns: tuple[int, int] = (0, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_admitted(self) -> bool:
        return bool(self.block_table)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_logprobs_pending(self) -> int:
        """Prompt positions whose log-probabilities are still to compute (0 when not asked for)."""
        if self.sampling.prompt_logprobs is None:
            return 0
        return max(0, len(self.prompt_ids) - 1 - len(self.prompt_logprobs))

    def slot_at(self, pos: int) -> int:
        """The LoRA slot the token at position `pos` is computed with (0: the base model)."""
        return self.lora_slot if pos >= self.adapter_start else 0

    def slots(self, start: int, length: int) -> list[int]:
        """slot_at for positions [start, start + length)."""
        first = min(max(self.adapter_start - start, 0), length)  # (base-model positions before the adapter's)
        return [0] * first + [self.lora_slot] * (length - first)

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:  # decode: no need to build prompt + output
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]
