"""Property-based fuzzing of a live in-process server: valid requests, valid requests with fields perturbed,
random bytes and mutated wire bytes, sent a few at a time (concurrently) as raw messages.

Every answer must be OK or a documented status (docs/errors.md), never UNKNOWN / INTERNAL for a client's
mistake; a refused request gets no response message; a valid one always succeeds. Afterwards the server is
SERVING, every KV and adapter slot is free again, and a normal request still gives its reference tokens.
The figures (requests per kind and status) are printed and written to .cache/reliability/fuzz.json.
"""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import grpc.aio
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from service._proto import pb
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.client_loop import ClientLoop
from tests.service_harness import ServerThread, shared_engine, wait_for
from tests.wire import GENERATE, TOKENIZE, field_bytes

LOAD, UNLOAD = "/loraserve.v1.Adapters/LoadAdapter", "/loraserve.v1.Adapters/UnloadAdapter"

ROOT = Path(__file__).resolve().parents[1]
REPORT_DIR = Path(os.environ.get("LORA_SERVE_RELIABILITY_DIR", ROOT / ".cache" / "reliability"))
EXAMPLES = int(os.environ.get("LORA_SERVE_FUZZ_EXAMPLES", "800"))
LIMITS = RequestLimits(max_new_tokens=4, max_prompt_tokens=128)  # small answers keep the run short
C = grpc.StatusCode
GENERATE_STATUSES = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.RESOURCE_EXHAUSTED}  # documented, client-caused
UNARY = {  # kind: (method, documented statuses); every other kind is a Generate call
    "tokenize bytes": (TOKENIZE, {C.OK, C.INVALID_ARGUMENT, C.RESOURCE_EXHAUSTED}),
    "load adapter": (LOAD, {C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION}),
    "load bytes": (LOAD, {C.OK, C.INVALID_ARGUMENT, C.FAILED_PRECONDITION}),
    "unload adapter": (UNLOAD, {C.INVALID_ARGUMENT, C.NOT_FOUND}),
}
ADAPTERS = ["", "pirate", "poet", "scribe"]
PROMPTS = ["Once upon a time", "The river", "héllo wörld ✓", "People in the town", "🎉 世界"]
VOCAB = 512

f32 = st.floats(width=32)  # any float32: NaN, ±inf, negative, subnormal


# --- strategies -------------------------------------------------------------------------------------
@st.composite
def valid_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=draw(st.text(max_size=8)), adapter=draw(st.sampled_from(ADAPTERS)))
    if draw(st.booleans()):
        req.text = draw(st.sampled_from(PROMPTS) | st.text(min_size=1, max_size=30))
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(2, VOCAB - 1), min_size=1, max_size=40)))
    s = req.sampling
    for name, values in (("temperature", st.floats(0, 2, width=32)), ("top_p", st.floats(0.0625, 1, width=32)),
                         ("top_k", st.integers(0, 50)), ("seed", st.integers(0, 2**64 - 1)),
                         ("repetition_penalty", st.floats(0.5, 2, width=32))):
        if draw(st.booleans()):
            setattr(s, name, draw(values))
    if draw(st.booleans()):
        req.stopping.max_new_tokens = draw(st.integers(1, LIMITS.max_new_tokens))
    req.stopping.stop.extend(draw(st.lists(st.text(min_size=1, max_size=5), max_size=3)))
    req.stopping.stop_token_ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)))
    req.stopping.ignore_eos = draw(st.booleans())
    req.response.logprobs = draw(st.booleans())
    req.response.top_logprobs = draw(st.integers(0, 5))
    return req


def _set(req: pb.GenerateRequest, path: str, value) -> None:
    *parents, leaf = path.split(".")
    msg = req
    for p in parents:
        msg = getattr(msg, p)
    if isinstance(value, list):
        del getattr(msg, leaf)[:]
        getattr(msg, leaf).extend(value)
    elif isinstance(value, dict):  # a map field
        getattr(msg, leaf).clear()
        getattr(msg, leaf).update(value)
    else:
        setattr(msg, leaf, value)


# Field → values that are often wrong (and sometimes right): the perturbations of a valid request.
PERTURBATIONS = {
    "sampling.temperature": f32, "sampling.top_p": f32, "sampling.repetition_penalty": f32,
    "sampling.min_p": f32, "sampling.presence_penalty": f32, "sampling.frequency_penalty": f32,
    "sampling.logit_bias": st.dictionaries(st.integers(0, 2**32 - 1), f32, max_size=5)
    | st.integers(0, 400).map(lambda n: dict.fromkeys(range(n), 1.0)),
    "response.prompt_logprobs": st.integers(0, 2**32 - 1) | st.integers(0, 25),
    "sampling.top_k": st.integers(-2**31, 2**31 - 1), "sampling.seed": st.integers(0, 2**64 - 1),
    "stopping.max_new_tokens": st.integers(0, 2**32 - 1) | st.integers(0, 8),
    "stopping.stop": st.lists(st.text(max_size=300), max_size=20) | st.integers(0, 5000).map(lambda n: ["x"] * n),
    "stopping.stop_token_ids": st.lists(st.integers(0, 2**32 - 1), max_size=70),
    "response.top_logprobs": st.integers(0, 2**32 - 1) | st.integers(0, 25),
    "request_id": st.text(max_size=300),
    "adapter": st.text(max_size=300) | st.sampled_from([*ADAPTERS, "ghost", "pirate "]),
    "text": st.text(max_size=400) | st.integers(0, 3000).map(lambda n: "ab " * n),
    "token_ids.ids": st.lists(st.integers(0, 2**32 - 1), max_size=300) | st.integers(0, 20_000).map(lambda n: [7] * n),
}


@st.composite
def perturbed_requests(draw) -> pb.GenerateRequest:
    req = draw(valid_requests())
    for path in draw(st.lists(st.sampled_from(sorted(PERTURBATIONS)), min_size=1, max_size=3, unique=True)):
        _set(req, path, draw(PERTURBATIONS[path]))
    if draw(st.integers(0, 9)) == 0:
        req.ClearField("input")
    return req


@st.composite
def mutated_bytes(draw) -> bytes:
    """A valid request's bytes, then bytes flipped, cut, inserted or appended."""
    data = bytearray(draw(valid_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "append"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and data:
            data[min(at, len(data) - 1)] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data += draw(st.binary(max_size=16))
    return bytes(data)


# Adapter management: odd paths and names, but never a registered adapter's name (unloading one is allowed).
PATHS = st.sampled_from(["", "/", ".", "..", "~", "~no-such-user/x", "/etc/passwd", "/proc/self", "/dev/null",
                         "a\x00b", "d" * 300, "p" * 5000, "/tmp/../../etc", "\u00e9/\U0001f389"]) | st.text(max_size=50)
NAMES = st.text(max_size=300).filter(lambda n: n not in ADAPTERS[1:])
load_requests = st.builds(pb.LoadAdapterRequest, name=NAMES, path=PATHS)
unload_requests = st.builds(pb.UnloadAdapterRequest, name=NAMES)


def _unload_safe(payload: bytes) -> bytes:
    """Raw bytes for UnloadAdapter that cannot name a registered adapter."""
    try:
        if pb.UnloadAdapterRequest.FromString(payload).name in ADAPTERS[1:]:
            return b""
    except Exception:  # noqa: BLE001 - does not parse: the server refuses it
        pass
    return payload


OVERSIZED = field_bytes(3, b"a" * (LIMITS.max_message_bytes + 1))
CALLS = st.one_of(
    st.tuples(st.just("valid"), valid_requests().map(lambda r: r.SerializeToString())),
    st.tuples(st.just("perturbed"), perturbed_requests().map(lambda r: r.SerializeToString())),
    st.tuples(st.just("perturbed"), perturbed_requests().map(lambda r: r.SerializeToString())),
    st.tuples(st.just("random bytes"), st.binary(max_size=300)),
    st.tuples(st.just("mutated bytes"), mutated_bytes()),
    st.tuples(st.just("tokenize bytes"), st.binary(max_size=100)),
    st.tuples(st.just("load adapter"), load_requests.map(lambda r: r.SerializeToString())),
    st.tuples(st.just("load bytes"), st.binary(max_size=100)),
    st.tuples(st.just("unload adapter"), unload_requests.map(lambda r: r.SerializeToString()) |
              st.binary(max_size=40).map(_unload_safe)),
)


# --- sending ----------------------------------------------------------------------------------------
async def _generate(channel: grpc.aio.Channel, payload: bytes) -> tuple[grpc.StatusCode, list[pb.GenerateResponse]]:
    call = channel.unary_stream(GENERATE)(payload, timeout=60)
    messages = []
    try:
        async for raw in call:
            messages.append(pb.GenerateResponse.FromString(raw))
    except grpc.aio.AioRpcError as e:
        return e.code(), messages
    return C.OK, messages


async def _unary(channel: grpc.aio.Channel, method: str, payload: bytes) -> tuple[grpc.StatusCode, list]:
    try:
        await channel.unary_unary(method)(payload, timeout=60)
    except grpc.aio.AioRpcError as e:
        return e.code(), []
    return C.OK, []


async def _send_all(channel, batch):
    return await asyncio.gather(*(
        _unary(channel, UNARY[kind][0], payload) if kind in UNARY else _generate(channel, payload)
        for kind, payload in batch))


def _check(kind: str, code: grpc.StatusCode, messages: list[pb.GenerateResponse]) -> None:
    allowed = UNARY[kind][1] if kind in UNARY else GENERATE_STATUSES
    assert code in allowed, f"{kind}: {code}"
    if kind == "valid":
        assert code == C.OK, "a valid request was refused"
    if kind == "oversized":
        assert code == C.RESOURCE_EXHAUSTED
    if code != C.OK or kind in UNARY:
        assert not messages, "a refused request got responses"
        return
    *body, last = messages
    assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in body)
    n = sum(len(m.token_ids) for m in messages)
    assert n == last.usage.completion_tokens <= LIMITS.max_new_tokens


# --- the test ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, grace_period_s=10.0, limits=LIMITS))
    yield server
    server.stop()


def test_fuzz_requests(served):
    engine = served.engine
    start_kv, start_lora = engine.kv_cache.num_free_blocks, engine.adapters.num_free_slots
    prompt = engine.tokenizer.encode("Once upon a time")
    reference = served.reference(prompt, "poet", 4, ignore_eos=True)
    stats: Counter = Counter()
    t0 = time.perf_counter()

    with ClientLoop() as client:
        async def open_channel():
            return grpc.aio.insecure_channel(served.target)
        channel = client.run(open_channel())

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
        @given(st.lists(CALLS, min_size=1, max_size=6))
        def run(batch):
            for (kind, _), (code, messages) in zip(batch, client.run(_send_all(channel, batch)), strict=True):
                stats[kind, code.name] += 1
                _check(kind, code, messages)

        run()
        # And a few oversized messages (refused by grpc itself, before any handler).
        for code, messages in client.run(_send_all(channel, [("oversized", OVERSIZED)] * 3)):
            stats["oversized", code.name] += 1
            _check("oversized", code, messages)
        client.run(channel.close())
    seconds = time.perf_counter() - t0

    served.wait_idle()
    assert (engine.kv_cache.num_free_blocks, engine.adapters.num_free_slots) == (start_kv, start_lora)
    wait_for(lambda: served.server.runner.num_open_streams == 0, what="every stream handler to end")
    assert {a.name for a in engine.adapters.list()} == set(ADAPTERS[1:])  # no random load or unload took
    with served.client() as c:
        assert c.health() == "SERVING"
        assert c.complete(prompt, adapter="poet", max_new_tokens=4, ignore_eos=True).token_ids == reference

    report = {
        "command": "python -m pytest " + " ".join(sys.argv[1:]),  # the run that wrote this
        "examples": EXAMPLES, "requests": sum(stats.values()), "seconds": round(seconds, 1),
        "by_kind_and_status": {f"{k} / {c}": n for (k, c), n in sorted(stats.items())},
        "by_status": dict(sorted(sum((Counter({code: n}) for (_, code), n in stats.items()), Counter()).items())),
        "slots_before": {"kv": start_kv, "lora": start_lora},
        "slots_after": {"kv": engine.kv_cache.num_free_blocks, "lora": engine.adapters.num_free_slots},
    }
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "fuzz.json").write_text(json.dumps(report, indent=2))
    print("\nfuzz:", json.dumps(report, indent=2))


# --- adapter files ----------------------------------------------------------------------------------
# adapter_config.json as a hostile adapter directory may hold it: target_modules as random regex-ish strings
# (pathological ones among them), odd JSON in every field, nesting up to 100 000 levels, objects with up to
# 100 000 keys (over the size cap at the top). Every outcome is OK or FAILED_PRECONDITION with a message, within
# a deadline of many times a normal cold load measured first.
ADAPTER_EXAMPLES = int(os.environ.get("LORA_SERVE_FUZZ_ADAPTER_EXAMPLES", "120"))
PATHOLOGICAL = ["(.+)+X", "(a|aa)+$", "(x+x+)+y", "((.*)*)*q", "(.*a){20}", "(?<=x)q_proj", r"(a)\1", "a{1001}",
                "((a{100}){100}){100}", "(", ")", "[", "*", "\\", "(?P<n>q_proj)", "(.+)+(q|v)_proj", ".*",
                "all-linear", "q_proj|v_proj", "x" * 2000, "\x00", "é+"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
regexish = st.text(alphabet="()[]{}.*+?|\\^$-_,0123456789abqvpXé", max_size=40) | st.sampled_from(PATHOLOGICAL)
CONFIG_FIELDS = {
    "target_modules": regexish | st.lists(st.sampled_from(["q_proj", "v_proj", "lm_head", "x"]) | st.text(max_size=9),
                                          max_size=4) | json_values,
    "r": st.integers(-2, 20) | json_values, "lora_alpha": st.floats() | json_values,
    "rank_pattern": st.dictionaries(regexish, st.integers(0, 9) | json_values, max_size=4) | json_values,
    "alpha_pattern": st.dictionaries(regexish, st.floats() | json_values, max_size=4) | json_values,
    "use_rslora": json_values, "peft_type": json_values, "modules_to_save": json_values, "bias": json_values,
    "use_dora": json_values, "alora_invocation_tokens": json_values,
}


@st.composite
def adapter_configs(draw) -> str:
    raw = json.loads((_demo_adapter() / "adapter_config.json").read_text())
    for name in draw(st.lists(st.sampled_from(sorted(CONFIG_FIELDS)), max_size=4, unique=True)):
        raw[name] = draw(CONFIG_FIELDS[name])
    text = json.dumps(raw)  # NaN / Infinity as Python's json writes them (and reads them)
    shape = draw(st.sampled_from(["flat", "flat", "deep", "wide"]))
    if shape == "deep":  # written as text: json.dumps would recurse
        n = draw(st.integers(1, 100_000))
        text = text[:-1] + ', "deep": ' + "[" * n + "]" * n + "}"
    elif shape == "wide":
        n = draw(st.integers(1, 100_000))
        text = text[:-1] + ', "wide": {' + ",".join(f'"k{i}": {i}' for i in range(n)) + "}}"
    return text


def _demo_adapter() -> Path:
    from tests.service_harness import demo_paths
    return demo_paths()[1]["pirate"]


def test_fuzz_adapter_configs(tmp_path):
    from service.client import FailedPreconditionError
    from tests.service_harness import build_engine, demo_paths

    library = tmp_path / "adapters"
    library.mkdir()
    weights = shutil.copy(_demo_adapter() / "adapter_model.safetensors", tmp_path)  # linked into every adapter
    engine = build_engine(demo_paths()[0], {}, adapter_dirs=(str(library),), max_cpu_lora_bytes=1)
    server = ServerThread(engine, ServerConfig(port=0, grace_period_s=10.0, limits=LIMITS))
    names = iter(f"config-{i}" for i in range(10**9))
    stats: Counter = Counter()

    def adapter(config_text: str) -> str:
        name = next(names)
        (library / name).mkdir()
        (library / name / "adapter_config.json").write_text(config_text)
        os.link(weights, library / name / "adapter_model.safetensors")
        return name

    try:
        with server.client() as client:  # the deadline: 200 times a normal adapter's cold request, here, now
            t0 = time.perf_counter()
            client.complete("Hi", adapter=adapter((_demo_adapter() / "adapter_config.json").read_text()),
                            max_new_tokens=1)
            deadline = 200 * (time.perf_counter() - t0)
        with server.client(timeout=deadline) as client:
            @settings(max_examples=ADAPTER_EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
            @given(adapter_configs(), st.sampled_from(["prefetch", "prefetch", "prefetch", "generate"]))
            def run(config_text, how):
                name = adapter(config_text)
                try:
                    if how == "prefetch":  # read into host memory, no step
                        client.load_adapter(name)
                    else:
                        assert client.complete("Hi", adapter=name, max_new_tokens=1).usage.completion_tokens == 1
                    stats[how, "OK"] += 1
                except FailedPreconditionError as e:  # every other status (INTERNAL, DEADLINE_EXCEEDED) fails
                    assert f"adapter {name!r}" in e.message, e.message
                    stats[how, "FAILED_PRECONDITION"] += 1

            run()
            assert client.health() == "SERVING"
        server.wait_idle()
        print("\nadapter config fuzz:", dict(sorted(stats.items())))
        assert stats["prefetch", "OK"] and stats["prefetch", "FAILED_PRECONDITION"]
    finally:
        server.stop()
