"""Capacity and lifecycle: cancellation and deadlines free slots, overload, engine failures, health,
reflection, and an in-process drain."""
from __future__ import annotations

import asyncio
import threading
import types

import grpc
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from service.client import (
    AsyncLoraServeClient,
    DeadlineExceededError,
    InternalError,
    ResourceExhaustedError,
    UnavailableError,
)
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.service_harness import ServerThread, shared_engine, wait_for

LONG = dict(max_new_tokens=240, ignore_eos=True)  # ~1 s of decoding: long enough to act mid-stream


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine())
    yield server
    server.stop()


def test_cancel_mid_stream_frees_the_slots(served):
    engine = served.engine
    start_kv = engine.kv_cache.num_free_blocks
    with served.client() as client:
        stream = client.generate("Once upon a time", adapter="poet", **LONG)
        received = [next(stream) for _ in range(3)]
        assert served.server.runner.num_running == 1
        assert engine.num_running == 1 and engine.kv_cache.num_free_blocks < start_kv
        stream.close()  # leaving the loop early cancels the call
    assert all(c.finish_reason is None for c in received)
    served.wait_idle(timeout=5)  # removed within a step; KV slot and adapter pin are back
    assert engine.kv_cache.num_free_blocks == start_kv == engine.kv_cache.num_blocks
    with served.client() as client:  # and the server keeps serving
        assert client.complete("Hello", max_new_tokens=3).usage.completion_tokens == 3


def test_deadline_exceeded_frees_the_slots(served):
    with served.client() as client, pytest.raises(DeadlineExceededError):
        for _ in client.generate("The river", adapter="pirate", timeout=0.3, **LONG):
            pass
    served.wait_idle(timeout=5)


def test_overload_is_resource_exhausted_with_retry_info():
    engine = shared_engine()
    server = ServerThread(engine, ServerConfig(port=0, limits=RequestLimits(max_queue=2, retry_after_s=0.5)))
    try:
        runner = server.server.runner
        stop = threading.Event()

        async def hold(client, i):  # a long stream, read slowly until told to stop
            async for _ in client.generate(f"prompt {i}", **LONG):
                if stop.is_set():
                    return

        async def scenario():
            async with AsyncLoraServeClient(server.target) as client:
                tasks = [asyncio.create_task(hold(client, i)) for i in range(engine.config.max_batch_size)]
                await asyncio.to_thread(wait_for, lambda: runner.num_running == engine.config.max_batch_size)
                tasks += [asyncio.create_task(hold(client, i)) for i in range(2)]  # fills the queue
                await asyncio.to_thread(wait_for, lambda: runner.num_waiting == 2)
                with pytest.raises(ResourceExhaustedError) as info:
                    await client.complete("one too many", max_new_tokens=2)
                stop.set()
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return info.value

        error = asyncio.run(scenario())
        assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error.retry_delay == pytest.approx(0.5)
        server.wait_idle()
    finally:
        server.stop()


def test_engine_failure_fails_only_that_step(served, monkeypatch):
    engine = served.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step(plan, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device error")
        return real_step(plan, *args, **kwargs)

    monkeypatch.setattr(engine, "step", flaky_step)
    with served.client() as client, pytest.raises(InternalError, match="simulated device error"):
        list(client.generate("Hello", max_new_tokens=20, ignore_eos=True))
    monkeypatch.undo()
    served.wait_idle()
    tokens = served.reference(engine.tokenizer.encode("Hello"), None, 20, ignore_eos=True)
    with served.client() as client:
        assert client.complete("Hello", max_new_tokens=20, ignore_eos=True).token_ids == tokens


def test_health_warmup_serving_draining():
    server = ServerThread(shared_engine(), warmup=False)
    try:
        channel = grpc.insecure_channel(server.target)
        health = health_pb2_grpc.HealthStub(channel)

        def status(service=""):
            return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

        NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
        assert status() == NOT_SERVING and status("loraserve.v1.Generation") == NOT_SERVING
        with server.client() as client, pytest.raises(UnavailableError, match="warming up"):
            client.complete("Hi", max_new_tokens=2)
        server.run(server.server.warmup())
        assert status() == SERVING and status("loraserve.v1.Adapters") == SERVING

        with server.client() as client:
            stream = client.generate("Once upon a time", **LONG)
            first = next(stream)
            drained = server.submit(server.server.drain(grace_period_s=600))  # a bound: ends with the stream
            wait_for(lambda: status() == NOT_SERVING, what="NOT_SERVING while draining")
            with pytest.raises(UnavailableError, match="draining"):
                client.complete("Hi", max_new_tokens=2)
            rest = list(stream)  # the in-flight stream still finishes
        assert [first, *rest][-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in [first, *rest]) == LONG["max_new_tokens"]
        assert drained.result(600) is True
        channel.close()
    finally:
        server.stop()


def test_drain_grace_period_over_cancels_the_rest():
    server = ServerThread(shared_engine())
    try:
        with server.client() as client:
            stream = client.generate("The river", max_new_tokens=250, ignore_eos=True)
            first = next(stream)
            drained = server.submit(server.server.drain(grace_period_s=0.2))
            rest = list(stream)
        assert drained.result(30) is False
        chunks = [first, *rest]
        assert chunks[-1].finish_reason == "cancelled"
        assert chunks[-1].usage.completion_tokens == sum(len(c.token_ids) for c in chunks) < 250
        server.wait_idle()
    finally:
        server.stop()


def test_reflection_lists_the_services(served):
    channel = grpc.insecure_channel(served.target)
    db = ProtoReflectionDescriptorDatabase(channel)
    services = set(db.get_services())
    assert {"loraserve.v1.Generation", "loraserve.v1.Adapters", "grpc.health.v1.Health"} <= services
    pool = descriptor_pool.DescriptorPool(db)
    generate = pool.FindServiceByName("loraserve.v1.Generation").methods_by_name["Generate"]
    assert generate.server_streaming and generate.output_type.full_name == "loraserve.v1.GenerateResponse"
    assert pool.FindMessageTypeByName("loraserve.v1.SamplingParams").fields_by_name["temperature"].has_presence
    channel.close()


def test_reflection_answers_v1_as_well_as_v1alpha(served):
    """grpcurl and newer tools ask grpc.reflection.v1 first: the same generic client, its requests sent to v1's
    method (v1's messages are v1alpha's, renamed: the same bytes), lists and describes every service."""
    from grpc_reflection.v1alpha import reflection_pb2

    channel = grpc.insecure_channel(served.target)
    db = ProtoReflectionDescriptorDatabase(channel)

    def ask(version: str):  # the stub a v1 client has, for the database to send its requests through
        return channel.stream_stream(f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)

    db._stub = types.SimpleNamespace(ServerReflectionInfo=ask("v1"))
    assert set(db.get_services()) == {"loraserve.v1.Generation", "loraserve.v1.Adapters", "grpc.health.v1.Health",
                                      "grpc.reflection.v1.ServerReflection",
                                      "grpc.reflection.v1alpha.ServerReflection"}
    pool = descriptor_pool.DescriptorPool(db)
    generate = pool.FindServiceByName("loraserve.v1.Generation").methods_by_name["Generate"]
    assert generate.server_streaming and generate.output_type.full_name == "loraserve.v1.GenerateResponse"
    info = pool.FindServiceByName("grpc.reflection.v1.ServerReflection").methods_by_name["ServerReflectionInfo"]
    assert info.client_streaming and info.server_streaming
    assert info.input_type.full_name == "grpc.reflection.v1.ServerReflectionRequest"
    assert [f.name for f in info.output_type.fields] == [
        f.name for f in reflection_pb2.ServerReflectionResponse.DESCRIPTOR.fields]
    with pytest.raises(grpc.RpcError) as unknown:  # (what a server without v1 answers)
        list(ask("v2")(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=30))
    assert unknown.value.code() is grpc.StatusCode.UNIMPLEMENTED
    channel.close()


def test_server_warns_when_torch_runs_outside_the_engine_thread(caplog):
    """A second thread running torch slows every step (service/runner/engine_thread.py): the server says so."""
    from lora_compile import Engine, EngineConfig
    from tests.service_harness import LIMITS, demo_paths

    def warned(engine) -> bool:
        caplog.clear()
        server = ServerThread(engine)
        server.stop()
        return any("outside the engine thread" in r.getMessage() for r in caplog.records)

    with caplog.at_level("WARNING", logger="service.runner.engine_runner"):
        assert not warned(shared_engine())
        assert warned(Engine(EngineConfig(model=str(demo_paths()[0]), **LIMITS)))
