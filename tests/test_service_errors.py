"""Every refusal has its status code and, for bad fields, a BadRequest field violation naming the field."""
from __future__ import annotations

import json
import shutil

import grpc
import pytest

from service._proto import pb, pb_grpc
from service.client import FailedPreconditionError, InvalidArgumentError, LoraServeError, NotFoundError, from_rpc_error
from tests.service_harness import ServerThread, demo_paths, shared_engine
from tests.service_harness import make_request as _request

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine())
    yield server
    server.stop()



BAD_REQUESTS = {
    "negative temperature": (_request(sampling__temperature=-0.5), "sampling.temperature"),
    "NaN temperature": (_request(sampling__temperature=NAN), "sampling.temperature"),
    "top_p zero": (_request(sampling__top_p=0.0), "sampling.top_p"),
    "top_p above one": (_request(sampling__top_p=1.5), "sampling.top_p"),
    "infinite top_p": (_request(sampling__top_p=INF), "sampling.top_p"),
    "negative top_k": (_request(sampling__top_k=-1), "sampling.top_k"),
    "zero repetition_penalty": (_request(sampling__repetition_penalty=0.0), "sampling.repetition_penalty"),
    "NaN repetition_penalty": (_request(sampling__repetition_penalty=NAN), "sampling.repetition_penalty"),
    "max_new_tokens beyond the context": (_request(stopping__max_new_tokens=300), "stopping.max_new_tokens"),
    "max_new_tokens zero": (_request(stopping__max_new_tokens=0), "stopping.max_new_tokens"),
    "empty text": (_request(text=""), "text"),
    "no input": (pb.GenerateRequest(), "input"),
    "empty token_ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids.ids"),
    "unknown token id": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 9999])), "token_ids.ids[1]"),
    "prompt too long (ids)": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 256)), "token_ids.ids"),
    "prompt too long (text)": (_request(text="Z" * 2000), "text"),
    "empty stop string": (_request(stopping__stop=["ok", ""]), "stopping.stop[1]"),
    "unknown stop token id": (_request(stopping__stop_token_ids=[600]), "stopping.stop_token_ids[0]"),
    "too many top_logprobs": (_request(response__top_logprobs=50), "response.top_logprobs"),
}


@pytest.fixture(scope="module")
def stub(served):
    channel = grpc.insecure_channel(served.target)
    yield pb_grpc.GenerationStub(channel)
    channel.close()


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_invalid_argument_names_the_field(stub, case):
    request, field = BAD_REQUESTS[case]
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request, timeout=10))
    error = from_rpc_error(info.value)
    assert isinstance(error, InvalidArgumentError), error
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert field in [v.field for v in error.field_violations], error.field_violations
    assert field in error.message


def test_all_violations_are_reported_at_once(served):
    with served.client() as client, pytest.raises(InvalidArgumentError) as info:
        list(client.generate("x", temperature=-1, top_k=-2, max_new_tokens=0))
    fields = {v.field for v in info.value.field_violations}
    assert fields == {"sampling.temperature", "sampling.top_k", "stopping.max_new_tokens"}


def test_unknown_adapter_is_not_found(served):
    with served.client() as client, pytest.raises(NotFoundError) as info:
        list(client.generate("Hi", adapter="no-such-adapter", max_new_tokens=2))
    assert "no-such-adapter" in info.value.message
    assert info.value.details[0].resource_name == "no-such-adapter"


def test_adapter_errors(served, tmp_path):
    _, adapters = demo_paths()
    with served.client() as client:
        with pytest.raises(FailedPreconditionError, match="not a directory|missing"):
            client.load_adapter("ghost", str(tmp_path / "nowhere"))
        pickled = tmp_path / "pickled"
        pickled.mkdir()
        shutil.copy(adapters["pirate"] / "adapter_config.json", pickled)
        (pickled / "adapter_model.bin").write_bytes(b"not really a pickle")
        with pytest.raises(FailedPreconditionError, match="pickle"):
            client.load_adapter("pickled", str(pickled))
        too_big = tmp_path / "rank32"
        shutil.copytree(adapters["poet"], too_big)
        with pytest.raises(FailedPreconditionError):  # a config that does not match the weights / limits
            cfg = json.loads((too_big / "adapter_config.json").read_text())
            (too_big / "adapter_config.json").write_text(json.dumps(cfg | {"use_dora": True}))
            client.load_adapter("dora", str(too_big))
        with pytest.raises(InvalidArgumentError) as info:
            client.load_adapter("", "")
        assert {v.field for v in info.value.field_violations} == {"name", "path"}
        with pytest.raises(NotFoundError):
            client.unload_adapter("no-such-adapter")
        assert {a.name for a in client.list_adapters()} >= {"pirate", "poet", "scribe"}
        assert not {"ghost", "pickled", "dora"} & {a.name for a in client.list_adapters()}


def test_errors_are_typed_lora_serve_errors(served):
    with served.client() as client, pytest.raises(LoraServeError) as info:
        list(client.generate("Hi", top_p=0.0))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(info.value).startswith("INVALID_ARGUMENT: sampling.top_p")


def test_status_mapping_of_engine_errors():
    """The one exception → status mapping, for the engine errors no request above can trigger."""
    from google.rpc import status_pb2

    from lora_compile.errors import AdapterInUseError, AdapterPathError
    from service.errors import to_rpc_status

    def decode(exc):
        status = to_rpc_status(exc)
        rich = status_pb2.Status.FromString(dict(status.trailing_metadata)["grpc-status-details-bin"])
        return status.code, status.details, rich

    code, message, rich = decode(AdapterPathError("adapter path '/etc' is outside the allowed adapter roots"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "allowed adapter roots" in message
    assert rich.details and rich.code == code.value[0]
    assert decode(AdapterInUseError("in use"))[0] == grpc.StatusCode.FAILED_PRECONDITION
    code, message, _ = decode(KeyError("oops"))
    assert code == grpc.StatusCode.INTERNAL and "KeyError" in message
