"""Structured outputs: a request's output held to a JSON schema, a regular expression, a list of choices or a
grammar, by masking each step's logits to the tokens the grammar allows next (llguidance, one of vLLM's
backends; why it and not xgrammar: docs/architecture.md, "Structured outputs").

- `StructuredOutput` is what a request asks for (SamplingParams.structured_output), hashable: the cache key.
- `GrammarCompiler` turns one into a matcher. Compiling checks the grammar against the tokenizer, computes its
  first mask and follows the tokens it forces (where llguidance builds most of its lexer, and where a grammar too
  complex for its limits fails),
  and keeps a compiled matcher per spec (an LRU bounded in entries and bytes); each sequence gets a copy of it
  (`LLMatcher.deep_copy`), so the second request with the same schema pays no compile. The service compiles off
  the engine thread before admission: a spec that does not compile, or that takes more time or memory than its
  budget (GrammarLimits), is refused there in our words, and the memory it took is given back.
- grammar_steps runs each step's grammar work (masks, then consuming the sampled tokens) within the step's budget.
- Once nothing may follow, the sequence finishes with "grammar" (its last token is part of the output; an EOS the
  grammar accepted finishes it with "eos"); both are OpenAI's "stop". max_new_tokens reached first gives
  "length", as OpenAI's structured outputs do: such an output may be cut short.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import llguidance
import llguidance.torch as llg_torch
import torch

from ..errors import GrammarError  # noqa: F401 (re-exported: where the service catches it)
from ..host_memory import heap_bytes, release_free_heap

if TYPE_CHECKING:
    from ..tokenizer import Tokenizer

# What a request may constrain its output to, and the llguidance format each is compiled from.
KINDS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}
GRAMMAR_CACHE_ENTRIES = 256     # compiled specs kept (LRU): a tenant's schema stays hot across its requests
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GrammarLimits:
    """What one constraint may cost (EngineConfig's structured_output_* fields, the flags of the same names)."""

    compile_timeout_s: float = 2.0      # compiling and its first mask, off the engine thread
    max_memory_bytes: int = 64 << 20    # heap a compiled constraint keeps (host_memory.heap_bytes)
    cache_bytes: int = 256 << 20        # compiled constraints kept, all together
    step_timeout_s: float = 0.1         # a step's grammar work: its masks, then consuming its sampled tokens


# llguidance's messages (first line) -> what the client should change. Matched by substring, in order.
_OUR_WORDS = (
    ("too many expressions", "its regular expressions expand past the grammar engine's limit (nested or large "
                             "repetition counts): simplify the pattern"),
    ("Too many items", "it cannot be matched token by token within the grammar engine's limits: too ambiguous or "
                       "recursive (a schema that requires itself has no finite instance)"),
    ("max is 2000", "a rule has more than 2000 alternatives (the grammar engine's limit): split it into nested "
                    "rules"),
    ("fuel", "it takes too much work per token for the grammar engine's limits: simplify it"),
    ("lexer states", "it needs more lexer states than the grammar engine's limit: simplify it"),
)


def in_our_words(message: str) -> str:
    """A llguidance error as a short reason for the client: its known limits named, anything else as its first
    line only (the parser state it may append is the engine's, not the client's)."""
    for needle, reason in _OUR_WORDS:
        if needle in message:
            return reason
    lines = message.strip().splitlines()
    return lines[0][:200] if lines else "the grammar engine refused it"


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
            raise GrammarError(in_our_words(str(e))) from None


@dataclass
class _Compiled:
    matcher: llguidance.LLMatcher
    nbytes: int  # what compiling it added to the process's memory


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it (built once, on first use) and the compiled specs.
    Thread-safe: the service compiles from its own thread while the engine copies."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits = GrammarLimits()):
        # n_vocab: the logits' width, which may exceed the tokenizer's
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size,
                                                 eos_token=sorted(tokenizer.eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.limits = limits
        # llguidance's own per-token limits as they are; its errors without the parser state (our messages say why)
        self._llg_limits = llguidance.LLParserLimits(verbose_errors=False)
        self._compiled: OrderedDict[StructuredOutput, _Compiled] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()  # one at a time: each one's memory is measured alone
        self.compiles = 0  # specs compiled (cache misses), for tests and the benchmark

    @property
    def cached_bytes(self) -> int:
        return self._bytes

    def compile(self, spec: StructuredOutput) -> None:
        """Compile `spec` into the cache if it is not there (raises GrammarError naming the problem or the limit)."""
        self._entry(spec)

    def _entry(self, spec: StructuredOutput) -> _Compiled:
        with self._lock:
            entry = self._compiled.get(spec)
            if entry is not None:
                self._compiled.move_to_end(spec)
                return entry
        with self._compile_lock:
            with self._lock:
                entry = self._compiled.get(spec)
            if entry is not None:
                return entry
            entry = self._compile(spec)
        with self._lock:
            self.compiles += 1
            self._compiled[spec] = entry
            self._bytes += entry.nbytes
            evicted = self._evict()
        if evicted:
            release_free_heap()
        return entry

    def _compile(self, spec: StructuredOutput) -> _Compiled:
        grammar = spec.grammar()
        before, t0 = heap_bytes(), time.perf_counter()
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._llg_limits)
        probe = matcher.deep_copy()
        bitmask = torch.empty(llg_torch.get_bitmask_shape(1, self.vocab_size), dtype=torch.int32)
        problem = matcher.get_error() if matcher.is_error() else ""
        if not problem:  # the first mask builds most of the lexer (without the GIL): a step pays none of it
            llg_torch.fill_next_token_bitmask(probe, bitmask, 0)
            problem = probe.get_error() if probe.is_error() else ""
        reason = in_our_words(problem) if problem else self._over_budget(time.perf_counter() - t0,
                                                                          max(0, heap_bytes() - before))
        if reason is None:
            # The tokens the grammar forces from there, and the mask after them: a schema that requires itself
            # forces an endless prefix, which fails here rather than in a step. (llguidance keeps the GIL here:
            # only what passed the budgets above gets this far.)
            forced = probe.compute_ff_tokens()
            if forced and probe.consume_tokens(forced):
                llg_torch.fill_next_token_bitmask(probe, bitmask, 0)
            reason = in_our_words(probe.get_error()) if probe.is_error() else None
        seconds, grown = time.perf_counter() - t0, max(0, heap_bytes() - before)
        if reason is None:
            reason = self._over_budget(seconds, grown)
        del probe
        if reason is not None:
            del matcher
            release_free_heap()  # what it built goes back to the system, not just to the allocator
            log.info("structured output refused (%s, %.2f s, %d MiB): %s", spec.kind, seconds, grown >> 20, reason)
            raise GrammarError(reason)
        return _Compiled(matcher, grown)

    def _over_budget(self, seconds: float, grown: int) -> str | None:
        limits = self.limits
        if seconds > limits.compile_timeout_s:
            return (f"it took {seconds:.1f} s, over the limit of {limits.compile_timeout_s:g} s "
                    "(--structured-output-compile-timeout): simplify it")
        if grown > limits.max_memory_bytes:
            return (f"it took {grown >> 20} MiB of memory, over the limit of {limits.max_memory_bytes >> 20} MiB "
                    "(--structured-output-max-memory): simplify it")
        return None

    def _evict(self) -> bool:
        """Oldest entries out while over the entry or byte bound; whether any went."""
        evicted = False
        while self._compiled and (len(self._compiled) > GRAMMAR_CACHE_ENTRIES or self._bytes > self.limits.cache_bytes):
            _, entry = self._compiled.popitem(last=False)
            self._bytes -= entry.nbytes
            evicted = True
        return evicted

    def forget(self, spec: StructuredOutput) -> None:
        """Drop `spec`'s compiled matcher (one that failed in a step: the next request compiles it again, and is
        refused there if it fails again)."""
        with self._lock:
            entry = self._compiled.pop(spec, None)
            if entry is not None:
                self._bytes -= entry.nbytes

    def matcher(self, spec: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (compiled now if the cache has lost it)."""
        return self._entry(spec).matcher.deep_copy()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed tokens to -inf, in place, on the logits' device (one non-blocking copy of the bitmask)."""
    llg_torch.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
