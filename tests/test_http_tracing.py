"""Tracing of the HTTP door: an OpenAI request continues the caller's `traceparent`, gets the same request span
as a gRPC Generate call (GenAI attributes, queue/prefill children) and joins the same engine step spans."""
from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from service.server import ServerConfig
from service.tools.otlp_receiver import GrpcReceiver
from tests.service_harness import openai_client
from tests.test_tracing import (
    BASE_ENV,
    PROMPT,
    Stack,
    children,
    in_trace,
    linked_steps,
    traceparent,
)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack({**BASE_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, GrpcReceiver,
              ServerConfig(port=0, http_port=0, grace_period_s=10.0))
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(stack) -> Iterator[openai.OpenAI]:
    with openai_client(stack.served, timeout=openai.NOT_GIVEN) as c:
        yield c


@pytest.mark.parametrize("stream", [False, True])
def test_http_request_spans_join_the_callers_trace_and_the_steps(stack, client, stream):
    header, trace_id, parent_id = traceparent()
    result = client.completions.create(model="pirate", prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9,
                                       seed=7, stream=stream, extra_body={"ignore_eos": True},
                                       extra_headers={"traceparent": header})
    if stream:
        assert [c.choices[0].finish_reason for c in result][-1] == "length"

    def ready(spans):
        return (in_trace(spans, trace_id, "POST /v1/completions")
                and any(len(linked_steps(spans, r)) >= 6 for r in in_trace(spans, trace_id, "text_completion")))

    spans = stack.collect(ready)
    [server] = in_trace(spans, trace_id, "POST /v1/completions")
    assert server.parent_id == parent_id and server.kind == "SERVER" and server.status != "ERROR"
    assert server.attributes["http.response.status_code"] == 200
    [req_span] = in_trace(spans, trace_id, "text_completion")
    assert req_span.name == "text_completion pirate" and req_span.parent_id == server.span_id
    a = req_span.attributes
    assert (a["gen_ai.request.model"], a["gen_ai.request.temperature"], a["gen_ai.request.top_p"],
            a["gen_ai.request.seed"], a["gen_ai.request.max_tokens"]) == ("pirate", 0.7, 0.9, 7, 6)
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.response.finish_reasons"] == ["length"]
    assert {"queue", "prefill"} <= children(spans, req_span).keys()
    assert len(linked_steps(spans, req_span)) >= 6  # one token per step


def test_a_refused_http_request_has_an_error_span(stack, client):
    header, trace_id, _ = traceparent()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt=PROMPT, extra_headers={"traceparent": header})
    spans = stack.collect(lambda s: in_trace(s, trace_id, "text_completion"))
    [server] = in_trace(spans, trace_id, "POST /v1/completions")
    assert server.status == "ERROR" and server.attributes["error.type"] == "NOT_FOUND"
    assert server.attributes["http.response.status_code"] == 404
    [req_span] = in_trace(spans, trace_id, "text_completion")
    assert req_span.status == "ERROR" and req_span.parent_id == server.span_id
