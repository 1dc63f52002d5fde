"""The affinity key and the replica id over real gRPC: x-adapter-id, when sent, must name the request's adapter
(INVALID_ARGUMENT naming both otherwise); the SDK and lora-client send it; every Generate answers with
x-replica-id (--replica-id); OpenTelemetry's resource carries it as service.instance.id."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from service._proto import pb_grpc
from service.affinity import (
    ADAPTER_ID_HEADER,
    REPLICA_ID_HEADER,
    adapter_header_problem,
)
from service.server import ServerConfig, default_replica_id
from tests.service_harness import ServerThread, make_request, shared_engine

ROOT = Path(__file__).resolve().parents[1]
REPLICA = "replica-a"


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, grace_period_s=10.0, replica_id=REPLICA, http_port=0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served.target)
    yield pb_grpc.GenerationStub(channel)
    channel.close()


def _generate(stub, adapter: str, header: str | None):
    metadata = () if header is None else ((ADAPTER_ID_HEADER, header),)
    call = stub.Generate(make_request(adapter=adapter, stopping__max_new_tokens=2), timeout=30, metadata=metadata)
    return list(call), dict(call.initial_metadata())


@pytest.mark.parametrize(("adapter", "header"), [
    ("pirate", "pirate"), ("pirate", None), ("", None), ("", ""), ("", "<model>"),
])
def test_agreeing_or_absent_header_is_served_and_names_the_replica(served, stub, adapter, header):
    if header == "<model>":
        header = served.engine.model_name  # the base model's name means the base model
    messages, initial = _generate(stub, adapter, header)
    assert messages[-1].usage.completion_tokens == 2
    assert initial[REPLICA_ID_HEADER] == REPLICA


@pytest.mark.parametrize(("adapter", "header"), [("pirate", "poet"), ("", "pirate"), ("pirate", "")])
def test_disagreeing_header_is_invalid_argument_naming_both(served, stub, adapter, header):
    with pytest.raises(grpc.RpcError) as info:
        _generate(stub, adapter, header)
    error = info.value
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"header says {header!r}" in error.details() and f"adapter is {adapter!r}" in error.details()
    # The refusal names the replica that refused it too (a misrouted request is visible end to end).
    assert dict(error.initial_metadata())[REPLICA_ID_HEADER] == REPLICA
    served.wait_idle()


def test_sdk_sends_the_header_and_reports_the_replica(served):
    """The SDK's header is checked by the server: a request to an unknown-to-the-header adapter would fail."""
    with served.client() as client:
        done = client.complete("Once upon a time", adapter="poet", max_new_tokens=3)
        chunks = list(client.generate("Once upon a time", max_new_tokens=2))
    assert done.replica_id == REPLICA and done.usage.completion_tokens == 3
    assert {c.replica_id for c in chunks} == {REPLICA}
    from service.client.requests import generate_metadata
    assert generate_metadata((("authorization", "Bearer t"),), {"adapter": "poet"}) == (
        ("authorization", "Bearer t"), (ADAPTER_ID_HEADER, "poet"))
    assert generate_metadata(None, {}) == ((ADAPTER_ID_HEADER, ""),)


def test_async_sdk_reports_the_replica(served):
    import asyncio

    from service.client import AsyncLoraServeClient

    async def run():
        async with AsyncLoraServeClient(served.target) as client:
            return await client.complete("Once upon a time", adapter="scribe", max_new_tokens=2)
    assert asyncio.run(run()).replica_id == REPLICA


def test_cli_prints_the_replica(served):
    proc = subprocess.run([sys.executable, "-m", "service", "client", "--target", served.target, "generate",
                           "Once upon a time", "--adapter", "pirate", "--max-new-tokens", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"; replica {REPLICA}]" in proc.stderr


def test_header_problem_rules():
    assert adapter_header_problem(None, "a", ("m",), "model") is None
    assert adapter_header_problem("m", None, ("m",), "model") is None
    assert adapter_header_problem("alias", None, ("m", "alias"), "model") is None
    problem = adapter_header_problem("a", "b", ("m",), "model")
    assert "'a'" in problem and "model is 'b'" in problem


def test_sdk_sends_no_header_for_a_name_no_header_can_carry():
    """A name with a control or non-ASCII character gets no x-adapter-id (grpc would refuse the metadata on the
    client's side, as INTERNAL): the server judges the name and answers INVALID_ARGUMENT itself."""
    from service.client.requests import generate_metadata

    assert generate_metadata(None, {"adapter": "pirate"}) == ((ADAPTER_ID_HEADER, "pirate"),)
    assert generate_metadata(None, {}) == ((ADAPTER_ID_HEADER, ""),)
    for name in ("bad\nname", "nul\0", "café"):
        assert generate_metadata((("k", "v"),), {"adapter": name}) == (("k", "v"),)


def test_replica_id_flag_default_and_otel_resource(monkeypatch):
    from service.cli import _server_config, serve_parser
    from service.telemetry.setup import setup_telemetry

    assert _server_config(serve_parser().parse_args(["--replica-id", "r7"])).replica_id == "r7"
    assert _server_config(serve_parser().parse_args([])).replica_id == default_replica_id()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    telemetry = setup_telemetry(instance_id="r7")
    assert telemetry.tracer_provider.resource.attributes["service.instance.id"] == "r7"
    telemetry.shutdown()
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.instance.id=pod-3")  # the explicit setting wins
    telemetry = setup_telemetry(instance_id="r7")
    assert telemetry.tracer_provider.resource.attributes["service.instance.id"] == "pod-3"
    telemetry.shutdown()


def _http(served, method: str, path: str, body: dict | None = None, headers: dict | None = None):
    import http.client
    import json

    conn = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=30)
    conn.request(method, path, json.dumps(body) if body is not None else None,
                 {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    return resp, json.loads(resp.read())


def test_http_door_names_the_replica_on_every_response(served):
    """The same replica id on the OpenAI door: health, completions, and refusals (a disagreeing x-adapter-id)."""
    resp, _ = _http(served, "GET", "/health")
    assert (resp.status, resp.getheader(REPLICA_ID_HEADER)) == (200, REPLICA)
    body = {"model": "pirate", "prompt": "Once upon a time", "max_tokens": 2}
    resp, out = _http(served, "POST", "/v1/completions", body, {ADAPTER_ID_HEADER: "pirate"})
    assert (resp.status, resp.getheader(REPLICA_ID_HEADER)) == (200, REPLICA), out
    resp, out = _http(served, "POST", "/v1/completions", body, {ADAPTER_ID_HEADER: "poet"})
    assert (resp.status, resp.getheader(REPLICA_ID_HEADER)) == (400, REPLICA), out
    assert "poet" in out["error"]["message"] and "pirate" in out["error"]["message"]
