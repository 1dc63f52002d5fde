"""One Generate call's parameters as a client sent them, before any check, whichever door it came through.

The gRPC door builds one from a GenerateRequest (service/grpc_api/params.py), the HTTP door from an OpenAI body
(service/http_api/openai_params.py); the request front (front.py) hands it to prepare.py, which checks it and makes
the runner's GenerationRequest. Each door names the fields its own way in refusals (`sampling.min_p` / `min_p`):
`names` carries that vocabulary, so a refusal is worded for the client that sent it without a second
translation.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FieldNames:
    """A door's name for each GenerateParams field, used in FieldViolation.field. A name ending in "[]" has
    items named `name[i]`; without it, an item is named as the whole field. Unlisted fields keep their own
    name."""

    names: Mapping[str, str] = field(default_factory=dict)

    def __call__(self, param: str, index: int | None = None) -> str:
        name = self.names.get(param, param)
        if not name.endswith("[]"):
            return name
        name = name[:-2]
        return name if index is None else f"{name}[{index}]"


@dataclass(frozen=True)
class GenerateParams:
    """None: not sent (the server's default applies). Sequences and mappings may be the wire message's own
    containers: prepare.py checks their length before it reads them, so a huge one costs nothing."""

    names: FieldNames = FieldNames()
    request_id: str = ""
    adapter: str = ""                     # "": the base model
    # A weighted mix of adapters instead (lora_compile.lora.mixes): (name, weight) pairs; one pair is a scaled adapter.
    adapters: Sequence[tuple[str, float]] = ()
    # The prompt: text (tokenized by the server) or token ids (used as is); neither: no prompt (refused).
    text: str | None = None
    token_ids: Sequence[int] | None = None
    add_special_tokens: bool = True       # when tokenizing text (BOS...); a chat template writes its own
    # sampling (lora_compile.SamplingParams; the rules in lora_compile.sample.sampling.SAMPLING_RULES)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> bias
    n: int | None = None                  # choices from the one prompt (None: 1)
    # stopping
    max_new_tokens: int | None = None     # None: up to the end of the context (or the operator's limit)
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    # what the responses carry
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None    # None: off
    # structured output: (kind, spec), lora_compile.sample.structured_output.StructuredOutput's fields; None: free text
    structured_output: tuple[str, str] | None = None

    @property
    def input_bytes(self) -> int:
        """Roughly what the prompt took on the wire (a large one is followed by a heap trim)."""
        return len(self.text or "") + 4 * len(self.token_ids or ())
