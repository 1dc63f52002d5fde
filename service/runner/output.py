"""Per-request output processing: new token ids of a sequence → a RequestOutput (text delta, stop, finish)."""
from __future__ import annotations

from lora_compile import Sequence
from service.runner.detokenizer import Decoder, IncrementalDetokenizer, StopStringMatcher
from service.runner.request import RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: Decoder, seq: Sequence, stop: tuple[str, ...]):
        self._seq = seq
        self._detok = IncrementalDetokenizer(tokenizer, seq.prompt_ids)
        self._stop = StopStringMatcher(stop)
        self._n_seen = 0  # output tokens already turned into outputs
        self.finished = False

    def process(self) -> RequestOutput | None:
        """After a step: the tokens it appended, or None when it appended none (a prefill chunk)."""
        seq = self._seq
        new_ids = seq.output_ids[self._n_seen:]
        if not new_ids or self.finished:
            return None
        start, self._n_seen = self._n_seen, len(seq.output_ids)
        out = RequestOutput(
            token_ids=list(new_ids),
            logprobs=seq.output_logprobs[start:self._n_seen],
            top_logprobs=seq.output_top_logprobs[start:self._n_seen],
        )
        if start == 0:  # the first output carries the prompt's log-probabilities (all computed by its first token)
            out.prompt_logprobs, out.prompt_top_logprobs = list(seq.prompt_logprobs), list(seq.prompt_top_logprobs)
        reason = seq.finish_reason
        # An EOS or stop token ends the text; its id is reported, its text is not (as a stop string is not).
        text_ids = new_ids[:-1] if reason in ("eos", "stop") else new_ids
        text = self._detok.add(text_ids)
        if reason is not None:
            text += self._detok.flush()
        out.text, matched = self._stop.feed(text, final=reason is not None)
        if matched is not None:
            reason, out.stop = "stop", matched
        elif reason == "stop":
            out.stop_token_id = new_ids[-1]
        if reason is not None:
            self._finish(out, reason)
        return out

    def cancel(self) -> RequestOutput:
        """The server ends the request early: flush held-back text and finish as "cancelled"."""
        out = RequestOutput(text=self._stop.feed(self._detok.flush(), final=True)[0])
        self._finish(out, "cancelled")
        return out

    def _finish(self, out: RequestOutput, reason: str) -> None:
        self.finished = True
        out.finish_reason = reason
        out.prompt_tokens = len(self._seq.prompt_ids)
        out.completion_tokens = self._n_seen  # tokens sent; a cancelled step may have appended one more
        out.cached_tokens = self._seq.num_cached_tokens
