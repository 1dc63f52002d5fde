"""Weighted adapter mixes through the gRPC door (GenerateRequest.adapters), the SDK (`adapters=`) and the CLI
(`--mix NAME=WEIGHT`), on a real server over loopback: PEFT's add_weighted_adapter(..., "cat") tokens, and every
refusal named on the member that is wrong (`adapters[1]`), in the status a client can act on."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from service._proto import pb, pb_grpc
from service.affinity import ADAPTER_ID_HEADER
from service.client import InvalidArgumentError, NotFoundError, from_rpc_error
from service.client.requests import build_generate_request, generate_metadata
from service.server import ServerConfig
from tests.checkpoints import make_peft_adapter
from tests.service_harness import ServerThread, build_engine
from tests.test_adapter_mixes import PIRATE_ROBOT, ROBOT_PIRATE, reference_mix
from tests.test_engine_golden import NEW_TOKENS, PROMPTS

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Once upon a time"
GREEDY = dict(max_new_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def served(models, adapters):
    """The tiny llama with qv8 (r8), all4 (r4), mlp16rs (r16); max_lora_rank 16, two device slots."""
    server = ServerThread(build_engine(models["llama"], adapters["llama"]), ServerConfig(port=0, grace_period_s=10.0))
    assert server.engine.config.max_lora_rank == 16
    yield server
    server.stop()


def _raw_generate(server: ServerThread, request: pb.GenerateRequest) -> list[int]:
    """The stub itself, no SDK: what any gRPC client sends."""
    with grpc.insecure_channel(server.target) as channel:
        stream = pb_grpc.GenerationStub(channel).Generate(request, timeout=120)
        return [t for msg in stream for t in msg.token_ids]


def test_a_mix_over_grpc_is_peft_add_weighted_adapter(served, models, adapters):
    prompt = PROMPTS[0]
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 adapters=[pb.AdapterWeight(name=n, weight=w) for n, w in PIRATE_ROBOT])
    request.stopping.max_new_tokens, request.stopping.ignore_eos = NEW_TOKENS, True
    tokens = _raw_generate(served, request)
    want = reference_mix(models["llama"], prompt, adapters["llama"], PIRATE_ROBOT)[0]
    assert len(set(want)) > 4, "degenerate reference: the test would prove nothing"
    assert tokens == want
    # The mix is neither member alone, nor the base model.
    with served.client(timeout=120) as client:
        for adapter in ("qv8", "all4", None):
            assert client.complete(prompt, adapter=adapter, **GREEDY).token_ids != tokens, adapter
    served.wait_idle()


def test_weights_travel_as_doubles():
    """0.7 arrives as the 0.7 an HTTP client's JSON gives (a float32 field would make it 0.699999988...: another
    mix, another slot, other KV in the prefix cache)."""
    request = build_generate_request("x", adapters={"qv8": 0.7, "all4": 0.3})
    wire = pb.GenerateRequest.FromString(request.SerializeToString())
    assert [(m.name, m.weight) for m in wire.adapters] == [("qv8", 0.7), ("all4", 0.3)]


def test_the_sdk_takes_a_mapping_or_pairs(served, models, adapters):
    prompt = PROMPTS[2]
    want = reference_mix(models["llama"], prompt, adapters["llama"], ROBOT_PIRATE)[0]  # a negative weight
    with served.client(timeout=120) as client:
        as_mapping = client.complete(prompt, adapters=dict(ROBOT_PIRATE), **GREEDY)
        as_pairs = client.complete(prompt, adapters=list(ROBOT_PIRATE), **GREEDY)
        streamed = [t for c in client.generate(prompt, adapters=ROBOT_PIRATE, **GREEDY) for t in c.token_ids]
    assert as_mapping.token_ids == as_pairs.token_ids == streamed == want
    with pytest.raises(TypeError, match="not a string"):
        build_generate_request("x", adapters="qv8")
    served.wait_idle()


def test_the_sdk_sends_no_affinity_header_for_a_mix():
    """x-adapter-id "" would tell a balancer "the base model"; a mix has no one adapter to route on."""
    assert generate_metadata(None, {"adapters": {"qv8": 0.5}}) == ()
    assert generate_metadata(None, {"adapter": "qv8"}) == ((ADAPTER_ID_HEADER, "qv8"),)


def _cli(server: ServerThread, *args: str) -> subprocess.CompletedProcess:
    # Bytes, decoded here: text mode would turn a generated "\r" into "\n".
    return subprocess.run([sys.executable, "-m", "service", "client", "--target", server.target, *args], cwd=ROOT,
                          capture_output=True, timeout=120, env=os.environ | {"PYTHONIOENCODING": "utf-8"})


def test_the_cli_sends_a_mix(served, models, adapters):
    with served.client(timeout=120) as client:
        sdk = client.complete(TEXT, adapters=PIRATE_ROBOT, **GREEDY)
        alone = {client.complete(TEXT, adapter=a, **GREEDY).text for a in ("qv8", "all4")}
        prompt_ids = client.tokenize(TEXT)
    assert sdk.token_ids == reference_mix(models["llama"], prompt_ids, adapters["llama"], PIRATE_ROBOT)[0]
    assert sdk.text and sdk.text not in alone
    proc = _cli(served, "generate", TEXT, "--mix", "qv8=0.7", "--mix", "all4=0.3", "--max-new-tokens",
                str(NEW_TOKENS), "--ignore-eos")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode("utf-8") == sdk.text + "\n"
    # A refusal names the member, as the server does.
    proc = _cli(served, "generate", TEXT, "--mix", "qv8=1", "--mix", "qv8=2")
    assert proc.returncode == 1 and proc.stdout == b""
    err = proc.stderr.decode()
    assert err.startswith("error: INVALID_ARGUMENT") and "\n  adapters[1]: adapter 'qv8' is named twice" in err, err
    # Refused locally: not a NAME=WEIGHT, or a mix beside --adapter.
    for args in (("--mix", "qv8"), ("--mix", "qv8=much"), ("--adapter", "qv8", "--mix", "all4=1")):
        proc = _cli(served, "generate", TEXT, *args)
        assert proc.returncode == 2 and b"--mix" in proc.stderr, (args, proc.stderr)
    served.wait_idle()


def _refused(served: ServerThread, error: type, **params) -> InvalidArgumentError | NotFoundError:
    with served.client(timeout=60) as client, pytest.raises(error) as refused:
        client.complete(PROMPTS[1], max_new_tokens=2, **params)
    return refused.value


@pytest.mark.parametrize("members, problem", [
    ([("qv8", 0.5), ("qv8", 0.5)], "adapter 'qv8' is named twice"),
    ([("qv8", 0.5), ("all4", float("nan"))], "must be a finite number in [-100, 100], got nan"),
    ([("qv8", 0.5), ("all4", 100.5)], "must be a finite number in [-100, 100], got 100.5"),
    ([("qv8", 0.5), ("../all4", 0.5)], "'../all4'"),
])
def test_a_bad_member_is_invalid_argument_naming_it(served, members, problem):
    e = _refused(served, InvalidArgumentError, adapters=members)
    assert [v.field for v in e.field_violations] == ["adapters[1]"], e.field_violations
    assert problem in e.field_violations[0].description


def test_a_mix_over_max_lora_rank_is_invalid_argument(served):
    e = _refused(served, InvalidArgumentError, adapters=[("mlp16rs", 1.0), ("qv8", 1.0)])
    assert [v.field for v in e.field_violations] == ["adapters"]
    assert "mlp16rs 16 + qv8 8 = 24, over this server's --max-lora-rank 16" in e.field_violations[0].description
    served.wait_idle()  # nothing pinned by the refusal


def test_an_unknown_member_is_not_found_naming_it(served):
    e = _refused(served, NotFoundError, adapters=[("qv8", 0.5), ("nobody", 0.5)])
    assert "'nobody'" in e.message


def test_adapter_and_adapters_together_are_refused(served):
    e = _refused(served, InvalidArgumentError, adapter="qv8", adapters=[("all4", 0.5)])
    assert [v.field for v in e.field_violations] == ["adapters"]
    assert "not both" in e.field_violations[0].description


def test_a_huge_mix_is_refused_by_its_length(served):
    """100,000 members: refused as a whole by their count, one violation (not one per member). Each weight left 0
    keeps the message under grpc's 1 MiB limit."""
    request = pb.GenerateRequest(text=TEXT, adapters=[pb.AdapterWeight(name="qv8")] * 100_000)
    with pytest.raises(grpc.RpcError) as refused:
        _raw_generate(served, request)
    e = from_rpc_error(refused.value)
    assert isinstance(e, InvalidArgumentError)
    assert [(v.field, v.description) for v in e.field_violations] == [
        ("adapters", "at most 8 adapters in one mix, got 100000")]


def test_an_activated_member_is_invalid_argument(served, models, tmp_path):
    checker = make_peft_adapter(models["llama"], tmp_path / "checker", r=4, alora_invocation_tokens=(7, 8))
    with served.client(timeout=60) as client:
        client.load_adapter("checker", str(checker))
    try:
        e = _refused(served, InvalidArgumentError, adapters=[("qv8", 0.5), ("checker", 0.5)])
        assert [v.field for v in e.field_violations] == ["adapters"]
        assert "activated LoRA" in e.field_violations[0].description
    finally:
        served.wait_idle()
        with served.client(timeout=60) as client:
            client.unload_adapter("checker")
