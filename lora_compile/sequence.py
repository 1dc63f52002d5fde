"""One request's state as the engine sees it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampling import SamplingParams


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    adapter: str | None = None  # None or "": the base model
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # "length", "eos", "stop", or "error" (then `error` says why)
    error: str | None = None
    # Owned by the engine while the sequence is admitted (kv_cache.KVCacheManager).
    block_table: list[int] = field(default_factory=list)  # KV blocks holding positions 0, bs, 2bs, ...
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks of known tokens
    cache_root: bytes | None = None  # the root of those hashes: whose weights compute its KV
    num_cached_blocks: int = 0    # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0    # prompt tokens its first admission found in the prefix cache
    num_preemptions: int = 0      # times its blocks were taken back (it is recomputed on readmission)
    admitted_at: int = -1         # admission order: the newest running sequence is preempted first
    lora_slot: int = 0
    adapter_loaded: bool = False  # try_admit copied the adapter into a device slot (it was not resident)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    generator: torch.Generator | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_admitted(self) -> bool:
        return bool(self.block_table)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def tokens(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end) of prompt + output."""
        n_prompt = len(self.prompt_ids)
        if end <= n_prompt:
            return self.prompt_ids[start:end]
        if start >= n_prompt:  # decode: no need to build prompt + output
            return self.output_ids[start - n_prompt : end - n_prompt]
        return self.prompt_ids[start:] + self.output_ids[: end - n_prompt]
