"""Adapter-load telemetry over OTLP: an on-demand adapter's request carries an adapter.load span (disk read and
device copy, and how long the request waited), and the adapter metrics (loads, load phases, evictions, tiers)
reach the collector."""
from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from benchmarks.common import write_lora_adapter
from service.telemetry.setup import setup_telemetry
from service.tools.otlp_receiver import GrpcReceiver, OtlpSink
from tests.service_harness import ServerThread, build_engine, demo_paths
from tests.test_tracing import BASE_ENV, TracedServer, children, in_trace, request, traceparent


class _OnDemandServer(TracedServer):
    def __init__(self, telemetry, engine):
        self.telemetry = telemetry
        self._channel = None
        ServerThread.__init__(self, engine)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Iterator[tuple[_OnDemandServer, OtlpSink, object]]:
    model, _ = demo_paths()
    root = tmp_path_factory.mktemp("adapters")
    for i in range(4):
        write_lora_adapter(model, root / f"t{i}", rank=8, seed=i, modules=("q_proj", "v_proj"))
    sink = OtlpSink()
    receiver = GrpcReceiver(sink)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**BASE_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}.items():
            mp.setenv(key, value.format(endpoint=receiver.endpoint))
        telemetry = setup_telemetry()
    # One device slot: a second adapter evicts the first from it.
    engine = build_engine(model, {}, adapter_dirs=(str(root),), max_loras_per_batch=1)
    served = _OnDemandServer(telemetry, engine)
    yield served, sink, telemetry
    served.stop()
    telemetry.shutdown(timeout_s=2.0)
    receiver.stop()


def _metric_points(sink: OtlpSink) -> list[tuple[str, dict, float]]:
    out = []
    for req in sink.metric_requests():
        for rm in req.resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    kind = m.WhichOneof("data")
                    if kind in ("sum", "gauge"):
                        for p in getattr(m, kind).data_points:
                            attrs = {a.key: a.value.string_value for a in p.attributes}
                            out.append((m.name, attrs, p.as_int if p.HasField("as_int") else p.as_double))
    return out


def test_adapter_load_span_and_metrics(traced):
    served, sink, telemetry = traced
    engine = served.engine
    engine.adapters.loader.delay_s = 0.2  # a slow read: the request's wait is visible in its span
    try:
        header, trace_id, _ = traceparent()
        responses = list(served.stub().Generate(request("t0", max_new_tokens=3), metadata=(("traceparent", header),)))
    finally:
        engine.adapters.loader.delay_s = 0.0
    assert responses[-1].usage.completion_tokens == 3
    list(served.stub().Generate(request("t1", max_new_tokens=2)))  # evicts t0 from the one device slot

    deadline = time.monotonic() + 10
    while True:
        telemetry.force_flush()
        spans = sink.spans()
        reqs = in_trace(spans, trace_id, "text_completion")
        if reqs and "adapter.load" in children(spans, reqs[0]):
            break
        assert time.monotonic() < deadline, "no adapter.load span"
        time.sleep(0.05)
    [req_span] = reqs
    load = children(spans, req_span)["adapter.load"]
    phases = children(spans, load)
    read, copy = phases["adapter.load.disk_read"], phases["adapter.load.device_copy"]
    assert read.attributes["lora_serve.adapter.phase"] == "disk_read"
    assert copy.attributes["lora_serve.adapter.phase"] == "device_copy"
    assert load.start_ns == read.start_ns <= read.end_ns <= copy.start_ns <= copy.end_ns == load.end_ns
    assert read.duration_ns >= 0.2e9  # the injected delay is part of the read
    assert load.attributes["lora_serve.adapter.wait_s"] >= 0.2
    assert load.attributes["lora_serve.adapter.name"] == "t0"

    telemetry.force_flush()
    hist = {(p.name, p.attributes.get("lora_serve.adapter.phase")): p.count for p in sink.histograms()
            if p.name == "lora_serve.adapter.load.duration"}
    assert hist.get(("lora_serve.adapter.load.duration", "disk_read"), 0) >= 2
    assert hist.get(("lora_serve.adapter.load.duration", "device_copy"), 0) >= 2
    points = _metric_points(sink)
    latest: dict[tuple, float] = {}
    for name, attrs, value in points:  # cumulative sums and gauges: the last export holds the totals
        latest[(name, tuple(sorted(attrs.items())))] = value
    assert latest[("lora_serve.adapter.loads", (("lora_serve.adapter.load.result", "ok"),))] >= 2
    assert latest[("lora_serve.adapter.evictions", (("lora_serve.adapter.tier", "device"),))] >= 1
    tiers = {dict(k[1])["lora_serve.adapter.tier"]: v for k, v in latest.items() if k[0] == "lora_serve.adapter.count"}
    assert tiers["device"] == 1 and tiers["host"] == 1  # t1 in the slot, t0 back in host memory only
