"""docs/errors.md for the HTTP door: every H row against a live server (status, OpenAI error body, param), the
HTTP column of the shared rows (the gRPC mistakes sent as OpenAI requests get the mapped status and the same
message), auth and TLS on the HTTP port. Never a 500 for a client's mistake, and the server keeps serving."""
from __future__ import annotations

import http.client
import json
import re
import ssl
import threading
from pathlib import Path

import grpc
import pytest

from service.security import SecurityConfig, TlsConfig
from service.http_api.errors import HTTP_STATUS
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.certs import CertificateAuthority
from tests.test_error_catalogue import activated_member
from tests.http_wire import post
from tests.service_harness import ServerThread, shared_engine, wait_for

ROOT = Path(__file__).resolve().parents[1]
LIMITS = RequestLimits(max_prompt_tokens=200, max_new_tokens=100)  # as the catalogue's gRPC cases
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
CATALOGUE = ROOT / "docs" / "errors.md"


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, limits=LIMITS))
    yield server
    server.stop()


def _ok(port: int) -> None:
    status, body, _ = post(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
    assert status == 200 and body["usage"]["completion_tokens"] == 2, body


# (path, body, headers, status, message fragment, param)
HTTP_CASES = {
    "H01": [(COMPLETIONS, b"{not json", {}, 400, "Invalid JSON", None),
            (COMPLETIONS, b"[1, 2]", {}, 400, "Input should be an object", None)],
    "H02": [(COMPLETIONS, {"prompt": "Hi", "max_tokens": "5"}, {}, 400, "max_tokens: Input should be a valid integer",
             "max_tokens"),
            (COMPLETIONS, {"prompt": "Hi", "stream": "yes"}, {}, 400, "stream: Input should be a valid boolean", "stream"),
            (COMPLETIONS, {"prompt": 5}, {}, 400, "prompt", "prompt"),
            (CHAT, {"messages": "hi"}, {}, 400, "messages", "messages")],
    "H03": [(COMPLETIONS, {"prompt": "Hi", "seed": -1}, {}, 400, "seed: Input should be greater than or equal to 0",
             "seed"),
            (COMPLETIONS, {"prompt": "Hi", "max_tokens": -1}, {}, 400, "max_tokens", "max_tokens"),
            (COMPLETIONS, {"prompt": "Hi", "top_k": 2**40}, {}, 400, "top_k", "top_k")],
    "H04": [(COMPLETIONS, {"prompt": "Hi", "model": "no-such-adapter"}, {}, 404,
             "adapter 'no-such-adapter' is not loaded", "model")],
    "H05": [(COMPLETIONS, {"prompt": "Hi", "n": 9}, {}, 400, "n: must be in [1, 8] (the choices run together: at most "
             "--max-num-seqs), got 9", "n"),
            (COMPLETIONS, {"prompt": "Hi", "n": 0}, {}, 400, "n: must be in [1, 8]", "n")],
    "H06": [(COMPLETIONS, {"prompt": "a" * (1 << 20)}, {}, 413, "this server accepts at most 1048576", None)],
    "H07": [(COMPLETIONS, {"prompt": "Hi", "model": "pirate"}, {"x-adapter-id": "poet"}, 400,
             "the x-adapter-id header names 'poet' but the model field names 'pirate'", "model")],
    "H08": [(CHAT, {"messages": [{"role": "user", "content": "hi"}]}, {}, 400, "has no chat template", None)],
    "H10": [("/v1/nowhere", {}, {}, 404, "Not Found", None),
            (COMPLETIONS + "/", {"prompt": "Hi"}, {}, 404, "Not Found", None),
            ("/health", {}, {}, 405, "Method Not Allowed: /health takes GET, HEAD, not POST", None)],
    "H12": [(COMPLETIONS, {"prompt": ["a"] * 133, "n": 2}, {}, 400, "prompt: 133 prompts x n = 2 make 266 sequences; "
             "this server holds at most 264 at once (--max-num-seqs + --max-queue)", "prompt"),
            (COMPLETIONS, {"prompt": ["a", ""]}, {}, 400, "prompt[1]: the prompt is empty", "prompt[1]")],
    "H13": [(COMPLETIONS, {"prompt": "Hi", "use_beam_search": True}, {}, 400, "use_beam_search: beam search is not "
             "supported", "use_beam_search"),
            (COMPLETIONS, {"prompt": "Hi", "min_tokens": 3, "skip_special_tokens": False}, {}, 400,
             "min_tokens: not supported; skip_special_tokens: not supported", "min_tokens"),
            (COMPLETIONS, {"prompt": "Hi", "best_of": 2}, {}, 400, "best_of: only best_of = 1 is supported",
             "best_of")],
    "H14": [(COMPLETIONS, {"max_tokens": 2}, {}, 400, "prompt: Field required", "prompt")],
    "H17": [(COMPLETIONS, {"prompt": "Hi"}, {"content-type": "text/plain"}, 415, "the request body must be JSON: send "
             "the header 'Content-Type: application/json' (got Content-Type 'text/plain')", None)],
    "H18": [(COMPLETIONS, {"prompt": "Hi"}, {"host": "evil.example"}, 421, "this server does not answer to Host "
             "'evil.example': it answers only to localhost, 127.0.0.1, [::1] (it listens on 127.0.0.1 and has no "
             "--api-token: a guard against DNS rebinding); call it by one of those names, or start it with "
             "--allowed-hosts evil.example (or --api-token)", None)],
    "H22": [(COMPLETIONS, {"prompt": "Hi", "guided_json": {"type": "object"}}, {}, 400, "guided_json: removed from "
             "vLLM's API: use {\"structured_outputs\": {\"json\": ...}}; refused rather than ignored",
             "guided_json"),
            (COMPLETIONS, {"prompt": "Hi", "guided_choice": ["a", "b"]}, {}, 400, "guided_choice: removed",
             "guided_choice")],
    "H23": [(COMPLETIONS, {"prompt": "Hi", "logit_bias": {"abc": 1, "-1": 2}}, {}, 400, "logit_bias: keys must be "
             "token ids (non-negative integers, as strings); got 'abc', '-1'", "logit_bias")],
    "H25": [(COMPLETIONS, {"prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
             {}, 400, "response_format.json_schema.schema: a JSON schema object is required (OpenAI's form: "
             "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}})",
             "response_format.json_schema.schema"),
            (COMPLETIONS, {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["a"]}}, {}, 400,
             "structured_outputs: set exactly one of json, regex, choice, grammar, json_object; got regex, choice",
             "structured_outputs")],
    "H24": [(COMPLETIONS, {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, {}, 400,
             "prompt_logprobs: not available when stream is true", "prompt_logprobs")],
    "H26": [(CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", "function": {
        "name": "get weather"}}]}, {}, 400, "tools[0].function.name: must be 1-64 letters, digits, '_' or '-'",
        "tools[0].function.name"),
            (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "required"}, {}, 400,
             "tool_choice: needs tools: send the functions it may call", "tool_choice"),
            (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "tool_choice": "auto", "tools": [
                {"type": "function", "function": {"name": "f"}}]}, {}, 400, "tool_choice: \"auto\" needs a tool call "
             "parser: start the server with --tool-call-parser hermes", "tool_choice")],
    "H28": [(COMPLETIONS, {"prompt": "Hi", "adapters": [{"name": "pirate"}, {"name": "scribe", "weight": "0.3"}]}, {},
             400, "adapters[1].weight: Input should be a valid number", "adapters[1].weight"),
            (COMPLETIONS, {"prompt": "Hi", "adapters": [{"name": "pirate", "scale": 1}]}, {}, 400,
             "adapters[0].scale: Extra inputs are not permitted", "adapters[0].scale")],
    "H29": [(COMPLETIONS, {"prompt": "Hi", "lora": [{"id": 999, "scale": 1}]}, {}, 400, "lora[0].id: no adapter has id "
             "999; GET /lora-adapters lists the adapters and their ids", "lora[0].id")],
    "H30": [(COMPLETIONS, {"prompt": "Hi", "adapters": [{"name": "pirate"}], "lora": []}, {}, 400, "lora: name the "
             "adapters of a mix either in `adapters` (by name) or in `lora` (by id, as llama.cpp's server takes them), "
             "not both", "lora")],
    "H31": [(COMPLETIONS, {"prompt": "Hi", "model": "pirate", "adapters": [{"name": "scribe"}]}, {}, 400, "adapters: "
             "the model field names the adapter 'pirate': name the adapters either in adapters (with the served base "
             "model as the model) or as the model, not both", "adapters")],
    "H32": [("/lora-adapters", [{"id": 0, "scale": 0.5}], {}, 405, "POST /lora-adapters would set adapter scales for "
             "every client of this server at once, so it is not supported: pass the scales per request instead, as the "
             "`lora` field of /v1/completions or /v1/chat/completions ([{\"id\": 0, \"scale\": 0.5}], ids from GET "
             "/lora-adapters)", "lora")],
}
# Rows whose message the page words otherwise than the cases': H23's case sends two bad keys, the page quotes one.
WORDED_OTHERWISE = {"H23"}
# Elsewhere: H09 (test_http_api.py::test_chat_uses_the_models_template_as_transformers_renders_it and
# test_http_hardening.py::test_chat_template_errors_are_in_our_words), H11 and H15 below, H16
# (test_http_api.py::test_client_disconnect_mid_stream_frees_the_slot), H19
# (test_http_hardening.py::test_refused_adapter_names_name_the_model_param: it needs --adapter-dir).
# H20 and H21: test_connections.py (test_huge_request_head_gets_431, test_http_cap_refuses_new_connections_...).
ELSEWHERE = {"H09", "H11", "H15", "H16", "H19", "H20", "H21",
             "H27"}  # test_connections.py::test_a_request_body_that_trickles_in_gets_408_after_the_header_timeout

# Shared rows sent as OpenAI requests: (id, body, status, message fragment, param).
SHARED_CASES = [
    ("G02", {"prompt": ""}, "prompt: the prompt is empty", "prompt"),
    ("G04", {"prompt": [5, 9999]}, "prompt[1]: token id 9999 is outside the vocabulary [0, 512)", "prompt[1]"),
    ("G08", {"prompt": [5] * 210}, "at most 200 (--max-prompt-tokens)", "prompt"),
    ("G10", {"prompt": "Hi", "max_tokens": 0}, "max_tokens: must be >= 1", "max_tokens"),
    ("G11", {"prompt": "Hi", "max_tokens": 101}, "max_tokens: this server allows at most 100 new tokens", "max_tokens"),
    ("G13", {"prompt": "Hi", "temperature": -0.5}, "temperature: must be >= 0 (0 = greedy), got -0.5", "temperature"),
    ("G17", {"prompt": "Hi", "top_p": 1.5}, "top_p: must be in (0, 1], got 1.5", "top_p"),
    ("G19", {"prompt": "Hi", "top_k": -1}, "top_k: must be >= 0", "top_k"),
    ("G20", {"prompt": "Hi", "repetition_penalty": 0}, "repetition_penalty: must be in [1e-05, 100000] (1 = off)",
     "repetition_penalty"),
    ("G22", {"prompt": "Hi", "stop": ["ok", ""]}, "stop[1]: must not be empty", "stop[1]"),
    ("G24", {"prompt": "Hi", "stop": ["a"] * 17}, "stop: at most 16 stop strings, got 17", "stop"),
    ("G28", {"prompt": "Hi", "model": "", "logprobs": 21}, "logprobs", "logprobs"),
    ("G30", {"prompt": "Hi", "model": "a" * 257}, "model: at most 256 characters", "model"),
    ("G31", {"prompt": "Hi", "model": "no-such-adapter"}, "adapter 'no-such-adapter' is not loaded", "model"),
    ("G42", {"prompt": "Z" * 2000}, "prompt: the text has 2000 characters", "prompt"),
    ("G44", {"prompt": "Hi", "repetition_penalty": 1e-38}, "repetition_penalty: must be in [1e-05, 100000] (1 = off), "
     "got 1e-38", "repetition_penalty"),
    ("G45", {"prompt": "Hi", "min_p": 1.5}, "min_p: must be in [0, 1] (0 = off), got 1.5", "min_p"),
    ("G46", {"prompt": "Hi", "frequency_penalty": -2.5}, "frequency_penalty: must be in [-2, 2] (0 = off), got -2.5",
     "frequency_penalty"),
    ("G47", {"prompt": "Hi", "logit_bias": {"600": 5}}, "logit_bias: token id 600 is outside the vocabulary [0, 512)",
     "logit_bias"),
    ("G48", {"prompt": "Hi", "logit_bias": {"5": -101}}, "logit_bias: the bias of token 5 must be in [-100, 100], "
     "got -101", "logit_bias"),
    ("G51", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs: must be in [0, 20], got 21", "prompt_logprobs"),
    ("G52", {"prompt": "Hi", "structured_outputs": {"json": {"type": "nonsense"}}},
     "structured_outputs: does not compile: Invalid type: nonsense", "structured_outputs"),
    # (a mix, G56-G60: the HTTP door names its fields as gRPC does; G61 is H31 there)
    ("G56", {"prompt": "Hi", "adapters": [{"name": "pirate"}, {"name": "pirate"}]}, "adapters[1]: adapter 'pirate' is "
     "named twice; give each adapter once, with the sum of its weights", "adapters[1]"),
    ("G57", {"prompt": "Hi", "adapters": [{"name": "pirate"}, {"name": "scribe", "weight": 100.5}]}, "adapters[1]: the "
     "weight of 'scribe' must be a finite number in [-100, 100], got 100.5", "adapters[1]"),
    ("G58", {"prompt": "Hi", "adapters": [{"name": f"a{i}"} for i in range(9)]}, "adapters: at most 8 adapters in one "
     "mix, got 9", "adapters"),
    ("G59", {"prompt": "Hi", "adapters": [{"name": "poet"}, {"name": "pirate", "weight": 0.5}]}, "adapters: the ranks "
     "of a mix add up: poet 16 + pirate 8 = 24, over this server's --max-lora-rank 16; mix fewer or lower-rank "
     "adapters, or raise --max-lora-rank", "adapters"),
    ("G60", {"prompt": "Hi", "adapters": [{"name": "pirate"}, {"name": "no-such-adapter"}]}, "adapter "
     "'no-such-adapter' is not loaded", "adapters[1]"),
]


@pytest.mark.parametrize("case_id", sorted(HTTP_CASES))
def test_http_catalogue(served, case_id):
    port = served.server.http_port
    for path, body, headers, status, fragment, param in HTTP_CASES[case_id]:
        got, reply, _ = post(port, path, body, headers)
        assert got == status, (case_id, got, reply)
        error = reply["error"]
        assert fragment in error["message"], (case_id, error)
        assert set(error) == {"message", "type", "param", "code"}
        if param is not None:
            assert error["param"] == param, (case_id, error)
    served.wait_idle()
    _ok(port)  # and the server keeps serving


def _documented_http_status(case_id: str) -> str:
    text = CATALOGUE.read_text()
    row = re.search(rf"^\| {case_id} \|(.*)$", text, flags=re.M).group(1)
    return [c.strip() for c in row.split("|")][2]


@pytest.mark.parametrize("case_id,body,fragment,param", SHARED_CASES, ids=[c[0] for c in SHARED_CASES])
def test_shared_rows_get_their_documented_http_status(served, case_id, body, fragment, param):
    got, reply, _ = post(served.server.http_port, COMPLETIONS, body)
    assert str(got) == _documented_http_status(case_id), reply
    assert fragment in reply["error"]["message"], reply
    if param is not None:
        assert reply["error"]["param"] == param


def test_an_activated_member_over_http(served, tmp_path):
    """G62 through `adapters`: 400 on the whole mix."""
    with activated_member(served.target, tmp_path) as checker:
        got, reply, _ = post(served.server.http_port, COMPLETIONS, {"prompt": "Hi", "adapters": [
            {"name": "pirate", "weight": 0.5}, {"name": checker, "weight": 0.5}]})
        served.wait_idle()
    assert str(got) == _documented_http_status("G62"), reply
    assert reply["error"]["param"] == "adapters"
    assert "adapters: adapter 'checker' is an activated LoRA (alora_invocation_tokens)" in reply["error"]["message"]


def test_http_column_follows_the_grpc_status():
    """Every row with both a gRPC status and an HTTP status in the catalogue agrees with the one mapping."""
    text = (ROOT / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\| ([GCLUTA]\d\d) \| [^|]* \| `([A-Z_]+)`[^|]* \| ([^|]*) \|", text, flags=re.M)
    assert len(rows) > 40
    for case_id, status, documented in rows:
        documented = documented.strip()
        if documented.startswith("—"):
            continue
        # (a message over the size limit is 413, HTTP's own status for it; an unknown field is fine on both doors)
        expected = {"G35": "413", "G40": "200"}.get(case_id, str(HTTP_STATUS[grpc.StatusCode[status]]))
        assert documented.split()[0] == expected, case_id


def test_queue_full_is_429_with_retry_after():
    """C01 over HTTP: 429, Retry-After, rate_limit_error."""
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, limits=RequestLimits(
        max_queue=0, max_concurrent_streams=1)))
    try:
        port = server.server.http_port
        holder = threading.Thread(target=post, args=(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 150,
                                                                           "ignore_eos": True}))
        holder.start()
        wait_for(lambda: server.server.runner.num_open_streams == 1, what="the first request")
        status, body, headers = post(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
        assert status == 429 and body["error"]["type"] == "rate_limit_error" and headers["retry-after"] == "1"
        holder.join(60)
    finally:
        server.stop()


def test_engine_failure_mid_stream_is_an_error_event(served, monkeypatch):
    """H15: the stream has started (200); the failure arrives as an error event, then [DONE]."""
    engine, port = served.engine, served.server.http_port
    real_step, calls = engine.step, []

    def flaky_step(plan, *args, **kwargs):  # the scheduler's SchedulerOutput, or a reference run's list
        calls.append(len(getattr(plan, "scheduled", plan)))
        if len(calls) == 3:
            raise RuntimeError("simulated device error")
        return real_step(plan, *args, **kwargs)

    monkeypatch.setattr(engine, "step", flaky_step)
    status, body, _ = post(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 50, "stream": True, "ignore_eos": True})
    monkeypatch.undo()
    events = [line.removeprefix("data: ") for line in body["raw"].splitlines() if line.startswith("data: ")]
    assert status == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "simulated device error" in error["message"] and error["code"] == "internal"
    served.wait_idle()
    _ok(port)


def test_bearer_tokens_on_the_http_door():
    """H11: the gRPC door's tokens; /health and /metrics stay open (probes and scrapers)."""
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, security=SecurityConfig(
        api_token="gen-token", admin_token="admin-token")))
    try:
        port = server.server.http_port
        body = {"prompt": "Hi", "max_tokens": 2}
        status, reply, _ = post(port, COMPLETIONS, body)
        assert status == 401 and "missing credentials" in reply["error"]["message"]
        assert reply["error"]["type"] == "authentication_error"
        assert post(port, COMPLETIONS, body, {"authorization": "Bearer wrong"})[0] == 401
        assert post(port, COMPLETIONS, body, {"authorization": "Basic gen-token"})[0] == 401
        for token in ("gen-token", "admin-token"):
            assert post(port, COMPLETIONS, body, {"authorization": f"Bearer {token}"})[0] == 200
        assert post(port, "/v1/models", b"", method="GET")[0] == 401
        assert post(port, "/v1/models", b"", {"authorization": "Bearer gen-token"}, method="GET")[0] == 200
        assert post(port, "/health", b"", method="GET")[0] == 200
        assert post(port, "/metrics", b"", method="GET")[0] == 200
    finally:
        server.stop()


def test_tls_on_the_http_door(tmp_path):
    """The gRPC door's certificate serves HTTPS too; plaintext to the port gets no answer."""
    ca = CertificateAuthority(tmp_path)
    pem = ca.issue("server", server=True)
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, security=SecurityConfig(
        tls=TlsConfig(str(pem.cert), str(pem.key)))))
    try:
        port = server.server.http_port
        context = ssl.create_default_context(cafile=str(ca.pem.cert))
        status, reply, _ = post(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2}, context=context)
        assert status == 200 and reply["usage"]["completion_tokens"] == 2
        with pytest.raises((http.client.HTTPException, ConnectionError, OSError)):
            post(port, COMPLETIONS, {"prompt": "Hi", "max_tokens": 2})
        with pytest.raises(ssl.SSLError):  # a client that does not trust the CA
            post(port, COMPLETIONS, {"prompt": "Hi"}, context=ssl.create_default_context())
    finally:
        server.stop()


def test_every_h_row_is_checked():
    text = CATALOGUE.read_text()
    documented = set(re.findall(r"^\| (H\d\d) \|", text, flags=re.M))
    assert documented == set(HTTP_CASES) | ELSEWHERE
    rows = dict(re.findall(r"^\| (H\d\d) \|(.*)$", text, flags=re.M))
    for case_id, cases in HTTP_CASES.items():  # and the row quotes one of its cases' messages
        assert case_id in WORDED_OTHERWISE or any(case[4] in rows[case_id] for case in cases), case_id
