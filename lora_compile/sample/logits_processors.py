"""The sampler's per-row values on the device, and the logits processors that read them (vLLM v1's builtin ones).

Every per-row value a step's sampler needs (which rows draw at random, their temperature, top-k, top-p and min-p, and
the sparse entries of logit_bias and the penalties) is gathered on the host into one float64 array and copied to
the device once (float64 holds token ids and float32 values exactly). A step whose rows use none of them builds
nothing.

The penalties are sparse: a row's entries are its distinct tokens (prompt and output for the repetition penalty,
output for presence and frequency), kept on the sequence and extended by its new tokens each step
(SequenceSamplerState): nothing is rebuilt from the whole sequence. On the device each processor is one indexed
update of the flattened (B, vocab) logits, row * vocab + token, so an entry cannot reach another row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from .sampling import SamplingParams
    from ..sequence import Sequence


class _Growable:
    """A numpy array with room to append (doubling): O(1) amortised per value."""

    def __init__(self, dtype: type, values=()):
        values = np.asarray(values, dtype)
        self.data = np.empty(max(16, 2 * len(values)), dtype)
        self.data[:len(values)] = values
        self.size = len(values)

    def append(self, value) -> int:
        if self.size == len(self.data):
            self.data = np.concatenate([self.data, np.empty_like(self.data)])
        self.data[self.size] = value
        self.size += 1
        return self.size - 1

    @property
    def view(self) -> np.ndarray:
        return self.data[:self.size]


class SequenceSamplerState:
    """What the processors keep per sequence: its distinct tokens and output counts, and its logit_bias as arrays.
    Created at its first sampled step; `update` reads only the output tokens appended since."""

    def __init__(self, seq: Sequence):
        sp = seq.sampling
        self.bias_ids = np.fromiter((t for t, _ in sp.logit_bias), np.float64, len(sp.logit_bias))
        self.bias_values = np.fromiter((b for _, b in sp.logit_bias), np.float64, len(sp.logit_bias))
        self._seen = set(seq.prompt_ids)             # prompt and output tokens (repetition penalty)
        self.seen_ids = _Growable(np.float64, sorted(self._seen))
        self._slots: dict[int, int] = {}             # output token -> its index in output_ids / output_counts
        self.output_ids = _Growable(np.float64)      # distinct output tokens (presence and frequency)
        self.output_counts = _Growable(np.float64)
        self.num_counted = 0

    def update(self, output_ids: list[int]) -> None:
        for token in output_ids[self.num_counted:]:
            slot = self._slots.get(token)
            if slot is None:
                slot = self._slots[token] = self.output_ids.append(token)
                self.output_counts.append(0)
            self.output_counts.data[slot] += 1
            if token not in self._seen:
                self._seen.add(token)
                self.seen_ids.append(token)
        self.num_counted = len(output_ids)


def uses_processors(sp: SamplingParams) -> bool:
    """Whether a row changes its logits before the greedy choice (logit_bias, penalties)."""
    return bool(sp.logit_bias) or sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0 or \
        sp.frequency_penalty != 0.0


# Which SamplingTensors fields are indices (int64 on the device); the others are float32 values.
_INDEX_FIELDS = frozenset({"random_rows", "top_k", "bias_idx", "seen_idx", "output_idx"})


@dataclass
class SamplingTensors:
    """One step's sampler inputs on the device. None: no row of the step uses it. Entries are indices into the
    flattened logits (row * vocab + token), each with its value."""
    random_rows: torch.Tensor | None = None   # (R,) rows drawn at random (the others are greedy)
    temperature: torch.Tensor | None = None   # (R,)
    top_k: torch.Tensor | None = None         # (R,) 0: off; None where no random row filters by top-k or top-p
    top_p: torch.Tensor | None = None         # (R,)
    min_p: torch.Tensor | None = None         # (R,) None where no random row uses min_p
    bias_idx: torch.Tensor | None = None      # logit_bias entries
    bias: torch.Tensor | None = None
    seen_idx: torch.Tensor | None = None      # repetition penalty: each row's prompt and output tokens
    repetition: torch.Tensor | None = None    # the row's penalty, per entry
    output_idx: torch.Tensor | None = None    # presence and frequency: each row's distinct output tokens
    output_count: torch.Tensor | None = None  # times generated
    frequency: torch.Tensor | None = None     # the row's penalties, per entry
    presence: torch.Tensor | None = None

    @classmethod
    def build(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> SamplingTensors:
        host: dict[str, np.ndarray] = {}
        random_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        if random_rows:
            params = [seqs[i].sampling for i in random_rows]
            host["random_rows"] = np.asarray(random_rows, np.float64)
            host["temperature"] = np.fromiter((p.temperature for p in params), np.float64, len(params))
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                host["top_k"] = np.fromiter((p.top_k for p in params), np.float64, len(params))
                host["top_p"] = np.fromiter((p.top_p for p in params), np.float64, len(params))
            if any(p.min_p > 0.0 for p in params):
                host["min_p"] = np.fromiter((p.min_p for p in params), np.float64, len(params))
        entries: dict[str, list[np.ndarray]] = {}
        for row, seq in enumerate(seqs):
            sp = seq.sampling
            if not uses_processors(sp):
                continue
            if seq.sampler_state is None:
                seq.sampler_state = SequenceSamplerState(seq)
            state = seq.sampler_state
            state.update(seq.output_ids)
            base = float(row * vocab)
            if sp.logit_bias:
                _add(entries, bias_idx=base + state.bias_ids, bias=state.bias_values)
            if sp.repetition_penalty != 1.0:
                seen = state.seen_ids.view
                _add(entries, seen_idx=base + seen, repetition=np.full(len(seen), sp.repetition_penalty))
            if (sp.presence_penalty != 0.0 or sp.frequency_penalty != 0.0) and state.output_ids.size:
                ids = state.output_ids.view
                _add(entries, output_idx=base + ids, output_count=state.output_counts.view,
                     frequency=np.full(len(ids), sp.frequency_penalty), presence=np.full(len(ids), sp.presence_penalty))
        host.update({name: np.concatenate(parts) for name, parts in entries.items()})
        if not host:
            return cls()
        names = list(host)
        flat = torch.from_numpy(np.concatenate([host[n] for n in names]))
        if device.type == "cuda":  # pinned (torch's caching host allocator): the copy does not hold the host up
            flat = flat.pin_memory()
        flat = flat.to(device, non_blocking=True)  # the step's one copy of sampler values
        out, start = {}, 0
        for name in names:
            part = flat[start:start + len(host[name])]
            out[name] = part.long() if name in _INDEX_FIELDS else part.float()
            start += len(host[name])
        return cls(**out)


def _add(entries: dict[str, list[np.ndarray]], **arrays: np.ndarray) -> None:
    for name, array in arrays.items():
        entries.setdefault(name, []).append(array)


def apply_logit_bias_and_penalties(logits: torch.Tensor, t: SamplingTensors) -> None:
    """In place, in vLLM v1's order: logit_bias added to the raw logits; then the repetition penalty (positive
    logits of prompt and output tokens divided by it, negative ones multiplied, as transformers and vLLM do); then
    frequency and presence (OpenAI's: logit -= frequency x count, then -= presence once for a generated token)."""
    flat = logits.view(-1)
    if t.bias_idx is not None:
        flat.index_add_(0, t.bias_idx, t.bias)  # a row's tokens are distinct: no two entries meet
    if t.seen_idx is not None:
        picked = flat[t.seen_idx]
        flat[t.seen_idx] = torch.where(picked > 0, picked / t.repetition, picked * t.repetition)
    if t.output_idx is not None:
        flat.index_add_(0, t.output_idx, -(t.frequency * t.output_count))
        flat.index_add_(0, t.output_idx, -t.presence)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) the tokens whose probability is below min_p x the row's top probability (min_p 0: none).
    On temperature-scaled logits, before top-k/top-p, as vLLM does."""
    probs = logits.softmax(dim=-1)
    return logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p[:, None], float("-inf"))
