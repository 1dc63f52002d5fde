"""Streaming text from token ids: incremental detokenization, stop-string matching, and each token's own text
(logprobs).

Both hold text back rather than ever send something they would have to take back:
- a multi-byte UTF-8 character split across tokens decodes to U+FFFD until its last byte arrives;
- a suffix that may be the start of a stop string waits until it either completes the stop or cannot.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """vLLM's prefix/read offsets: decode a short window and emit what the newest tokens added.

    Decoding a window (not the whole output) keeps each step O(window); starting the window with the
    last prompt tokens gives the first output token its context (e.g. a leading space).
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = ()):
        self._tok = tokenizer
        context = list(prompt_ids[-self.CONTEXT_TOKENS:])
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # a prompt ending mid-character would shift the offsets; decode without context
        self._ids = context
        self._prefix_offset = 0             # window start
        self._read_offset = len(context)    # end of what has been emitted

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True) if ids else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text they complete ("" while a character is incomplete)."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is still held back, incomplete characters included."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # e.g. a special token, skipped
        if new_text.endswith(REPLACEMENT_CHAR) and not final:
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text):]


class StopStringMatcher:
    """Truncates the stream at the first stop string and never leaks part of one.

    Emits text up to the longest suffix that is a prefix of some stop string. The match that wins is the
    one that ends first (ties: the one that starts first), which is also what a token-by-token stream
    sees first, so the result does not depend on how the text was chunked.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self._max_len = max((len(s) for s in self.stops), default=0)
        self._pending = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str | None]:
        """Returns (text safe to emit, matched stop string or None). After a match, stop feeding."""
        pending = self._pending + text
        if not self.stops:
            self._pending = ""
            return pending, None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            start = pending.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is not None:
            self._pending = ""
            return pending[:best[1]], best[2]
        if final:
            self._pending = ""
            return pending, None
        hold = self._held_suffix(pending)
        self._pending = pending[len(pending) - hold:] if hold else ""
        return pending[:len(pending) - hold], None

    def _held_suffix(self, text: str) -> int:
        for k in range(min(len(text), self._max_len - 1), 0, -1):
            suffix = text[-k:]
            if any(stop.startswith(suffix) for stop in self.stops):
                return k
        return 0


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...
    def is_special(self, token_id: int) -> bool: ...


@dataclass(frozen=True)
class TokenText:
    """One token as logprobs show it (OpenAI's contract: concatenating the tokens' bytes gives the text)."""

    text: str       # its text; part of a multi-byte character: OpenAI's "bytes:\\xe2\\x80"
    data: bytes     # the bytes it adds to the text (raw: part of a character is part of its UTF-8)
    special: bool   # a special token (BOS, EOS...): shown by its name, not part of the returned text


def token_texts(tokenizer: TokenBytes, ids: Sequence[int]) -> list[TokenText]:
    """Each token's own text, not its vocabulary piece ("Ġmate" is " mate")."""
    out = []
    for token_id in ids:
        data = tokenizer.token_bytes(token_id)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in data)
        out.append(TokenText(text, data, tokenizer.is_special(token_id)))
    return out
