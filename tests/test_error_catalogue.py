"""docs/errors.md, checked against the real server: every entry of the catalogue has a case here (or names the
test that covers it), and each case gets the documented status, field and message."""
from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from service._proto import pb, pb_grpc
from service.client import from_rpc_error
from service.errors import MAX_REPORTED_VIOLATIONS
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.service_harness import ServerThread, demo_paths, shared_engine, wait_for
from tests.service_harness import make_request as _request
from tests.wire import field_bytes, field_varint, raw_generate, raw_tokenize, varint

ROOT = Path(__file__).resolve().parents[1]
CATALOGUE = ROOT / "docs" / "errors.md"
NAN, INF = float("nan"), float("inf")
LIMITS = RequestLimits(max_prompt_tokens=200, max_new_tokens=100)  # max_seq_len 256, vocab 512
OK, INVALID, NOT_FOUND, EXHAUSTED, PRECONDITION = (
    grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION)



def _ids(ids: list[int], **fields) -> pb.GenerateRequest:
    return _request(None, token_ids__ids=ids, **fields)


def _chat() -> pb.GenerateRequest:
    request = _request(None)
    request.chat.messages.add(role="user", content="Hi")
    return request


def _mix(*members: tuple[str, float]) -> pb.GenerateRequest:
    return _request(adapters=[pb.AdapterWeight(name=name, weight=weight) for name, weight in members])


def _biased(logit_bias: dict[int, float]) -> pb.GenerateRequest:
    request = _request()
    request.sampling.logit_bias.update(logit_bias)
    return request


@dataclass(frozen=True)
class Case:
    request: pb.GenerateRequest | bytes      # bytes: sent as is (raw wire format)
    code: grpc.StatusCode
    message: str = ""                        # a fragment of the status message
    fields: tuple[str, ...] = ()             # BadRequest field violations that must be present
    max_violations: int | None = None


_VALID = _request(stopping__max_new_tokens=2).SerializeToString()
GENERATE_CASES: dict[str, Case] = {
    "G01": Case(pb.GenerateRequest(), INVALID, "set text or token_ids", ("input",)),
    "G02": Case(_request(""), INVALID, "the prompt is empty", ("text",)),
    "G03": Case(_ids([]), INVALID, "the prompt is empty", ("token_ids.ids",)),
    "G04": Case(_ids([5, 9999]), INVALID, "token id 9999 is outside the vocabulary [0, 512)", ("token_ids.ids[1]",)),
    "G05": Case(_ids([600] * 100), INVALID, "92 more ids are outside the vocabulary",
                tuple(f"token_ids.ids[{i}]" for i in range(8)) + ("token_ids.ids",), max_violations=9),
    "G06": Case(_ids([5] * 256), INVALID, "the context holds 256", ("token_ids.ids",)),
    "G07": Case(_request("Z" * 1000), INVALID, "the prompt has 1001 tokens; the context holds 256", ("text",)),
    "G42": Case(_request("Z" * 2000), INVALID, "the text has 2000 characters; a prompt of at most 200 tokens holds "
                "at most 1600 characters with this model's tokenizer", ("text",)),
    "G08": Case(_ids([5] * 210), INVALID, "at most 200 (--max-prompt-tokens)", ("token_ids.ids",)),
    "G09": Case(_ids([5] * 200_000), INVALID, "the prompt has 200000 tokens", ("token_ids.ids",), max_violations=1),
    "G10": Case(_request(stopping__max_new_tokens=0), INVALID, "must be >= 1", ("stopping.max_new_tokens",)),
    "G11": Case(_request(stopping__max_new_tokens=101), INVALID, "at most 100 new tokens per request",
                ("stopping.max_new_tokens",)),
    "G12": Case(_ids([5] * 190, stopping__max_new_tokens=90), INVALID, "exceeds the context (max_seq_len 256); at most 66",
                ("stopping.max_new_tokens",)),
    "G13": Case(_request(sampling__temperature=-0.5), INVALID, "must be >= 0", ("sampling.temperature",)),
    "G14": Case(_request(sampling__temperature=NAN), INVALID, "must be a finite number, got nan", ("sampling.temperature",)),
    "G15": Case(_request(sampling__temperature=INF), INVALID, "must be a finite number, got inf", ("sampling.temperature",)),
    "G16": Case(_request(sampling__top_p=0.0), INVALID, "must be in (0, 1]", ("sampling.top_p",)),
    "G17": Case(_request(sampling__top_p=1.5), INVALID, "must be in (0, 1]", ("sampling.top_p",)),
    "G18": Case(_request(sampling__top_p=NAN), INVALID, "finite", ("sampling.top_p",)),
    "G19": Case(_request(sampling__top_k=-1), INVALID, "must be >= 0", ("sampling.top_k",)),
    "G20": Case(_request(sampling__repetition_penalty=0.0), INVALID, "must be in [1e-05, 100000] (1 = off), got 0",
                ("sampling.repetition_penalty",)),
    "G21": Case(_request(sampling__repetition_penalty=-INF), INVALID, "finite", ("sampling.repetition_penalty",)),
    "G22": Case(_request(stopping__stop=["ok", ""]), INVALID, "must not be empty", ("stopping.stop[1]",)),
    "G23": Case(_request(stopping__stop=["x" * 257]), INVALID, "at most 256 characters", ("stopping.stop[0]",)),
    "G24": Case(_request(stopping__stop=["a"] * 17), INVALID, "at most 16 stop strings, got 17", ("stopping.stop",)),
    "G25": Case(_request(stopping__stop=[""] * 10_000), INVALID, "got 10000", ("stopping.stop",), max_violations=1),
    "G26": Case(_request(stopping__stop_token_ids=[600]), INVALID, "outside the vocabulary",
                ("stopping.stop_token_ids[0]",)),
    "G27": Case(_request(stopping__stop_token_ids=[1] * 65), INVALID, "at most 64 stop token ids",
                ("stopping.stop_token_ids",)),
    "G28": Case(_request(response__top_logprobs=21), INVALID, "must be <= 20", ("response.top_logprobs",)),
    "G29": Case(_request(request_id="r" * 257), INVALID, "at most 256 characters", ("request_id",)),
    "G30": Case(_request(adapter="a" * 257), INVALID, "at most 256 characters", ("adapter",)),
    "G31": Case(_request(adapter="no-such-adapter"), NOT_FOUND, "adapter 'no-such-adapter' is not loaded"),
    "G32": Case(field_bytes(3, b"Hi") + field_bytes(6, field_bytes(2, b"\xff\xfe")), INVALID,
                "does not parse as a loraserve.v1.GenerateRequest message: String field had bad UTF-8"),
    "G33": Case(field_bytes(3, b"caf\xc3"), INVALID,
                "does not parse as a loraserve.v1.GenerateRequest message: String field had bad UTF-8"),
    "G34": Case(b"\xff\xff\xff\xff\xff", INVALID,
                "does not parse as a loraserve.v1.GenerateRequest message: Wire format was corrupt"),
    "G35": Case(field_bytes(3, b"a" * (1 << 20)), EXHAUSTED, "Received message larger than max"),
    "G36": Case(_request("x", sampling__temperature=-1, sampling__top_k=-2, stopping__max_new_tokens=0), INVALID,
                "sampling.temperature", ("sampling.temperature", "sampling.top_k", "stopping.max_new_tokens")),
    "G37": Case(_request("", request_id="r" * 300, adapter="a" * 300, sampling__temperature=-1, sampling__top_p=2.0,
                         sampling__top_k=-1, sampling__repetition_penalty=-1.0, stopping__max_new_tokens=0,
                         stopping__stop=[""] * 16, response__top_logprobs=99),
                INVALID, "more problems not listed", ("(more)",), max_violations=MAX_REPORTED_VIOLATIONS),
    # The wire format's own leniency: a field with the wrong wire type is kept as an unknown field (so here
    # the prompt is unset), a uint32 above 2**32 - 1 keeps its low 32 bits, unknown fields are ignored.
    "G38": Case(field_varint(3, 5), INVALID, "set text or token_ids", ("input",)),
    "G39": Case(field_bytes(4, field_bytes(1, varint(2**32 + 5))) + field_bytes(6, field_varint(1, 1)), OK),
    "G40": Case(_VALID + field_varint(99, 7), OK),
    "G41": Case(_VALID[:-1], INVALID, "does not parse as a loraserve.v1.GenerateRequest message"),
    "G44": Case(_request(sampling__repetition_penalty=1e-38), INVALID, "must be in [1e-05, 100000] (1 = off), got 1e-38",
                ("sampling.repetition_penalty",)),
    "G45": Case(_request(sampling__min_p=1.5), INVALID, "sampling.min_p: must be in [0, 1] (0 = off), got 1.5",
                ("sampling.min_p",)),
    "G46": Case(_request(sampling__presence_penalty=3.0, sampling__frequency_penalty=-2.5), INVALID,
                "sampling.presence_penalty: must be in [-2, 2] (0 = off), got 3; sampling.frequency_penalty: must be "
                "in [-2, 2] (0 = off), got -2.5", ("sampling.presence_penalty", "sampling.frequency_penalty")),
    "G47": Case(_biased({5: 1.0, 600: 5.0}), INVALID, "sampling.logit_bias: token id 600 is outside the vocabulary "
                "[0, 512)", ("sampling.logit_bias",), max_violations=1),
    "G48": Case(_biased({5: 150.0, 6: NAN}), INVALID, "sampling.logit_bias: the bias of token 5 must be in "
                "[-100, 100], got 150; sampling.logit_bias: the bias of token 6 must be in [-100, 100], got nan",
                ("sampling.logit_bias",)),
    "G49": Case(_biased(dict.fromkeys(range(301), 1.0)), INVALID, "sampling.logit_bias: at most 300 entries, got 301",
                ("sampling.logit_bias",), max_violations=1),
    "G50": Case(_request(sampling__n=9), INVALID, "sampling.n: must be in [1, 8] (the choices run together: at most "
                "--max-num-seqs), got 9", ("sampling.n",)),
    "G51": Case(_request(response__prompt_logprobs=21), INVALID, "response.prompt_logprobs: must be in [0, 20], got 21",
                ("response.prompt_logprobs",)),
    "G52": Case(_request(structured_output__json_schema='{"type": "nonsense"}'), INVALID,
                "structured_output: does not compile: Invalid type: nonsense", ("structured_output",)),
    "G53": Case(_chat(), PRECONDITION, "has no chat template (tokenizer_config.json has no chat_template); send "
                "text you format yourself"),
    "G56": Case(_mix(("pirate", 0.5), ("pirate", 0.5)), INVALID, "adapters[1]: adapter 'pirate' is named twice; give "
                "each adapter once, with the sum of its weights", ("adapters[1]",), max_violations=1),
    "G57": Case(_mix(("pirate", 0.5), ("scribe", NAN)), INVALID, "adapters[1]: the weight of 'scribe' must be a finite "
                "number in [-100, 100], got nan", ("adapters[1]",), max_violations=1),
    "G58": Case(_mix(*((f"a{i}", 0.5) for i in range(9))), INVALID, "adapters: at most 8 adapters in one mix, got 9",
                ("adapters",), max_violations=1),
    "G59": Case(_mix(("poet", 1.0), ("pirate", 0.5)), INVALID, "adapters: the ranks of a mix add up: poet 16 + "
                "pirate 8 = 24, over this server's --max-lora-rank 16; mix fewer or lower-rank adapters, or raise "
                "--max-lora-rank", ("adapters",), max_violations=1),
    "G60": Case(_mix(("pirate", 0.5), ("no-such-adapter", 0.5)), NOT_FOUND, "adapter 'no-such-adapter' is not loaded"),
    "G61": Case(_request(adapter="pirate", adapters=[pb.AdapterWeight(name="scribe", weight=0.5)]), INVALID,
                "adapters: name the adapters either here or as the model ('pirate'), not both", ("adapters",)),
}
# G62 needs a member that cannot be mixed: loaded for its own test (test_an_activated_member_cannot_be_mixed).
G62 = Case(_mix(("pirate", 0.5), ("checker", 0.5)), INVALID, "adapters: adapter 'checker' is an activated LoRA "
           "(alora_invocation_tokens): it acts from its own position in the prompt and cannot be mixed; request it "
           "alone", ("adapters",), max_violations=1)
# Rows whose message the page words otherwise than the case's: G33 says "same as G32"; G48's case sends two bad
# biases, the page quotes the first.
WORDED_OTHERWISE = {"G33", "G48"}

# Entries checked by other tests (test file :: test name).
ELSEWHERE = {
    "G43": "test_affinity.py::test_disagreeing_header_is_invalid_argument_naming_both",
    "C01": "test_service_lifecycle.py::test_overload_is_resource_exhausted_with_retry_info",
    "C03": "test_service_lifecycle.py::test_health_warmup_serving_draining",
    "C04": "test_service_lifecycle.py::test_health_warmup_serving_draining",
    "C05": "test_isolation.py::test_never_read_streams_do_not_hold_kv_slots",
    "C06": "test_service_lifecycle.py::test_deadline_exceeded_frees_the_slots",
    "C07": "test_service_lifecycle.py::test_cancel_mid_stream_frees_the_slots",
    "C08": "test_faults.py::test_engine_step_failure_fails_that_step_and_frees_every_slot",
    "C09": "test_faults.py::test_adapter_files_damaged_after_registration",
    "C10": "test_hostile_adapters.py::test_overflowing_weights_mark_the_adapter_bad_at_its_first_failure",
    "A01": "test_security.py::test_bearer_tokens",
    "A02": "test_security.py::test_bearer_tokens",
    "A03": "test_security.py::test_adapter_management_can_be_disabled",
    "A04": "test_security.py::test_adapter_paths_outside_the_roots_are_refused",
    "A05": "test_security.py::test_mutual_tls",
    "L09": "test_service_adapters.py::test_load_and_unload_while_streaming",
    "L11": "test_hostile_adapters.py::test_target_modules_patterns_are_matched_in_linear_time",
    "L12": "test_hostile_adapters.py::test_nested_or_oversize_config_is_refused_and_read_once",
    "L13": "test_hostile_adapters.py::test_safetensors_header_is_bounded",
    "U03": "test_service_adapters.py::test_load_and_unload_while_streaming",
    "G54": "test_grammar_limits.py::test_grammar_failures_are_400s_in_our_words",
    "G55": "test_grammar_limits.py::test_a_step_waits_at_most_its_budget_for_grammar_work",
}


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, grace_period_s=10.0, limits=LIMITS))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def channel(served):
    with grpc.insecure_channel(served.target) as ch:
        yield ch


@contextmanager
def activated_member(target: str, root: Path) -> Iterator[str]:
    """G62's member, loaded on the server at `target` for the block: `checker`, the demo pirate adapter made an
    activated LoRA (alora_invocation_tokens), which a mix cannot hold."""
    path = root / "checker"
    shutil.copytree(demo_paths()[1]["pirate"], path)
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(config | {"alora_invocation_tokens": [7, 8]}))
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.AdaptersStub(channel)
        stub.LoadAdapter(pb.LoadAdapterRequest(name="checker", path=str(path)), timeout=10)
        try:
            yield "checker"
        finally:
            stub.UnloadAdapter(pb.UnloadAdapterRequest(name="checker"), timeout=10)


@pytest.mark.parametrize("case_id", list(GENERATE_CASES))
def test_generate_catalogue(channel, served, case_id):
    _check(channel, served, GENERATE_CASES[case_id])


def test_an_activated_member_cannot_be_mixed(channel, served, tmp_path):
    """G62 (the catalogue's adapters stay the three demo ones: `checker` is loaded for this test only)."""
    with activated_member(served.target, tmp_path):
        _check(channel, served, G62)


def _check(channel: grpc.Channel, served: ServerThread, case: Case) -> None:
    payload = case.request if isinstance(case.request, bytes) else case.request.SerializeToString()
    result = raw_generate(channel, payload)
    assert result.code == case.code, (result.code, result.message)
    assert case.message in result.message, result.message
    if result.code == OK:
        last = pb.GenerateResponse.FromString(result.responses[-1])
        assert last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    else:
        assert not result.responses  # refused before any work
        fields = [v.field for v in from_rpc_error(result.error).field_violations]
        assert set(case.fields) <= set(fields), fields
        if case.max_violations is not None:
            assert len(fields) <= case.max_violations, fields
    served.wait_idle()


def test_tokenize_catalogue(channel):
    """T01 invalid UTF-8, T02 oversized, T03 empty text (allowed: just the special tokens)."""
    assert raw_tokenize(channel, field_bytes(1, b"\xc3\x28")).code == INVALID                       # T01
    result = raw_tokenize(channel, field_bytes(1, b"a" * (1 << 20)))                               # T02
    assert result.code == EXHAUSTED and "larger than max" in result.message
    ids = pb_grpc.GenerationStub(channel).Tokenize(pb.TokenizeRequest(text=""), timeout=10).token_ids  # T03
    assert list(ids) == shared_engine().tokenizer.encode("")


def test_adapter_management_catalogue(served, tmp_path):
    _, adapters = demo_paths()
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(adapters["pirate"] / "adapter_config.json", pickled)
    (pickled / "adapter_model.bin").write_bytes(b"not really a pickle")
    bad_json = tmp_path / "bad-json"
    shutil.copytree(adapters["pirate"], bad_json)
    (bad_json / "adapter_config.json").write_text("{not json")
    cases = {  # id: (name, path, code, fragment, field)
        "L01": ("", "", INVALID, "must not be empty", "path"),
        "L02": ("n" * 257, str(adapters["pirate"]), INVALID, "at most 256 characters", "name"),
        "L03": ("x", "/tmp/a\x00b", INVALID, "NUL", "path"),
        "L04": ("x", str(tmp_path / "nowhere"), PRECONDITION, "is not a directory", None),
        "L05": ("x", str(pickled), PRECONDITION, "pickle files are refused", None),
        "L06": ("x", str(tmp_path / ("d" * 300)), PRECONDITION, "File name too long", None),
        "L07": ("x", str(bad_json), PRECONDITION, "is not valid JSON", None),
        "L08": ("x", "p" * 5000, INVALID, "at most 4096 characters", "path"),
        "L10": ("x", "~no-such-user-here/adapter", INVALID, "'~' cannot be expanded (no such user)", "path"),
        "L14": ("pirate\n", str(adapters["pirate"]), INVALID, "adapter name 'pirate\\n' is not allowed: use 1 to 128",
                None),
    }
    with grpc.insecure_channel(served.target) as channel:
        stub = pb_grpc.AdaptersStub(channel)
        for case_id, (name, path, code, fragment, field_name) in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path), timeout=10)
            error = from_rpc_error(info.value)
            assert error.code == code and fragment in error.message, (case_id, error)
            if field_name:
                assert field_name in [v.field for v in error.field_violations], (case_id, error)
        for case_id, name, code in (("U01", "", INVALID), ("U02", "ghost", NOT_FOUND), ("U04", "n" * 300, INVALID)):
            with pytest.raises(grpc.RpcError) as info:
                stub.UnloadAdapter(pb.UnloadAdapterRequest(name=name), timeout=10)
            assert info.value.code() == code, case_id
    assert {a.name for a in shared_engine().adapters.list()} == {"pirate", "poet", "scribe"}


def test_too_many_open_streams():
    """C02: --max-concurrent-streams, checked before any work; RetryInfo says when to retry."""
    server = ServerThread(shared_engine(), ServerConfig(
        port=0, limits=RequestLimits(retry_after_s=0.25, max_concurrent_streams=1)))
    try:
        with server.client() as client:
            stream = client.generate("Once upon a time", max_new_tokens=200, ignore_eos=True)
            next(stream)
            with server.client() as other, pytest.raises(Exception) as info:
                other.complete("Hi", max_new_tokens=2)
            stream.close()
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many open Generate streams (limit 1)" in info.value.message
        assert info.value.retry_delay == pytest.approx(0.25)
        server.wait_idle()
        wait_for(lambda: server.server.runner.num_open_streams == 0, what="the cancelled stream's handler to end")
        with server.client() as client:  # the slot is free again
            assert client.complete("Hi", max_new_tokens=2).usage.completion_tokens == 2
    finally:
        server.stop()


def test_catalogue_and_tests_agree():
    """Every id in docs/errors.md is checked here or in the test it names, and nothing here is undocumented."""
    text = CATALOGUE.read_text()
    documented = set(re.findall(r"^\| ([GTLUCA]\d\d) \|", text, flags=re.M))
    here = set(GENERATE_CASES) | {"G62", "T01", "T02", "T03", "L01", "L02", "L03", "L04", "L05", "L06", "L07", "L08",
                                  "L10", "L14", "U01", "U02", "U04", "C02"}
    assert documented == here | set(ELSEWHERE), (documented ^ (here | set(ELSEWHERE)))
    for where in ELSEWHERE.values():
        path, test = where.split("::")
        assert f"def {test}(" in (ROOT / "tests" / path).read_text(), where
    # and each case's message is the one its row quotes
    rows = dict(re.findall(r"^\| (G\d\d) \|(.*)$", text, flags=re.M))
    for case_id, case in (GENERATE_CASES | {"G62": G62}).items():
        assert case_id in WORDED_OTHERWISE or case.message in rows[case_id], (case_id, case.message)
