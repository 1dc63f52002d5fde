"""Log-probabilities as OpenAI's and vLLM's clients read them: the completions (legacy) format with text offsets,
the chat format with each token's bytes, and vLLM's prompt_logprobs.

A token is shown by its own text (" mate", not the vocabulary's piece "Ġmate"); a token holding part of a
multi-byte character is shown as OpenAI shows it ("bytes:\\xe2\\x80") and its `bytes` are that part, so the
tokens' bytes concatenated are the text's UTF-8. A special token (BOS, EOS) is shown by its name; it is not part
of the text, so it takes no room in text offsets and has no chat `bytes`.
"""
from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

from service.front import TokenText

MIN_LOGPROB = -9999.0  # vLLM's floor: JSON has no -inf (a token sampling could never pick)
Texts = Callable[[list[int]], list[TokenText]]  # RequestFront.token_texts
Top = Sequence[tuple[int, float]]


def clamp(logprob: float | None) -> float | None:
    return None if logprob is None else max(logprob, MIN_LOGPROB)


class TextOffsets:
    """OpenAI's text_offset: where each token's text starts in the choice's text, in characters, tokens fed in
    order across chunks. Part of a multi-byte character starts where the character does."""

    def __init__(self, start: int = 0):
        self.chars = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[TokenText]) -> list[int]:
        offsets = []
        for token in tokens:
            offsets.append(self.chars)
            if not token.special:
                self.chars += len(self._utf8.decode(token.data))
        return offsets


def completion_logprobs(tokens: list[TokenText], logprobs: Sequence[float | None], tops: Sequence[Top | None] | None,
                        offsets: list[int], texts: Texts) -> dict[str, Any]:
    """OpenAI's legacy format. A None logprob or top entry: the prompt's first token (echo), which has none.
    `tops` None: no alternatives were asked for."""
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [clamp(lp) for lp in logprobs],
        "top_logprobs": None if tops is None else [None if top is None else _top_dict(top, texts) for top in tops],
        "text_offset": offsets,
    }


def _top_dict(top: Top, texts: Texts) -> dict[str, float]:
    return {t.text: clamp(lp) for t, (_, lp) in zip(texts([i for i, _ in top]), top)}


def chat_logprobs(tokens: list[TokenText], logprobs: Sequence[float], tops: Sequence[Top], texts: Texts) -> dict:
    """OpenAI's chat format: per token, its text, log-probability, bytes, and the top alternatives likewise."""
    content = []
    for i, (token, lp) in enumerate(zip(tokens, logprobs)):
        top = tops[i] if i < len(tops) else ()
        alternatives = [_chat_entry(t, v) for t, (_, v) in zip(texts([t for t, _ in top]), top)]
        content.append(_chat_entry(token, lp) | {"top_logprobs": alternatives})
    return {"content": content}


def _chat_entry(token: TokenText, logprob: float) -> dict[str, Any]:
    # (a special token is not part of the text: no bytes of it, as OpenAI allows)
    return {"token": token.text, "logprob": clamp(logprob), "bytes": None if token.special else list(token.data)}


def vllm_prompt_logprobs(prompt_ids: Sequence[int], logprobs: Sequence[float], tops: Sequence[Top],
                         texts: Texts) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob, rank,
    decoded_token}} for the prompt's own token and its top alternatives. rank is 1-based among those
    alternatives; a prompt token outside them has rank None (vLLM ranks it in the whole vocabulary)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, lp, top in zip(prompt_ids[1:], logprobs, tops):
        ids = [token, *(t for t, _ in top)]
        names = dict(zip(ids, (t.text for t in texts(ids))))
        ranks = {t: r for r, (t, _) in enumerate(top, 1)}
        entry = {str(token): {"logprob": clamp(lp), "rank": ranks.get(token), "decoded_token": names[token]}}
        for t, v in top:
            entry.setdefault(str(t), {"logprob": clamp(v), "rank": ranks[t], "decoded_token": names[t]})
        out.append(entry)
    return out
