"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, repetition penalty).

Each sequence that samples draws from its own torch.Generator, a fixed amount per step, so a seeded
request gives the same tokens whatever else shares its batch.
"""
from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .sequence import Sequence


NON_FINITE = -1  # the token sample() gives a row whose logits hold NaN or infinity


def _float32(value: float) -> float:
    """`value` as the proto's float fields carry it, so a bound sent exactly is on the side the docs say."""
    return struct.unpack("f", struct.pack("f", value))[0]


# A temperature below this is greedy (vLLM's _SAMPLING_EPS): logits divided by a temperature near float32's
# smallest values overflow to infinity and the draw degenerates (token 0 at every step); greedy is its limit.
GREEDY_BELOW_TEMPERATURE = 1e-5
# The repetition penalty divides (or multiplies) logits: outside this range a seen token's logit can overflow
# to infinity (1e-38 did: NaN log-probabilities, token 0), while any penalty worth asking for lies inside.
REPETITION_PENALTY_RANGE = (1e-5, 1e5)
_GREEDY_BELOW = _float32(GREEDY_BELOW_TEMPERATURE)
_LOW, _HIGH = (_float32(v) for v in REPETITION_PENALTY_RANGE)

# What each sampling value may be, stated once: SamplingParams raises on the first broken rule, the service's
# validation reports every one with its field.
SAMPLING_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    "temperature": (lambda v: v >= 0, "must be >= 0 (0 = greedy)"),
    "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "top_k": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "repetition_penalty": (lambda v: _LOW <= v <= _HIGH,
                           "must be in [{:g}, {:g}] (1 = off)".format(*REPETITION_PENALTY_RANGE)),
}


def sampling_problem(name: str, value: float) -> str | None:
    """What is wrong with this value of SAMPLING_RULES[name], or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    accepts, rule = SAMPLING_RULES[name]
    return None if accepts(value) else f"{rule}, got {value:g}"


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0, or below GREEDY_BELOW_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0            # 0: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        for name in SAMPLING_RULES:
            if (problem := sampling_problem(name, getattr(self, name))) is not None:
                raise ValueError(f"{name} {problem}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_BELOW


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


def apply_repetition_penalty(logits: torch.Tensor, seqs: list["Sequence"]) -> None:
    """In place, as transformers does: divide positive logits of seen tokens by the penalty, multiply negatives."""
    for row, seq in enumerate(seqs):
        penalty = seq.sampling.repetition_penalty
        if penalty == 1.0:
            continue
        seen = torch.tensor(sorted(set(seq.prompt_ids) | set(seq.output_ids)), device=logits.device)
        picked = logits[row, seen]
        logits[row, seen] = torch.where(picked > 0, picked / penalty, picked * penalty)


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) everything outside each row's top-k and top-p nucleus."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab)[:, None]
    drop = ranks >= k
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep a token while the mass before it is below top_p (so the top token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def sample(logits: torch.Tensor, seqs: list["Sequence"]) -> SampleResult:
    """logits: (B, vocab) float32, one row per sequence in `seqs`. A row that is not finite gets token -1
    (NON_FINITE). Every operation below is row by row, so such a row cannot disturb the others; it is zeroed
    only where its values would otherwise be computed with (random rows, logprobs)."""
    apply_repetition_penalty(logits, seqs)
    # A row is finite iff its max and min are (both propagate NaN): two vectorised reductions, where
    # isfinite().all() is four passes over the (B, vocab) logits (~1 ms a step at batch 8 on 2 cores).
    # Checked after the penalty, which could still overflow a logit near float32's largest values.
    finite = logits.amax(dim=-1).isfinite() & logits.amin(dim=-1).isfinite()
    tokens = logits.argmax(dim=-1)
    random_rows = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
    want_logprobs = any(s.sampling.logprobs or s.sampling.top_logprobs for s in seqs)
    if random_rows or want_logprobs:
        logits = logits.masked_fill(~finite[:, None], 0.0)
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        params = [seqs[i].sampling for i in random_rows]
        temps = torch.tensor([p.temperature for p in params], device=logits.device)
        scaled = logits[rows] / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            scaled = _filter_top_k_top_p(scaled, top_k, top_p)
        probs = scaled.softmax(dim=-1)
        # Exponential race (argmax p/E, E ~ Exp(1)) is a categorical draw; each row uses its own generator.
        noise = torch.stack(
            [torch.empty_like(probs[j]).exponential_(generator=seqs[i].generator) for j, i in enumerate(random_rows)]
        )
        tokens[rows] = (probs / noise).argmax(dim=-1)
    token_list = torch.where(finite, tokens, NON_FINITE).tolist()  # the step's one device-to-host read
    if not want_logprobs:
        return SampleResult(token_list, None, None)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    k = max(s.sampling.top_logprobs for s in seqs)
    top = None
    if k:
        values, ids = logprobs.topk(k, dim=-1)
        top = [list(zip(i[: s.sampling.top_logprobs], v[: s.sampling.top_logprobs]))
               for i, v, s in zip(ids.tolist(), values.tolist(), seqs)]
    return SampleResult(token_list, chosen, top)
