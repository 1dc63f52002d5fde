"""GenerateParams → the runner's GenerationRequest, or InvalidArgument naming every bad field: the one way in for
both doors (gRPC and HTTP), through the request front (front.py), so they share tokenizing, every limit
(limits.py), the grammar compile, the adapter check and every refusal's wording (fields named in the door's own
vocabulary, GenerateParams.names).

Checks everything the engine would refuse, so a request fails here, with a field name, and never inside a step.
Capacity is the front's, checked once per call before any of this.
"""
from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from lora_compile import SamplingParams
from lora_compile.errors import AdapterMixError, AdapterNameError, AdapterPathError
from lora_compile.lora.mixes import AdapterMix, make_mix, mix_problems
from lora_compile.sample.sampling import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_PROMPT_LOGPROBS,
    SAMPLING_RULES,
    sampling_problem,
)
from lora_compile.sample.structured_output import KINDS as STRUCTURED_OUTPUT_KINDS
from lora_compile.sample.structured_output import GrammarError, StructuredOutput
from service.errors import FieldViolation, InvalidArgument, NotFound
from service.front.generate_params import FieldNames, GenerateParams
from service.heap import LARGE_REQUEST_BYTES, HeapTrimmer
from service.limits import (
    MAX_NAME_CHARS,
    MAX_REPORTED_BAD_IDS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_STRUCTURED_OUTPUT_CHARS,
    MAX_TOP_LOGPROBS,
    RequestLimits,
)
from service.runner.request import GenerationRequest, ModelInfo

TOKENIZE_IN_THREAD_CHARS = 4096  # longer texts are tokenized off the event loop (the tokenizer thread)


class EngineCalls(Protocol):
    """What preparing asks of the engine side (the runner's EngineDoor): no capacity, no queue."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def compile_grammar(self, spec: StructuredOutput) -> None: ...

    def has_adapter(self, name: str) -> bool: ...

    def check_mix(self, mix: AdapterMix) -> None: ...


class Preparer:
    """What the request front calls before the runner takes a call (one per server: one tokenizer thread, one
    heap trimmer)."""

    def __init__(self, engine: EngineCalls, model: ModelInfo, limits: RequestLimits = RequestLimits()):
        self._engine = engine
        self.model = info = model
        self.limits = limits
        # A text longer than this cannot fit in a prompt whatever it says: refused before it is tokenized.
        self.max_prompt = min(info.max_seq_len - 1, limits.max_prompt_tokens or info.max_seq_len)
        self.max_text_chars = self.max_prompt * info.max_token_chars
        # One thread: a burst of long texts queues there instead of taking every core from the engine thread.
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        # Grammars compile here, off the event loop and the engine thread (cached by spec in the engine).
        self._grammar_pool: ThreadPoolExecutor | None = None
        self._heap = HeapTrimmer()

    async def prepare(self, params: GenerateParams) -> GenerationRequest:
        """The text tokenized, every field checked, the grammar compiled and the adapter looked up (NOT_FOUND)."""
        self.note_input(params.input_bytes)
        prompt_ids = None
        if params.text is not None:
            prompt_ids = await self.encode(params.text, params.add_special_tokens, params.names("text"))
        req = validate(params, prompt_ids, self.limits, self.model)
        if req.sampling.structured_output is not None:
            await self._compile(req.sampling.structured_output, params.names("structured_output"))
        if req.adapter is not None:
            self._check_adapter(req.adapter, params)
        return req

    def _check_adapter(self, name: str, params: GenerateParams) -> None:
        """NOT_FOUND for an adapter (or a mix's member) nobody has; INVALID_ARGUMENT for a mix that cannot be
        served as asked, where its members' facts are known already (else when it is composed)."""
        mix = AdapterMix.parse(name)
        field = params.names("adapters" if mix is not None else "adapter")
        for member in mix.names if mix is not None else (name,):
            try:
                known = self._engine.has_adapter(member)
            except (AdapterNameError, AdapterPathError) as e:  # not a name an adapter directory could hold
                raise InvalidArgument([FieldViolation(field, str(e))]) from None
            if not known:
                raise NotFound("adapter", member)
        if mix is not None:
            try:
                self._engine.check_mix(mix)
            except AdapterMixError as e:
                raise InvalidArgument([FieldViolation(field, str(e))]) from None

    async def _compile(self, spec: StructuredOutput, field: str) -> None:
        """INVALID_ARGUMENT naming the problem when the grammar does not compile, before any step."""
        if self._grammar_pool is None:
            self._grammar_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        try:
            await asyncio.get_running_loop().run_in_executor(self._grammar_pool, self._engine.compile_grammar, spec)
        except GrammarError as e:
            raise InvalidArgument([FieldViolation(field, f"does not compile: {e}")]) from None

    async def encode(self, text: str, add_special_tokens: bool = True, field: str = "text") -> list[int]:
        """The tokenizer's ids, in the tokenizer thread when the text is long; `field` names the text in a
        refusal."""
        if len(text) > self.max_text_chars:
            raise InvalidArgument([FieldViolation(field, (
                f"the text has {len(text)} characters; a prompt of at most {self.max_prompt} tokens holds at "
                f"most {self.max_text_chars} characters with this model's tokenizer (--max-prompt-tokens)"))])
        encode = self._engine.encode
        if len(text) <= TOKENIZE_IN_THREAD_CHARS:
            return encode(text, add_special_tokens)
        if self._tokenizer_pool is None:
            self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode, text, add_special_tokens)

    def note_input(self, nbytes: int) -> None:
        """A request of about `nbytes`: a large one gives its freed buffers back to the OS soon after."""
        if nbytes >= LARGE_REQUEST_BYTES:
            self._heap.after_large_request()


def validate(params: GenerateParams, prompt_ids: list[int] | None, limits: RequestLimits,
             model: ModelInfo) -> GenerationRequest:
    """`prompt_ids`: the tokenized text (the caller tokenizes), or None to take params.token_ids."""
    name = params.names
    bad: list[FieldViolation] = []
    sampling = _sampling_fields(params, bad)
    for f in ("request_id", "adapter"):
        if len(getattr(params, f)) > MAX_NAME_CHARS:
            bad.append(FieldViolation(name(f), f"at most {MAX_NAME_CHARS} characters, got {len(getattr(params, f))}"))
    adapter = _adapter(params, bad)
    prompt_ids = _prompt(params, prompt_ids, limits, model, bad)
    max_new_tokens = _max_new_tokens(params, len(prompt_ids), limits, model, bad)
    _check_stops(params, model, bad)
    n = 1 if params.n is None else params.n
    if not 1 <= n <= model.max_num_seqs:
        bad.append(FieldViolation(name("n"), f"must be in [1, {model.max_num_seqs}] (the choices run together: at "
                                             f"most --max-num-seqs), got {n}"))
    logit_bias = _logit_bias(params, model.vocab_size, bad)
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        bad.append(FieldViolation(name("top_logprobs"), f"must be <= {MAX_TOP_LOGPROBS}"))
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
        bad.append(FieldViolation(name("prompt_logprobs"), f"must be in [0, {MAX_PROMPT_LOGPROBS}], "
                                                           f"got {params.prompt_logprobs}"))
    structured_output = _structured_output(params, bad)
    if bad:
        raise InvalidArgument(bad)

    try:  # the engine's own checks; everything above should make this unreachable
        sampling_params = SamplingParams(
            **sampling, max_new_tokens=max_new_tokens, stop_token_ids=tuple(params.stop_token_ids),
            ignore_eos=params.ignore_eos, logprobs=params.logprobs, top_logprobs=params.top_logprobs,
            logit_bias=logit_bias, prompt_logprobs=params.prompt_logprobs, structured_output=structured_output,
        )
    except ValueError as e:
        raise InvalidArgument([FieldViolation(name("sampling"), str(e))]) from e
    return GenerationRequest(
        request_id=params.request_id or uuid.uuid4().hex,
        prompt_ids=prompt_ids,
        sampling=sampling_params,
        adapter=adapter,
        stop=tuple(params.stop),
        n=n,
        structured_output_field=name("structured_output"),
        adapters_field=name("adapters"),
    )


def _adapter(params: GenerateParams, bad: list[FieldViolation]) -> str | None:
    """The adapter's name, a mix's canonical name (lora_compile.lora.mixes), or None: the base model."""
    if not params.adapters:
        return params.adapter or None
    name = params.names
    if params.adapter:
        bad.append(FieldViolation(name("adapters"), f"name the adapters either here or as the model "
                                                    f"({params.adapter!r}), not both"))
        return None
    problems = mix_problems(params.adapters)  # (an oversized list is refused by its length, not walked)
    for index, problem in problems:
        bad.append(FieldViolation(name("adapters", index), problem))
    mix = None if problems else make_mix(list(params.adapters))
    return mix.name if mix is not None else None


def _structured_output(params: GenerateParams, bad: list[FieldViolation]) -> StructuredOutput | None:
    if params.structured_output is None:
        return None
    kind, spec = params.structured_output
    field = params.names("structured_output")
    if kind not in STRUCTURED_OUTPUT_KINDS:
        bad.append(FieldViolation(field, f"kind must be one of {sorted(STRUCTURED_OUTPUT_KINDS)}, got {kind!r}"))
    elif len(spec) > MAX_STRUCTURED_OUTPUT_CHARS:
        bad.append(FieldViolation(field, f"at most {MAX_STRUCTURED_OUTPUT_CHARS} characters, got {len(spec)}"))
    elif (not spec and kind != "json_object") or (kind == "choice" and spec == "[]"):
        bad.append(FieldViolation(field, f"the {kind} is empty"))
    else:
        return StructuredOutput(kind, spec)
    return None


def _prompt(params: GenerateParams, prompt_ids: list[int] | None, limits: RequestLimits, model: ModelInfo,
            bad: list[FieldViolation]) -> Sequence[int]:
    """The prompt's ids, checked (a too long list is returned unread: it is refused by its length alone)."""
    name = params.names
    max_prompt = min(model.max_seq_len - 1, limits.max_prompt_tokens or model.max_seq_len)
    if params.text is not None:
        field, ids = "text", prompt_ids or []
    elif params.token_ids is not None:
        field, ids = "token_ids", params.token_ids
        if len(ids) <= max_prompt:  # (a too long prompt is refused below, without reading every id)
            ids = list(ids)
            _check_ids(ids, name, "token_ids", model.vocab_size, bad)
    else:
        bad.append(FieldViolation(name("input"), "set text or token_ids"))
        return []
    if not ids or (field == "text" and not params.text):  # BOS alone is no prompt
        bad.append(FieldViolation(name(field), "the prompt is empty"))
    elif len(ids) >= model.max_seq_len:
        bad.append(FieldViolation(name(field), f"the prompt has {len(ids)} tokens; the context holds "
                                               f"{model.max_seq_len}, including at least one new token"))
    elif len(ids) > max_prompt:
        bad.append(FieldViolation(name(field), f"the prompt has {len(ids)} tokens; this server accepts at most "
                                               f"{max_prompt} (--max-prompt-tokens)"))
    return ids


def _max_new_tokens(params: GenerateParams, prompt_len: int, limits: RequestLimits, model: ModelInfo,
                    bad: list[FieldViolation]) -> int:
    room = max(1, model.max_seq_len - prompt_len)
    if params.max_new_tokens is None:  # up to the end of the context, or the operator's limit
        return min(room, limits.max_new_tokens or room)
    max_new_tokens, field = params.max_new_tokens, params.names("max_new_tokens")
    if max_new_tokens < 1:
        bad.append(FieldViolation(field, "must be >= 1"))
    elif limits.max_new_tokens is not None and max_new_tokens > limits.max_new_tokens:
        bad.append(FieldViolation(field, f"this server allows at most {limits.max_new_tokens} new tokens per "
                                         "request (--max-new-tokens-limit)"))
    elif prompt_len and prompt_len + max_new_tokens > model.max_seq_len:
        bad.append(FieldViolation(field, f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                                         f"the context (max_seq_len {model.max_seq_len}); at most {room}"))
    return max_new_tokens


def _check_stops(params: GenerateParams, model: ModelInfo, bad: list[FieldViolation]) -> None:
    name, stops, stop_ids = params.names, params.stop, params.stop_token_ids
    if len(stops) > MAX_STOP_STRINGS:  # (a huge list is refused as a whole, not walked)
        bad.append(FieldViolation(name("stop"), f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"))
    else:
        for i, stop in enumerate(stops):
            if not stop:
                bad.append(FieldViolation(name("stop", i), "must not be empty"))
            elif len(stop) > MAX_STOP_CHARS:
                bad.append(FieldViolation(name("stop", i), f"at most {MAX_STOP_CHARS} characters"))
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        bad.append(FieldViolation(name("stop_token_ids"),
                                  f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(stop_ids)}"))
    else:
        _check_ids(stop_ids, name, "stop_token_ids", model.vocab_size, bad)


def _check_ids(ids: Sequence[int], name: FieldNames, param: str, vocab_size: int, bad: list[FieldViolation]) -> None:
    """Ids outside the vocabulary: the first few by index, then a count (the status must stay small)."""
    out_of_range = [(i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size]
    for i, token in out_of_range[:MAX_REPORTED_BAD_IDS]:
        bad.append(FieldViolation(name(param, i), f"token id {token} is outside the vocabulary [0, {vocab_size})"))
    if len(out_of_range) > MAX_REPORTED_BAD_IDS:
        bad.append(FieldViolation(name(param), f"{len(out_of_range) - MAX_REPORTED_BAD_IDS} more ids are outside "
                                               f"the vocabulary [0, {vocab_size})"))


def _logit_bias(params: GenerateParams, vocab_size: int, bad: list[FieldViolation]) -> tuple[tuple[int, float], ...]:
    """(token id, bias) sorted by id, as SamplingParams takes them; the problems of the first few entries."""
    bias, field = params.logit_bias, params.names("logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:  # (refused as a whole, not walked)
        bad.append(FieldViolation(field, f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}"))
        return ()
    entries = sorted(bias.items())
    low, high = LOGIT_BIAS_RANGE
    problems = [f"token id {t} is outside the vocabulary [0, {vocab_size})" for t, _ in entries
                if not 0 <= t < vocab_size]
    problems += [f"the bias of token {t} must be in [{low:g}, {high:g}], got {b:g}" for t, b in entries
                 if not (math.isfinite(b) and low <= b <= high)]
    bad.extend(FieldViolation(field, p) for p in problems[:MAX_REPORTED_BAD_IDS])
    if len(problems) > MAX_REPORTED_BAD_IDS:
        bad.append(FieldViolation(field, f"{len(problems) - MAX_REPORTED_BAD_IDS} more entries are refused"))
    return tuple(entries)


def _sampling_fields(params: GenerateParams, bad: list[FieldViolation]) -> dict:
    """The set fields, checked; unset ones are left to SamplingParams' defaults."""
    out: dict = {}
    for rule in SAMPLING_RULES:
        value = getattr(params, rule, None)
        if value is None:
            continue
        if (problem := sampling_problem(rule, value)) is not None:
            bad.append(FieldViolation(params.names(rule), problem))
        else:
            out[rule] = value
    if params.seed is not None:
        out["seed"] = params.seed
    return out
