"""OpenTelemetry end to end: the server exports to a real in-process OTLP receiver (gRPC, and HTTP/protobuf),
and the span trees, links, statuses and metrics it receives are checked. Also: a dead collector neither fails
nor slows requests, and tracing off creates nothing."""
from __future__ import annotations

import io
import json
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import redirect_stdout
from pathlib import Path

import grpc
import pytest

import service.telemetry.observer as telemetry_observer
import service.telemetry.setup as telemetry_setup
import service.tools.trace_summary as trace_summary
from service._proto import pb, pb_grpc
from service.server import LoraServer, ServerConfig
from service.telemetry.observer import TelemetryObserver
from service.telemetry.setup import Telemetry, setup_telemetry
from service.tools.otlp_receiver import GrpcReceiver, HttpReceiver, OtlpSink, SpanRecord, spans_from_proto, to_otlp_json
from tests.service_harness import ServerThread, shared_engine

PROMPT = "Once upon a time"


class TracedServer(ServerThread):
    """A ServerThread whose LoraServer exports to `telemetry` (None: tracing off)."""

    def __init__(self, telemetry: Telemetry | None, config: ServerConfig | None = None):
        self.telemetry = telemetry
        self._channel: grpc.Channel | None = None
        super().__init__(shared_engine(), config)

    async def _start(self, warmup: bool) -> None:
        self.server = LoraServer(self.engine, self.config, self.telemetry)
        await self.server.start()
        if warmup:
            await self.server.warmup()

    def stub(self) -> pb_grpc.GenerationStub:
        """Raw calls: they carry our own `traceparent` metadata."""
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        return pb_grpc.GenerationStub(self._channel)

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        super().stop()


class Stack:
    """Receiver + telemetry from the OTEL_* environment + a traced server."""

    def __init__(self, env: dict[str, str], receiver: Callable[[OtlpSink], GrpcReceiver | HttpReceiver] | None,
                 config: ServerConfig | None = None):
        self.sink = OtlpSink()
        self.receiver = receiver(self.sink) if receiver else None
        with pytest.MonkeyPatch.context() as mp:  # the exporters read the environment when built
            for key, value in env.items():
                mp.setenv(key, value.format(endpoint=self.receiver.endpoint if self.receiver else ""))
            self.telemetry = setup_telemetry()
        self.served = TracedServer(self.telemetry, config)

    def collect(self, ready: Callable[[list[SpanRecord]], bool], timeout: float = 10.0) -> list[SpanRecord]:
        """Flush until the receiver has what `ready` wants (the server ends a call's spans just after the
        client has its last message, so one flush may come a moment early)."""
        deadline = time.monotonic() + timeout
        while True:
            self.telemetry.force_flush()
            spans = self.sink.spans()
            if ready(spans):
                return spans
            assert time.monotonic() < deadline, "the receiver did not get the expected spans"
            time.sleep(0.02)

    def close(self) -> None:
        self.served.stop()
        self.telemetry.shutdown(timeout_s=2.0)
        if self.receiver:
            self.receiver.stop()


BASE_ENV = {"OTEL_SERVICE_NAME": "lora-serve-test", "OTEL_EXPORTER_OTLP_ENDPOINT": "{endpoint}",
            "OTEL_METRIC_EXPORT_INTERVAL": "600000"}  # metrics leave on force_flush


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack({**BASE_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, GrpcReceiver)
    yield s
    s.close()


def traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def request(adapter: str = "", max_new_tokens: int = 6, **sampling) -> pb.GenerateRequest:
    req = pb.GenerateRequest(text=PROMPT, adapter=adapter)
    for key, value in sampling.items():
        setattr(req.sampling, key, value)
    req.stopping.max_new_tokens = max_new_tokens
    req.stopping.ignore_eos = True
    return req


def in_trace(spans: list[SpanRecord], trace_id: str, name: str) -> list[SpanRecord]:
    return [s for s in spans if s.trace_id == trace_id and s.name.startswith(name)]


def children(spans: list[SpanRecord], parent: SpanRecord) -> dict[str, SpanRecord]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


def linked_steps(spans: list[SpanRecord], target: SpanRecord) -> list[SpanRecord]:
    return [s for s in spans if s.name == "engine.step" and (target.trace_id, target.span_id) in s.links]


def test_generate_span_tree(stack: Stack):
    engine = stack.served.engine
    # Two device slots, three demo adapters: at least one is not on the device, so admission loads it.
    adapter = next(a.name for a in engine.adapters.list() if a.device_slot is None)
    header, trace_id, parent_id = traceparent()
    req = request(adapter, temperature=0.7, top_p=0.9, top_k=20, seed=7)
    responses = list(stack.served.stub().Generate(req, metadata=(("traceparent", header),)))
    assert responses[-1].usage.completion_tokens == 6

    def ready(spans):
        return (in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")
                and any(len(linked_steps(spans, r)) >= 6 for r in in_trace(spans, trace_id, "text_completion")))

    spans = stack.collect(ready)
    [server] = in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")
    assert server.parent_id == parent_id and server.kind == "SERVER"  # the client's trace, continued
    assert server.service == "lora-serve-test" and server.status != "ERROR"
    assert server.attributes["rpc.grpc.status_code"] == 0 and server.attributes["rpc.method"] == "Generate"

    [req_span] = in_trace(spans, trace_id, "text_completion")
    assert req_span.name == f"text_completion {adapter}" and req_span.parent_id == server.span_id
    a = req_span.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == adapter
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"], a["gen_ai.request.top_k"],
            a["gen_ai.request.seed"], a["gen_ai.request.max_tokens"]) == (0.7, 0.9, 20, 7, 6)
    assert a["gen_ai.usage.input_tokens"] == responses[-1].usage.prompt_tokens
    assert a["gen_ai.usage.cache_read.input_tokens"] == responses[-1].usage.cached_tokens  # the prefix cache's
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert 0 < a["gen_ai.server.time_to_first_token"] < req_span.duration_ns / 1e9

    kids = children(spans, req_span)
    assert {"queue", "adapter.load", "prefill"} <= kids.keys()
    queue, load, prefill = kids["queue"], kids["adapter.load"], kids["prefill"]
    assert req_span.start_ns <= queue.start_ns <= queue.end_ns <= load.start_ns <= load.end_ns <= prefill.start_ns
    [first_token] = [e for e in req_span.events if e.name == "first_token"]
    assert prefill.end_ns == first_token.time_ns <= req_span.end_ns

    steps = linked_steps(spans, req_span)
    assert len(steps) >= 6  # one token per step; the prompt's prefill is one of them
    assert sorted(steps, key=lambda s: s.start_ns)[0].attributes["lora_serve.step.kind"] in ("prefill", "mixed")
    for step in steps:
        sa = step.attributes
        assert sa["lora_serve.step.batch_size"] >= 1 and sa["lora_serve.step.num_tokens"] >= 1
        assert sa["lora_serve.step.num_adapters"] >= 1 and sa["lora_serve.step.kind"] in ("prefill", "decode", "mixed")
        # decode steps replay CUDA graphs on a GPU only
        assert sa["lora_serve.step.cuda_graph"] is (engine.device.type == "cuda" and sa["lora_serve.step.kind"] == "decode")
        phases = children(spans, step)
        init, forward, sample = phases["lora.batch_init"], phases["model.forward"], phases["sample"]
        before_forward = init
        if "lora.merge" in phases:  # a lone adapter being merged (lora/merge.py): its share sits between the two
            before_forward = phases["lora.merge"]
            assert init.end_ns == before_forward.start_ns <= before_forward.end_ns
        assert step.start_ns == init.start_ns <= init.end_ns
        assert before_forward.end_ns == forward.start_ns <= forward.end_ns
        assert forward.end_ns == sample.start_ns and sample.end_ns == step.end_ns
        assert step.parent_id == ""  # each step is a trace of its own


def test_a_merging_step_shows_its_merge_between_batch_init_and_forward(stack: Stack):
    """A step that merged its lone adapter into the weights (lora/merge.py) carries that cost as its own span."""
    from lora_compile.core.step_output import StepOutput
    step = StepOutput(seq_ids=[7], token_ids=[3], num_tokens=4, num_adapters=1, kind="decode", merged=True,
                      start_ns=time.time_ns(), batch_init_s=0.001, merge_s=0.120, forward_s=0.050, sample_s=0.002)
    stack.served.server.observer.record_step(step, batch_size=4)

    def merged_steps(spans):
        return [s for s in spans if s.name == "engine.step" and s.start_ns == step.start_ns]

    [span] = merged_steps(stack.collect(merged_steps))
    assert span.attributes["lora_serve.step.lora_merged"] is True
    phases = children(stack.sink.spans(), span)
    init, merge, forward = phases["lora.batch_init"], phases["lora.merge"], phases["model.forward"]
    assert init.end_ns == merge.start_ns and merge.end_ns == forward.start_ns == init.end_ns + 120_000_000
    assert phases["sample"].end_ns == span.end_ns


def test_sdk_continues_the_callers_trace(stack: Stack):
    """The SDK sends the current OpenTelemetry span's context: the server's spans join the caller's trace."""
    from opentelemetry import context, trace
    _, trace_id, parent_id = traceparent()
    caller = trace.NonRecordingSpan(trace.SpanContext(int(trace_id, 16), int(parent_id, 16), is_remote=False,
                                                      trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)))
    token = context.attach(trace.set_span_in_context(caller))
    try:
        with stack.served.client() as client:
            assert client.complete(PROMPT, max_new_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    finally:
        context.detach(token)
    spans = stack.collect(lambda s: in_trace(s, trace_id, "loraserve.v1.Generation/Generate"))
    assert in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")[0].parent_id == parent_id
    with stack.served.client() as client:  # no current span: no trace context is sent
        assert client.complete(PROMPT, max_new_tokens=1).usage.completion_tokens == 1


def test_invalid_request_is_an_error(stack: Stack):
    header, trace_id, _ = traceparent()
    with pytest.raises(grpc.RpcError) as err:
        list(stack.served.stub().Generate(request(temperature=-1.0), metadata=(("traceparent", header),)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = stack.collect(lambda s: in_trace(s, trace_id, "loraserve.v1.Generation/Generate"))
    [server] = in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")
    [req_span] = in_trace(spans, trace_id, "text_completion")
    for span in (server, req_span):
        assert span.status == "ERROR" and span.attributes["error.type"] == "INVALID_ARGUMENT"
        assert "sampling.temperature" in span.status_message
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert not children(spans, req_span)  # refused before the queue


def test_client_cancel_is_a_cancel_not_an_error(stack: Stack):
    header, trace_id, _ = traceparent()
    call = stack.served.stub().Generate(request(max_new_tokens=200), metadata=(("traceparent", header),))
    stream = iter(call)
    for _ in range(2):
        next(stream)
    call.cancel()
    spans = stack.collect(lambda s: in_trace(s, trace_id, "loraserve.v1.Generation/Generate"))
    [server] = in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")
    [req_span] = in_trace(spans, trace_id, "text_completion")
    for span in (server, req_span):
        assert span.status != "ERROR" and "error.type" not in span.attributes
        assert [e.attributes for e in span.events if e.name == "cancelled"] == [{"lora_serve.cancel.source": "client"}]
    assert server.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]
    assert req_span.attributes["lora_serve.cancelled"] is True
    assert {"queue", "prefill"} <= children(spans, req_span).keys()
    stack.served.wait_idle()


def test_unary_calls_get_a_server_span(stack: Stack):
    header, trace_id, _ = traceparent()
    stack.served.stub().Tokenize(pb.TokenizeRequest(text="hi"), metadata=(("traceparent", header),))
    spans = stack.collect(lambda s: in_trace(s, trace_id, "loraserve.v1.Generation/Tokenize"))
    [span] = in_trace(spans, trace_id, "loraserve.v1.Generation/Tokenize")
    assert span.kind == "SERVER" and span.attributes["rpc.grpc.status_code"] == 0


def test_metrics(stack: Stack):
    list(stack.served.stub().Generate(request("pirate", max_new_tokens=4)))
    with pytest.raises(grpc.RpcError):
        list(stack.served.stub().Generate(request(temperature=-1.0)))
    stack.telemetry.force_flush()
    points = stack.sink.histograms()
    names = {p.name for p in points}
    assert {"gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
            "gen_ai.server.request.duration", "gen_ai.client.token.usage",
            "lora_serve.step.batch_init.duration", "lora_serve.step.forward.duration"} <= names
    model = {"gen_ai.operation.name": "text_completion", "gen_ai.request.model": "pirate"}
    assert any(p.name == "gen_ai.server.time_to_first_token" and p.attributes == model and p.count for p in points)
    assert {p.attributes.get("gen_ai.token.type") for p in points if p.name == "gen_ai.client.token.usage"} == {
        "input", "output"}
    assert any(p.attributes.get("error.type") == "INVALID_ARGUMENT"
               for p in points if p.name == "gen_ai.server.request.duration")
    assert {p.attributes["lora_serve.step.kind"] for p in points
            if p.name == "lora_serve.step.forward.duration"} >= {"prefill", "decode"}


def test_trace_summary(stack: Stack, tmp_path):
    header, trace_id, _ = traceparent()
    list(stack.served.stub().Generate(request(max_new_tokens=3), metadata=(("traceparent", header),)))
    stack.collect(lambda s: any(linked_steps(s, r) for r in in_trace(s, trace_id, "text_completion")))
    requests = stack.sink.trace_requests()
    text = trace_summary.summary(spans_from_proto(requests))
    assert "lora.batch_init" in text and "model.forward" in text and "batch-init share of step time" in text
    assert "text_completion" in text and "engine.step spans linked to" in text
    # The same from an OTLP JSON file, through the command.
    path = tmp_path / "spans.jsonl"
    path.write_text("".join(json.dumps(to_otlp_json(r)) + "\n" for r in requests))
    out = io.StringIO()
    with redirect_stdout(out):
        assert trace_summary.main([str(path)]) == 0
    assert out.getvalue().strip() == text


def test_model_labels_are_bounded():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    tel = TelemetryObserver(Telemetry(TracerProvider(shutdown_on_exit=False), MeterProvider(shutdown_on_exit=False)),
                            "model", max_model_labels=2)
    assert [tel.model_label(n) for n in ("a", "b", "c", "a", "d")] == ["a", "b", "other", "a", "other"]


def test_http_protobuf():
    s = Stack({**BASE_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, HttpReceiver)
    try:
        header, trace_id, parent_id = traceparent()
        list(s.served.stub().Generate(request("poet", max_new_tokens=3), metadata=(("traceparent", header),)))
        spans = s.collect(lambda sp: any(linked_steps(sp, r) for r in in_trace(sp, trace_id, "text_completion")))
        [server] = in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")
        [req_span] = in_trace(spans, trace_id, "text_completion poet")
        assert server.parent_id == parent_id and req_span.parent_id == server.span_id
        assert {p.name for p in s.sink.histograms()} >= {"gen_ai.server.request.duration"}
    finally:
        s.close()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _median_latency(served: ServerThread, n: int) -> float:
    stub, times = served.stub(), []
    for _ in range(n):
        t0 = time.perf_counter()
        assert list(stub.Generate(request("scribe", max_new_tokens=8)))[-1].usage.completion_tokens == 8
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_dead_collector_neither_fails_nor_slows_requests(monkeypatch):
    made = []
    monkeypatch.setattr(telemetry_observer._Request, "__init__", lambda *a, **k: made.append(1) or None)
    plain = TracedServer(None)  # tracing off: no request trace is ever made
    try:
        base = _median_latency(plain, 4)
    finally:
        plain.stop()
    assert not made
    monkeypatch.undo()
    # Nothing listens there; exports are attempted every 20 ms while requests run.
    dead = Stack({**BASE_ENV, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{_free_port()}",
                  "OTEL_BSP_SCHEDULE_DELAY": "20"}, None)
    try:
        traced = _median_latency(dead.served, 4)
    finally:
        dead.served.stop()
        t0 = time.perf_counter()
        dead.telemetry.shutdown(timeout_s=1.0)
        shutdown_s = time.perf_counter() - t0
    assert traced < 1.5 * base + 0.05, (traced, base)
    assert shutdown_s < 2.0


def test_configuration_from_the_environment(monkeypatch):
    monkeypatch.delenv(telemetry_setup.TRACING_ENV, raising=False)
    assert not telemetry_setup.tracing_requested() and telemetry_setup.tracing_requested(True)
    monkeypatch.setenv(telemetry_setup.TRACING_ENV, "1")
    assert telemetry_setup.tracing_requested()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="grpc or http/protobuf"):
        setup_telemetry()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert setup_telemetry() is None
    from service.cli import serve_parser
    assert serve_parser().parse_args(["--tracing"]).tracing


def test_deadline_is_an_error(stack: Stack):
    # The deadline is half of a measured 40-token call, and the call asks for 160 tokens: it ends at the deadline.
    start = time.perf_counter()
    list(stack.served.stub().Generate(request(max_new_tokens=40)))
    deadline = max(0.02, (time.perf_counter() - start) / 2)
    header, trace_id, _ = traceparent()
    with pytest.raises(grpc.RpcError) as err:
        list(stack.served.stub().Generate(request(max_new_tokens=160), metadata=(("traceparent", header),),
                                          timeout=deadline))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    spans = stack.collect(lambda s: in_trace(s, trace_id, "loraserve.v1.Generation/Generate"))
    [server] = in_trace(spans, trace_id, "loraserve.v1.Generation/Generate")
    assert server.status == "ERROR" and server.attributes["error.type"] == "DEADLINE_EXCEEDED"
    stack.served.wait_idle()


def test_the_scheduler_does_not_import_telemetry():
    """Telemetry observes the runner; the runner never needs it (tracing off loads none of it)."""
    code = ("import sys, service.runner.engine_runner; "
            "print(sorted(m for m in sys.modules if m.startswith(('service.telemetry', 'service.tracing'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


def test_request_events_are_in_order_and_say_whether_the_adapter_was_loaded():
    """With tracing off the runner still stamps each request's lifecycle; admission says whether it copied the
    adapter into a device slot (cold) or found it there (resident)."""
    from lora_compile import SamplingParams
    from service.runner.request import GenerationRequest
    from service.runner.request import RequestEventType as E

    served = TracedServer(None)
    try:
        assert served.server.observer is None
        runner, engine = served.server.runner, served.engine
        prompt = engine.tokenizer.encode(PROMPT)

        async def generate(adapter: str | None):
            state = runner.add_request(GenerationRequest(secrets.token_hex(4), prompt,
                                                         SamplingParams(max_new_tokens=3, ignore_eos=True), adapter))
            while not (await state.next_output()).finished:
                pass
            runner.abort(state)  # the stream ends, as the servicer ends it
            return state.events

        cold = served.in_engine_thread(lambda: next(a.name for a in engine.adapters.list() if a.device_slot is None))
        for adapter, loaded in ((cold, True), (cold, False), (None, False)):  # the second finds it resident
            events = served.run(generate(adapter))
            assert [e.type for e in events] == [E.QUEUED, E.ADMITTED, E.FIRST_TOKEN, E.FINISHED], adapter
            assert [e.time_ns for e in events] == sorted(e.time_ns for e in events)
            queued, admitted, _, finished = events
            assert queued.time_ns <= admitted.fields["start_ns"] <= admitted.time_ns
            assert admitted.fields["adapter_loaded"] is loaded, (adapter, loaded)
            # (cached_tokens 0: the prompt is shorter than a KV block, so there is no full block to share)
            assert finished.fields == {"finish_reason": "length", "prompt_tokens": len(prompt), "completion_tokens": 3,
                                       "cached_tokens": 0}
        served.wait_idle()
    finally:
        served.stop()
