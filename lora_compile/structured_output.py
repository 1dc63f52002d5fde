"""Structured outputs: a request's output held to a JSON schema, a regular expression, a list of choices or a
grammar, by masking each step's logits to the tokens the grammar allows next (llguidance, one of vLLM's
backends; why it and not xgrammar: docs/architecture.md, "Structured outputs").

- `StructuredOutput` is what a request asks for (SamplingParams.structured_output), hashable: the cache key.
- `GrammarCompiler` turns one into a matcher. Compiling checks the grammar against the tokenizer and keeps a
  compiled matcher per spec (an LRU); each sequence gets a copy of it (`LLMatcher.deep_copy`), so the second
  request with the same schema pays no compile. The service compiles off the engine thread before admission
  (an invalid schema is refused there, with llguidance's message); the engine only copies.
- `fill_bitmask` writes the allowed tokens of a step's constrained rows into one int32 bitmask on the host
  (32 tokens a word), while the forward runs; `sample` applies it to those rows' logits before anything else
  (vLLM's order), on the logits' device: one copy of the bitmask, no host synchronisation.
- After sampling, each constrained sequence's matcher consumes its token. Once nothing may follow, the sequence
  finishes with "grammar" (its last token is part of the output; an EOS the grammar accepted finishes it with
  "eos"); both are OpenAI's "stop". max_new_tokens reached first gives "length", as OpenAI's structured outputs
  do: such an output may be cut short.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch as llg_torch
import torch

if TYPE_CHECKING:
    from .sequence import Sequence
    from .tokenizer import Tokenizer

# What a request may constrain its output to, and the llguidance format each is compiled from.
KINDS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
GRAMMAR_CACHE_ENTRIES = 256     # compiled specs kept (LRU): a tenant's schema stays hot across its requests


class GrammarError(ValueError):
    """The spec does not compile: the message says why (llguidance's own words)."""


@dataclass(frozen=True)
class StructuredOutput:
    """kind: "json" (spec: a JSON schema, as JSON text), "json_object" (any JSON object; spec unused), "regex",
    "choice" (spec: a JSON list of strings) or "grammar" (a Lark or GBNF grammar, llguidance's syntax)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {sorted(KINDS)}, got {self.kind!r}")

    def grammar(self) -> str:
        """llguidance's grammar for this spec (raises GrammarError)."""
        try:
            if self.kind in ("json", "json_object"):
                schema = '{"type": "object"}' if self.kind == "json_object" else self.spec
                # Compact JSON unless the schema says otherwise (its "x-guidance"): no runs of blank characters
                # a weak model could spend its tokens on.
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            return llguidance.grammar_from(KINDS[self.kind], self.spec)
        except (ValueError, TypeError) as e:
            raise GrammarError(str(e)) from None


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it (built once, on first use) and the compiled specs.
    Thread-safe: the service compiles from its own thread while the engine copies."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        # n_vocab: the logits' width, which may exceed the tokenizer's
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                                 eos_token=sorted(tokenizer.eos_token_ids) or None)
        self._compiled: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0  # specs compiled (cache misses), for tests and the benchmark

    def compile(self, spec: StructuredOutput) -> None:
        """Compile `spec` into the cache if it is not there (raises GrammarError naming the problem)."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return
        grammar = spec.grammar()
        problem = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if problem:
            raise GrammarError(problem)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        with self._lock:
            self.compiles += 1
            self._compiled[spec] = matcher
            while len(self._compiled) > GRAMMAR_CACHE_ENTRIES:
                self._compiled.popitem(last=False)

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (compiled now if the cache has lost it)."""
        with self._lock:
            proto = self._compiled.get(spec)
        if proto is None:
            self.compile(spec)
            with self._lock:
                proto = self._compiled[spec]
        return proto.deep_copy()


def fill_bitmask(seqs: list[Sequence], vocab_size: int, pin: bool) -> torch.Tensor | None:
    """(len(seqs), ceil(vocab / 32)) int32 on the host, bit t of row i set where sequence i may take token t
    (every bit of an unconstrained row); None when no sequence is constrained."""
    rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
    if not rows:
        return None
    bitmask = torch.full(llg_torch.get_bitmask_shape(len(seqs), vocab_size), -1, dtype=torch.int32, pin_memory=pin)
    for i in rows:
        llg_torch.fill_next_token_bitmask(seqs[i].grammar, bitmask, i)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens to -inf, in place, on the logits' device (one non-blocking copy of the bitmask)."""
    llg_torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))


def consume(seq: Sequence, token: int) -> str | None:
    """The sequence's grammar takes its new token: "stop" where the grammar has ended, "error" where it refused
    the token (only a token the mask did not allow, which sampling never picks), else None."""
    matcher = seq.grammar
    if not matcher.consume_token(token):
        seq.error = f"structured output: the grammar refused token {token} ({matcher.get_error()})"
        return "error"
    return "stop" if matcher.is_stopped() else None
