"""Prompt log-probabilities (vLLM's prompt_logprobs, OpenAI's echo): each prompt token's log-probability under the
model given the tokens before it, and the top-k tokens at its position, from the raw logits of the positions a
prefill chunk computes (batch_init adds their rows after the sampled ones)."""
from __future__ import annotations

import torch

from ..sequence import Sequence


class PromptLogprobs:
    """One step's prompt rows: the device work is queued at construction, `record` reads it back (after the
    sampler's read, which has waited for it already) and appends each sequence's entries."""

    def __init__(self, logits: torch.Tensor, targets: torch.Tensor, rows: list[tuple[Sequence, int]]):
        self._rows = rows
        self._k = max(seq.sampling.prompt_logprobs for seq, _ in rows)
        logprobs = logits.log_softmax(dim=-1)
        columns = [logprobs.gather(1, targets[:, None])]
        if self._k:
            values, ids = logprobs.topk(self._k, dim=-1)
            columns += [values, ids]
        # float64 holds token ids and float32 values exactly: one read for all
        self._packed = torch.cat([c.double() for c in columns], dim=1)

    def record(self) -> None:
        host, i, k = self._packed.tolist(), 0, self._k
        for seq, n in self._rows:
            own = seq.sampling.prompt_logprobs
            for row in host[i:i + n]:
                seq.prompt_logprobs.append(row[0])
                seq.prompt_top_logprobs.append(list(zip(map(int, row[1 + k:1 + k + own]), row[1:1 + own])))
            i += n
