"""Weighted adapter mixes through the HTTP door, on a real server over loopback: the `adapters` body field (sent
by the official openai client as an extra body field) and llama.cpp's per-request `lora` with GET /lora-adapters
give PEFT's add_weighted_adapter(combination_type="cat") tokens, in one batch with the base model, a single
adapter and other mixes; malformed or unservable mixes are refused naming the field the client sent."""
from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.server import ServerConfig
from tests.http_wire import post
from tests.service_harness import ServerThread, build_engine, openai_client, wait_for
from tests.test_adapter_mixes import reference
from tests.test_engine_golden import NEW_TOKENS, PROMPTS

MIX = (("qv8", 0.7), ("all4", 0.3))
OTHER = (("all4", -0.5), ("qv8", 1.25))  # the other order, a negative weight


def as_adapters(members) -> list[dict]:
    return [{"name": name, "weight": weight} for name, weight in members]


@pytest.fixture(scope="module")
def served(models, adapters):
    # 4 slots: a single adapter and two mixes (a mix has a slot of its own) at once
    engine = build_engine(models["llama"], adapters["llama"], max_loras_per_batch=4)
    server = ServerThread(engine, ServerConfig(port=0, http_port=0, grace_period_s=10.0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def peft(models, adapters):
    """PEFT's greedy tokens for (prompt index, spec): None the base model, a name one adapter, pairs a mix."""
    cache: dict = {}

    def tokens(prompt: int, spec) -> list[int]:
        if (prompt, spec) not in cache:
            cache[prompt, spec] = reference(models["llama"], PROMPTS[prompt], adapters["llama"], spec)[0]
            assert len(set(cache[prompt, spec])) > 4, "degenerate reference: the test would prove nothing"
        return cache[prompt, spec]
    return tokens


def complete(client, prompt: int, model: str = "", **extra) -> list[int]:
    """Greedy token ids through the official client (32 of them: EOS does not stop)."""
    out = client.completions.create(model=model, prompt=PROMPTS[prompt], max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
    return out.choices[0].model_extra["token_ids"]


def lora_ids(server: ServerThread) -> dict[str, int]:
    status, listed, _ = post(server.server.http_port, "/lora-adapters", b"", method="GET")
    assert status == 200, listed
    return {entry["name"]: entry["id"] for entry in listed}


# --- the happy paths ---------------------------------------------------------------------------------------
def test_a_mix_sent_through_the_openai_client_gives_peft_s_tokens(served, client, peft):
    mixed = complete(client, 0, adapters=as_adapters(MIX))
    assert mixed == peft(0, MIX)
    # Non-degenerate: the mix is neither member alone, nor the base model.
    assert mixed not in (complete(client, 0, "qv8"), complete(client, 0, "all4"), complete(client, 0))
    # A weight left out is 1: one member at weight 1 is that adapter.
    assert complete(client, 1, adapters=[{"name": "qv8"}]) == complete(client, 1, "qv8") == peft(1, "qv8")
    served.wait_idle()


def test_llama_cpp_lora_gives_the_tokens_of_the_same_mix_by_name(served, client, adapters, peft):
    status, listed, _ = post(served.server.http_port, "/lora-adapters", b"", method="GET")
    assert status == 200
    assert {e["name"] for e in listed} == {"qv8", "all4", "mlp16rs"}
    assert sorted(e["id"] for e in listed) == [e["id"] for e in listed] and len({e["id"] for e in listed}) == 3
    for entry in listed:  # llama.cpp's shape; 0: a request without `lora` gets no adapter
        assert entry["scale"] == 0.0 and entry["path"] == str(adapters["llama"][entry["name"]])
    ids = {e["name"]: e["id"] for e in listed}
    # mlp16rs at scale 0 is off (its rank is not counted: 8 + 4 + 16 would be over --max-lora-rank 16)
    lora = [{"id": ids["qv8"], "scale": 0.7}, {"id": ids["mlp16rs"], "scale": 0}, {"id": ids["all4"], "scale": 0.3}]
    assert complete(client, 2, lora=lora) == complete(client, 2, adapters=as_adapters(MIX)) == peft(2, MIX)
    # Every scale 0 (or none listed): the base model, as in llama.cpp.
    assert complete(client, 2, lora=[{"id": ids["qv8"], "scale": 0.0}]) == complete(client, 2, lora=[]) \
        == peft(2, None)
    served.wait_idle()


def test_global_lora_scales_are_refused(served):
    status, body, headers = post(served.server.http_port, "/lora-adapters", [{"id": 0, "scale": 0.5}])
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert body["error"]["param"] == "lora" and "pass the scales per request" in body["error"]["message"]
    listed = post(served.server.http_port, "/lora-adapters", b"", method="GET")[1]
    assert listed and {e["scale"] for e in listed} == {0.0}  # nothing changed


def test_a_mix_of_adapters_found_in_an_adapter_directory(models, adapters, peft, tmp_path):
    library = tmp_path / "adapters"
    for name in ("qv8", "all4"):
        shutil.copytree(adapters["llama"][name], library / name)
    engine = build_engine(models["llama"], {}, adapter_dirs=(str(library),))
    server = ServerThread(engine, ServerConfig(port=0, http_port=0, grace_period_s=10.0))
    try:
        assert lora_ids(server) == {}  # none read yet: none has an id
        with openai_client(server) as client:
            assert complete(client, 0, adapters=as_adapters(MIX)) == peft(0, MIX)
            ids = lora_ids(server)  # read for the mix: listed now, with ids a `lora` can name
            assert set(ids) == {"qv8", "all4"}
            lora = [{"id": ids["all4"], "scale": -0.5}, {"id": ids["qv8"], "scale": 1.25}]
            assert complete(client, 0, lora=lora) == peft(0, OTHER)
        server.wait_idle()
    finally:
        server.stop()


def test_base_single_and_two_mixes_in_one_batch_each_give_peft_s_tokens(served, client, peft):
    ids = lora_ids(served)
    calls = [dict(prompt=0), dict(prompt=1, model="qv8"), dict(prompt=2, adapters=as_adapters(MIX)),
             dict(prompt=3, lora=[{"id": ids[name], "scale": weight} for name, weight in OTHER])]
    specs = [None, "qv8", MIX, OTHER]
    runner = served.server.runner
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:  # no step runs until all four wait: they start together whatever the machine's speed
        entered.set()
        release.wait(120)

    held = served.submit(runner.run_in_engine_thread(hold))
    assert entered.wait(60)
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(complete, client, **call) for call in calls]
        wait_for(lambda: runner.num_waiting == len(calls), timeout=60, what="four queued requests")
        release.set()
        held.result(60)
        tokens = [f.result() for f in futures]
    for i, spec in enumerate(specs):
        assert tokens[i] == peft(i, spec), f"{spec} differs from PEFT's"
    assert len({tuple(t) for t in tokens}) == 4
    served.wait_idle()


# --- refusals ------------------------------------------------------------------------------------------------
def _refused(server: ServerThread, extra: dict, path: str = "/v1/completions") -> tuple[int, str, str]:
    body = {"prompt": PROMPTS[0], "max_tokens": 2} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    status, reply, _ = post(server.server.http_port, path, body | extra)
    return status, reply["error"]["param"], reply["error"]["message"]


@pytest.mark.parametrize("extra, param, says", [
    ({"adapters": {"name": "qv8"}}, "adapters", "valid array"),
    ({"adapters": ["qv8"]}, "adapters[0]", "object"),
    ({"adapters": [{"name": "qv8", "scale": 1}]}, "adapters[0].scale", "Extra inputs"),
    ({"adapters": [{"weight": 1}]}, "adapters[0].name", "required"),
    ({"adapters": [{"name": ""}]}, "adapters[0].name", "at least 1 character"),
    ({"adapters": [{"name": "qv8"}, {"name": "all4", "weight": "0.3"}]}, "adapters[1].weight", "valid number"),
    ({"adapters": [{"name": "qv8"}, {"name": "qv8", "weight": 0.5}]}, "adapters[1]", "named twice"),
    ({"adapters": [{"name": "qv8", "weight": 101}]}, "adapters[0]", "[-100, 100]"),
    ({"adapters": [{"name": "../qv8"}]}, "adapters[0]", ""),
    ({"adapters": [{"name": f"a{i}"} for i in range(9)]}, "adapters", "at most 8 adapters"),
    ({"adapters": as_adapters([("mlp16rs", 1.0), ("qv8", 0.5)])}, "adapters",
     "mlp16rs 16 + qv8 8 = 24, over this server's --max-lora-rank 16"),
    ({"model": "qv8", "adapters": as_adapters(MIX)}, "adapters", "not both"),
    ({"adapters": as_adapters(MIX), "lora": []}, "lora", "not both"),
    ({"lora": {"id": 0, "scale": 1}}, "lora", "valid array"),
    ({"lora": [{"id": 0}]}, "lora[0].scale", "required"),
    ({"lora": [{"id": 0, "scale": 1, "name": "qv8"}]}, "lora[0].name", "Extra inputs"),
    ({"lora": [{"id": -1, "scale": 1}]}, "lora[0].id", "greater than or equal to 0"),
])
def test_malformed_or_unservable_mixes_are_refused_naming_the_field(served, extra, param, says):
    status, got_param, message = _refused(served, extra)
    assert (status, got_param) == (400, param), message
    assert says in message


def test_lora_refusals_name_the_entry_the_client_wrote(served):
    ids = lora_ids(served)
    status, param, message = _refused(served, {"lora": [{"id": ids["qv8"], "scale": 1}, {"id": 999, "scale": 1}]})
    assert (status, param) == (400, "lora[1].id") and "GET /lora-adapters lists" in message
    twice = [{"id": ids["qv8"], "scale": 1}, {"id": ids["all4"], "scale": 0.5}, {"id": ids["qv8"], "scale": 0}]
    status, param, message = _refused(served, {"lora": twice})
    assert (status, param) == (400, "lora[2].id") and "listed twice" in message
    # An entry at scale 0 is off, left out of the members: a member's refusal still names the entry it came from.
    over = [{"id": ids["qv8"], "scale": 0}, {"id": ids["all4"], "scale": 101}]
    assert _refused(served, {"lora": over})[:2] == (400, "lora[1]")
    assert _refused(served, {"model": "qv8", "lora": []})[:2] == (400, "lora")


def test_an_unknown_member_is_a_404_on_the_mix_s_entry(served):
    status, param, message = _refused(served, {"adapters": as_adapters([("qv8", 0.5), ("nobody", 0.5)])})
    assert (status, param) == (404, "adapters[1]") and "'nobody'" in message
    assert _refused(served, {"model": "nobody"})[:2] == (404, "model")  # (an adapter by `model`: as before)


def test_chat_completions_take_the_same_fields(served):
    status, param, _ = _refused(served, {"adapters": [{"name": "qv8", "weight": True}]}, "/v1/chat/completions")
    assert (status, param) == (400, "adapters[0].weight")
    status, param, _ = _refused(served, {"lora": [{"id": 999, "scale": 1}]}, "/v1/chat/completions")
    assert (status, param) == (400, "lora[0].id")
