"""The telemetry observer: every request span, engine-step span and GenAI metric, built from what the runner
reports. It observes; it never steers (vLLM v1's record_event / take_events).

The runner stamps lifecycle events on each request (service/runner/request.py RequestEventType), always, and calls
  on_added(state)       add_request, in the gRPC call's context: the request span opens under its server span
  on_iteration(result)  after each iteration: admission and first-token spans from the events, the step span
  on_finished(state)    the request's stream ended: usage, token metrics
and the tracing interceptor calls on_call_end(call): the request span ends with the call's status (a Generate
call refused before it reached the runner gets a request span here alone). Spans carry explicit start and end
times from the events and StepOutputs; the scheduler never imports this module.

Spans of one Generate call:
  loraserve.v1.Generation/Generate        SERVER (telemetry_interceptor.py)
  └ text_completion {adapter|base model}  GenAI attributes; events first_token, cancelled
    ├ queue                               queued → admission
    ├ adapter.load                        its adapter was read from disk and/or copied into a device slot for it;
    │ ├ adapter.load.disk_read            attribute lora_serve.adapter.wait_s: how long the request was blocked
    │ └ adapter.load.device_copy          on it (queued → adapter in host memory)
    └ prefill                             admission → first token
and per engine step (a trace of its own, linked to the request spans of the sequences it ran):
  engine.step → lora.batch_init, [lora.merge,] model.forward, sample
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link

from service.front.generate_params import GenerateParams
from service.runner.request import RequestEventType
from service.telemetry.adapter_events import LOAD_BUCKETS, adapter_metric
from service.telemetry.interceptor import CallSpan, current_call, set_error
from service.telemetry.setup import Telemetry, never_raise

if TYPE_CHECKING:
    from lora_compile.core.step_output import StepOutput
    from service.runner.reports import IterationResult
    from service.runner.request_state import RequestState

MAX_MODEL_LABELS = 64    # distinct gen_ai.request.model values on metrics; later ones are "other"
OTHER_MODEL = "other"
OPERATION = "text_completion"
_GENERATE = "Generate"   # the gRPC method whose calls carry a request span

# Histogram buckets: the GenAI semantic conventions' advice, and ours for step phases (0.1 ms .. 1 s).
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 81.92)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304, 16777216, 67108864)
_STEP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_ROOT = Context()  # engine steps start their own traces, whatever the current context


class _Request:
    """The observer's record of one request span: the span, and how far it has read the request's events."""

    __slots__ = ("span", "ctx", "model", "attrs", "start_ns", "call", "seen", "queued_ns", "admit_start_ns",
                 "admit_end_ns", "first_token_ns", "error", "aborted", "ended")

    def __init__(self, span: trace.Span, model: str, attrs: dict[str, str], start_ns: int, call: CallSpan | None):
        self.span = span
        self.ctx = trace.set_span_in_context(span)
        self.model = model
        self.attrs = attrs  # on the request metrics
        self.start_ns = start_ns
        self.call = call
        self.seen = 0  # events read so far
        self.queued_ns: int | None = None
        self.admit_start_ns: int | None = None
        self.admit_end_ns: int | None = None
        self.first_token_ns: int | None = None
        self.error: BaseException | None = None
        self.aborted = False
        self.ended = False


class TelemetryObserver:
    """Builds request and step spans and the metrics. `known_adapter`: whether a name is registered (unknown
    names stay out of span names and metric labels)."""

    def __init__(self, telemetry: Telemetry, model_name: str, known_adapter: Callable[[str], bool] = lambda _: True,
                 max_model_labels: int = MAX_MODEL_LABELS, adapter_tiers: Callable[[], dict[str, int]] | None = None):
        self.tracer = telemetry.tracer
        self._model_name = model_name
        self._known = known_adapter
        self._requests: dict[RequestState, _Request] = {}  # added, stream not ended
        self._by_call: dict[CallSpan, list[_Request]] = {}  # added in a traced call (one per choice), not ended
        meter = telemetry.meter
        self.ttft = meter.create_histogram(
            "gen_ai.server.time_to_first_token", "s", "Time from the request's arrival to its first token",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS)
        self.tpot = meter.create_histogram(
            "gen_ai.server.time_per_output_token", "s", "Time per output token after the first",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS)
        self.duration = meter.create_histogram(
            "gen_ai.server.request.duration", "s", "Generate duration, from arrival to the last token or error",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
        # Semconv defines token usage as a client metric only; the server reports the same histogram.
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", "{token}", "Input and output tokens per request",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)
        self.batch_init = meter.create_histogram(
            "lora_serve.step.batch_init.duration", "s", "Engine step: batch init (LoRA and attention metadata)",
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS)
        self.forward = meter.create_histogram(
            "lora_serve.step.forward.duration", "s", "Engine step: the model's forward",
            explicit_bucket_boundaries_advisory=_STEP_BUCKETS)
        # Adapter tiers (the runner's adapter events; /metrics counts the same events, prometheus.py).
        self.adapter_loads = meter.create_counter(
            "lora_serve.adapter.loads", "{load}", "Adapter reads from disk, by result (ok, error)")
        self.adapter_evictions = meter.create_counter(
            "lora_serve.adapter.evictions", "{eviction}", "Adapters evicted, by tier left (host, device)")
        self.adapter_load_time = meter.create_histogram(
            "lora_serve.adapter.load.duration", "s", "Adapter load phases: disk_read (loader thread), device_copy "
            "(between steps)", explicit_bucket_boundaries_advisory=LOAD_BUCKETS)
        if adapter_tiers is not None:
            from opentelemetry.metrics import Observation

            meter.create_observable_gauge(
                "lora_serve.adapter.count", [lambda _options: [Observation(n, {"lora_serve.adapter.tier": tier})
                                                               for tier, n in adapter_tiers().items()]],
                "{adapter}", "Known adapters by the fastest tier holding them (device, host, disk)")
        self._labels: dict[str, str] = {}
        self._max_labels = max_model_labels

    def model_label(self, model: str) -> str:
        """The model or adapter name as a metric attribute; "other" once the label budget is spent."""
        label = self._labels.get(model)
        if label is None:
            if len(self._labels) >= self._max_labels:
                return OTHER_MODEL
            label = self._labels[model] = model
        return label

    # --- the runner's hooks ------------------------------------------------------------------------------
    @never_raise
    def on_added(self, state: RequestState) -> None:
        call = current_call()
        if call is not None and call.method != _GENERATE:
            call = None
        rec = self._open(state.request.adapter, call, state.events[0].time_ns if call is None else call.start_ns)
        self._requests[state] = rec
        if call is not None:
            self._by_call.setdefault(call, []).append(rec)
        rec.span.set_attributes({"gen_ai.usage.input_tokens": len(state.request.prompt_ids),
                                 "lora_serve.request.id": state.request.request_id})
        self._read_events(rec, state)

    @never_raise
    def on_iteration(self, result: IterationResult) -> None:
        for state in (*result.admitted, *result.stepped):
            rec = self._requests.get(state)
            if rec is not None and not rec.ended and rec.seen < len(state.events):
                self._read_events(rec, state)
        self.record_adapter_events(result.adapter_events)
        if result.step is not None:  # None: the step failed (its requests end with INTERNAL) or nothing ran
            self.record_step(result.step, len(result.stepped),
                             [rec for s in result.stepped if (rec := self._requests.get(s)) is not None])

    @never_raise
    def on_finished(self, state: RequestState) -> None:
        rec = self._requests.pop(state, None)
        if rec is None or rec.ended:
            return
        self._read_events(rec, state)
        if rec.call is None:  # not a traced gRPC call: the events give the status
            code = grpc.StatusCode.OK
            if rec.error is not None:  # (a ServiceError knows its code; anything else is a bug)
                code = getattr(rec.error, "code", None)
                code = code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.INTERNAL
            self._end(rec, code, rec.aborted, time.time_ns(), str(rec.error) if rec.error else None)
        # else the call's status is still to come (the handler ends the stream before the call ends): on_call_end

    # --- the interceptor's hook ----------------------------------------------------------------------------
    @never_raise
    def on_call_end(self, call: CallSpan) -> None:
        """A call that reached its handler ended; its request spans (one per choice) end with the call's status."""
        if call.method != _GENERATE:
            return
        recs = self._by_call.pop(call, None)
        if recs is None:  # refused before the runner (invalid, unknown adapter, queue full): a request span alone
            recs = [self._open(call.request.adapter, call, call.start_ns)]
        for rec in recs:
            self._end(rec, call.code or grpc.StatusCode.UNKNOWN, call.cancelled, call.end_ns or time.time_ns(),
                      call.message)

    # --- request spans -----------------------------------------------------------------------------------
    def _open(self, adapter: str | None, call: CallSpan | None, start_ns: int) -> _Request:
        model = adapter or self._model_name
        known = not adapter or self._known(adapter)
        attributes = {"gen_ai.operation.name": OPERATION, "gen_ai.request.model": model[:256]}
        if call is not None:
            attributes.update(_request_attributes(call.request))
        parent = trace.set_span_in_context(call.span) if call is not None else None
        span = self.tracer.start_span(f"{OPERATION} {model}" if known else OPERATION, context=parent,
                                      start_time=start_ns, attributes=attributes)
        attrs = {"gen_ai.operation.name": OPERATION,
                 "gen_ai.request.model": self.model_label(model) if known else OTHER_MODEL}
        return _Request(span, model, attrs, start_ns, call)

    def _read_events(self, rec: _Request, state: RequestState) -> None:
        events = state.events
        while rec.seen < len(events):
            event = events[rec.seen]
            rec.seen += 1
            kind, at, fields = event.type, event.time_ns, event.fields or {}
            if kind is RequestEventType.QUEUED:
                rec.queued_ns = at
            elif kind is RequestEventType.ADMITTED:
                rec.admit_start_ns, rec.admit_end_ns = fields["start_ns"], at
                self._child(rec, "queue", rec.queued_ns or rec.admit_start_ns, rec.admit_start_ns)
                if fields.get("adapter_loaded") or fields.get("adapter_read"):
                    self._adapter_load(rec, fields, at)
            elif kind is RequestEventType.FIRST_TOKEN:
                rec.first_token_ns = at
                ttft = (at - rec.start_ns) / 1e9
                self._child(rec, "prefill", rec.admit_end_ns or at, at)
                rec.span.add_event("first_token", timestamp=at)
                rec.span.set_attribute("gen_ai.server.time_to_first_token", ttft)
                self.ttft.record(ttft, rec.attrs)
            elif kind is RequestEventType.FINISHED:
                if "error" in fields:
                    rec.error = fields["error"]
                else:
                    self._finished(rec, at, fields)
            elif kind is RequestEventType.ABORTED:
                rec.aborted = True

    def _adapter_load(self, rec: _Request, fields: dict[str, Any], admitted_ns: int) -> None:
        """adapter.load under the request: the disk read it waited for, the device copy its admission made."""
        if not rec.span.is_recording():
            return
        read = fields.get("adapter_read")
        copied = fields.get("adapter_loaded")
        start = read[0] if read else rec.admit_start_ns
        end = admitted_ns if copied else read[1]
        attrs: dict[str, Any] = {"lora_serve.adapter.name": rec.model}
        waited = fields.get("adapter_wait_start_ns")
        if waited is not None:
            attrs["lora_serve.adapter.wait_s"] = max(0, (read[1] if read else rec.admit_start_ns) - waited) / 1e9
        span = self.tracer.start_span("adapter.load", context=rec.ctx, start_time=start, attributes=attrs)
        ctx = trace.set_span_in_context(span)
        if read:
            self.tracer.start_span("adapter.load.disk_read", context=ctx, start_time=read[0],
                                   attributes={"lora_serve.adapter.phase": "disk_read"}).end(end_time=read[1])
        if copied:
            self.tracer.start_span("adapter.load.device_copy", context=ctx, start_time=rec.admit_start_ns,
                                   attributes={"lora_serve.adapter.phase": "device_copy"}).end(end_time=admitted_ns)
        span.end(end_time=end)

    def record_adapter_events(self, events) -> None:
        for m in map(adapter_metric, events):
            if m.evicted_tier is not None:
                self.adapter_evictions.add(1, {"lora_serve.adapter.tier": m.evicted_tier})
            if m.load_result is not None:
                self.adapter_loads.add(1, {"lora_serve.adapter.load.result": m.load_result})
            if m.phase is not None:
                self.adapter_load_time.record(m.seconds, {"lora_serve.adapter.phase": m.phase})

    def _finished(self, rec: _Request, at: int, fields: dict[str, Any]) -> None:
        """The last output: usage and finish reason (the span ends with the stream, or the call)."""
        prompt, completion = fields["prompt_tokens"], fields["completion_tokens"]
        # cache_read: the semantic conventions' name for input tokens served from a cache (the prefix cache)
        rec.span.set_attributes({"gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": completion,
                                 "gen_ai.usage.cache_read.input_tokens": fields.get("cached_tokens", 0),
                                 "gen_ai.response.finish_reasons": [fields["finish_reason"] or ""]})
        self.token_usage.record(prompt, {**rec.attrs, "gen_ai.token.type": "input"})
        self.token_usage.record(completion, {**rec.attrs, "gen_ai.token.type": "output"})
        if rec.first_token_ns is not None and completion > 1:
            self.tpot.record((at - rec.first_token_ns) / 1e9 / (completion - 1), rec.attrs)

    def _end(self, rec: _Request, code: grpc.StatusCode, cancelled: bool, now: int, message: str | None) -> None:
        rec.ended = True
        if rec.admit_start_ns is not None:
            if rec.first_token_ns is None:
                self._child(rec, "prefill", rec.admit_end_ns, now)
        elif rec.queued_ns is not None:
            self._child(rec, "queue", rec.queued_ns, now)  # never admitted
        span = rec.span
        if cancelled:
            span.add_event("cancelled", {"lora_serve.cancel.source": "client"}, timestamp=now)
            span.set_attributes({"lora_serve.cancelled": True, "gen_ai.response.finish_reasons": ["cancelled"]})
        else:
            attrs = rec.attrs
            if code is not grpc.StatusCode.OK:
                set_error(span, code, message)
                attrs = {**attrs, "error.type": code.name}
            # Client-cancelled requests are left out: how long they ran was the client's choice.
            self.duration.record((now - rec.start_ns) / 1e9, attrs)
        span.end(end_time=now)

    def _child(self, rec: _Request, name: str, start: int, end: int, attributes: dict[str, Any] | None = None) -> None:
        if rec.span.is_recording():
            self.tracer.start_span(name, context=rec.ctx, start_time=start, attributes=attributes).end(end_time=end)

    # --- engine steps ------------------------------------------------------------------------------------
    def record_step(self, step: StepOutput, batch_size: int, requests: Iterable[_Request] = ()) -> None:
        kind = {"lora_serve.step.kind": step.kind}
        self.batch_init.record(step.batch_init_s, kind)
        self.forward.record(step.forward_s, kind)
        t0 = step.start_ns
        t1 = t0 + int(step.batch_init_s * 1e9)
        t1m = t1 + int(step.merge_s * 1e9)
        t2 = t1m + int(step.forward_s * 1e9)
        t2a = t2 + int(step.batch_init_ahead_s * 1e9)  # the next step's build, while the device ran this one
        t3 = step.end_ns
        links = [Link(rec.span.get_span_context()) for rec in requests if rec.span.is_recording()]
        span = self.tracer.start_span("engine.step", context=_ROOT, links=links, start_time=t0, attributes={
            "lora_serve.step.kind": step.kind,
            "lora_serve.step.batch_size": batch_size,
            "lora_serve.step.num_tokens": step.num_tokens,
            "lora_serve.step.num_adapters": step.num_adapters,
            "lora_serve.step.num_sampled": len(step.seq_ids),
            "lora_serve.step.lora_merged": step.merged,
            "lora_serve.step.cuda_graph": step.cuda_graph,
        })
        if span.is_recording():
            ctx = trace.set_span_in_context(span)
            children = [("lora.batch_init", t0, t1), ("model.forward", t1m, t2), ("sample", t2a, t3)]
            if step.merge_s:  # this step merged its lone adapter into the weights first (lora_compile/lora/merge.py)
                children.insert(1, ("lora.merge", t1, t1m))
            if step.batch_init_ahead_s:  # (lora_compile.core.step_ahead)
                children.insert(-1, ("lora.batch_init_ahead", t2, t2a))
            for name, start, end in children:
                self.tracer.start_span(name, context=ctx, start_time=start).end(end_time=end)
        span.end(end_time=t3)


_SAMPLING_ATTRIBUTES = (("temperature", "gen_ai.request.temperature"), ("top_p", "gen_ai.request.top_p"),
                        ("top_k", "gen_ai.request.top_k"), ("seed", "gen_ai.request.seed"))


def _request_attributes(request: Any) -> dict[str, Any]:
    """The sampling parameters the client set (unset ones are the server's defaults, not the request's): from the
    GenerateParams an HTTP request became, or a gRPC call's GenerateRequest."""
    if isinstance(request, GenerateParams):
        values = {field: getattr(request, field) for field, _ in _SAMPLING_ATTRIBUTES}
        max_tokens = request.max_new_tokens
    else:
        sampling, stopping = request.sampling, request.stopping
        values = {field: getattr(sampling, field) for field, _ in _SAMPLING_ATTRIBUTES if sampling.HasField(field)}
        max_tokens = stopping.max_new_tokens if stopping.HasField("max_new_tokens") else None
    attrs: dict[str, Any] = {}
    for field, key in _SAMPLING_ATTRIBUTES:
        value = values.get(field)
        if isinstance(value, float):
            value = round(value, 6)  # float32 on the wire: 0.8 arrives as 0.800000011920929
        elif value is not None and value >= 2**63:
            value = str(value)  # a uint64 seed beyond OTLP's int64
        if value is not None:
            attrs[key] = value
    if max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = max_tokens
    return attrs
