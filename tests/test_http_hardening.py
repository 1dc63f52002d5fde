"""The HTTP door against a hostile web page and sloppy clients, through the real server: the Host header (DNS
rebinding), JSON required by Content-Type (cross-origin form posts), no redirect built from Host, 405 with Allow,
HEAD where GET exists, `param: "model"` for refused adapter names, chat-template errors in our words; and tiny
temperatures, greedy on both doors."""
from __future__ import annotations

import http.client
import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from service.cli import _server_config, serve_parser
from service.client import InvalidArgumentError
from service.security import SecurityConfig
from service.server import ServerConfig
from tests.checkpoints import write_chat_template
from tests.http_wire import metric_value, metrics, post
from tests.service_harness import ServerThread, build_engine, demo_paths, openai_client, shared_engine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BODY = {"prompt": "Hi", "max_tokens": 2}
# Refuses unknown roles itself (raise_exception); needs every message's content and every tool call's name.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}{{ m['role'] + ': ' + m['content'] }}\n"
    "{% for call in m.get('tool_calls', []) %}{{ call['function']['name'] + '()' }}\n{% endfor %}{% endfor %}"
    "{% if stamp is defined %}{{ stamp + 1 }}{% endif %}{% if probe is defined %}{{ probe.__class__.__mro__ }}{% endif %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo model with a chat template, adapters on demand from an (empty) adapter directory; loopback, no
    token: the default a developer runs."""
    model, adapters = demo_paths()
    base = tmp_path_factory.mktemp("hardening")
    shutil.copytree(model, base / "model")
    write_chat_template(base / "model", CHAT_TEMPLATE)
    (base / "adapters").mkdir()
    engine = build_engine(base / "model", {"pirate": adapters["pirate"]}, adapter_dirs=(str(base / "adapters"),))
    server = ServerThread(engine, ServerConfig(port=0, http_port=0))
    yield server
    server.stop()


def _raw(port: int, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, dict, bytes]:
    """One request with exactly these headers (Host too: none is added), as a browser or curl would send it."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for name, value in {**headers, "content-length": str(len(body))}.items():
            conn.putheader(name, value)
        conn.endheaders(body)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _served_requests(port: int) -> float:
    """Requests that reached the engine and ended (Prometheus: lora_serve:request_success_total, every reason)."""
    return metric_value(metrics(port), "lora_serve:request_success_total")


def _generate(port: int, host: str, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, _, raw = _raw(port, "POST", COMPLETIONS, {"host": host, "content-type": "application/json",
                                                       **(headers or {})}, json.dumps(BODY).encode())
    return status, json.loads(raw)


# --- Host ---------------------------------------------------------------------------------------------------
def test_a_loopback_server_answers_only_to_loopback_names(served):
    port = served.server.http_port
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST"):
        assert _generate(port, host)[0] == 200, host
    served.wait_idle()
    before = _served_requests(port)
    status, body = _generate(port, "rebind.attacker.example:8000")  # a page's own name, resolved to 127.0.0.1
    assert status == 421, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == "misdirected_request"
    assert ("this server does not answer to Host 'rebind.attacker.example:8000': it answers only to localhost, "
            "127.0.0.1, [::1]") in body["error"]["message"]
    assert "--allowed-hosts rebind.attacker.example" in body["error"]["message"]
    for host in ("localhost.attacker.example", "127.0.0.1.nip.io", "evil@localhost", "*.localhost"):
        assert _generate(port, host)[0] == 421, host
    assert _served_requests(port) == before  # refused before any work
    # Probes and scrapers (Kubernetes: the pod IP as Host) are not refused.
    for path in ("/health", "/metrics"):
        assert _raw(port, "GET", path, {"host": "10.1.2.3:8000"})[0] == 200, path
    # The openai client sent to the server under another name is refused the same way.
    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60,
                       default_headers={"Host": "rebind.attacker.example"}) as client:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="", prompt="Hi", max_tokens=2)
    assert info.value.status_code == 421 and "DNS rebinding" in info.value.message
    served.wait_idle()


def test_allowed_hosts_and_the_api_token():
    """--allowed-hosts replaces the default names (a token set or not); a token alone admits any Host."""
    listed = SecurityConfig(allowed_hosts=("api.example.com", "*.internal"))
    tokened = SecurityConfig(api_token="gen-token")
    both = SecurityConfig(api_token="gen-token", allowed_hosts=("api.example.com",))
    bearer = {"authorization": "Bearer gen-token"}
    cases = [  # (security, host, headers, status)
        (listed, "api.example.com:8443", {}, 200), (listed, "lora.svc.internal", {}, 200),
        (listed, "internal", {}, 421), (listed, "localhost", {}, 421), (listed, "api.example.com.evil", {}, 421),
        (tokened, "anything.example", bearer, 200), (tokened, "anything.example", {}, 401),
        (both, "api.example.com", bearer, 200), (both, "anything.example", bearer, 421),
    ]
    for security in (listed, tokened, both):
        server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, security=security))
        try:
            for case_security, host, headers, status in cases:
                if case_security is security:
                    got, body = _generate(server.server.http_port, host, headers)
                    assert got == status, (security, host, body)
                    if status == 421:
                        assert "(--allowed-hosts: a guard against DNS rebinding)" in body["error"]["message"]
        finally:
            server.stop()


def test_allowed_hosts_flag():
    parse = serve_parser().parse_args
    config = _server_config(parse(["--allowed-hosts", "API.example.com,[::1]", "--allowed-hosts", "*.internal"]))
    assert config.security.allowed_hosts == ("api.example.com", "::1", "*.internal")
    assert _server_config(parse([])).security.allowed_hosts == ()
    for bad in ("api.example.com:8000", "http://api.example.com", "a.*.example"):
        with pytest.raises(ValueError, match="give names without a scheme or port"):
            _server_config(parse(["--allowed-hosts", bad]))


# --- what a cross-origin page can send ----------------------------------------------------------------------
def test_json_is_required_by_content_type(served):
    """A page on another origin can POST text/plain, a form or an untyped body without asking the browser first
    (and curl -d sends a form type): 415, and nothing reaches the engine."""
    port, body = served.server.http_port, json.dumps(BODY).encode()
    host = f"127.0.0.1:{port}"
    served.wait_idle()
    before = _served_requests(port)
    for content_type in ("text/plain", "text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x", "application/json; charset=latin-1", None):
        headers = {"host": host} | ({"content-type": content_type} if content_type else {})
        status, _, raw = _raw(port, "POST", COMPLETIONS, headers, body)
        error = json.loads(raw)["error"]
        assert status == 415 and error["type"] == "invalid_request_error", (content_type, error)
        assert "send the header 'Content-Type: application/json'" in error["message"]
    assert _served_requests(port) == before
    accepted = ("application/json", "application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json")
    for content_type in accepted:
        assert _raw(port, "POST", COMPLETIONS, {"host": host, "content-type": content_type}, body)[0] == 200
    served.wait_idle()
    assert _served_requests(port) == before + len(accepted)


def test_no_redirect_is_built_from_the_host_header():
    """A trailing slash is an unknown path (404, JSON), not a redirect to a Location made of the Host header
    (here a server that answers any Host: a token is set)."""
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0,
                                                        security=SecurityConfig(api_token="gen-token")))
    try:
        port = server.server.http_port
        for method, path in (("POST", COMPLETIONS + "/"), ("GET", "/v1/models/"), ("GET", "/health/")):
            status, headers, raw = _raw(port, method, path, {"host": "attacker.example", "content-type":
                                                              "application/json", "authorization": "Bearer gen-token"})
            assert status == 404 and "location" not in headers, (path, status, headers)
            assert json.loads(raw)["error"]["type"] == "not_found_error"
    finally:
        server.stop()


# --- methods --------------------------------------------------------------------------------------------------
def test_405_says_which_methods_and_head_works_where_get_does(served):
    port = served.server.http_port
    host = {"host": f"localhost:{port}", "content-type": "application/json"}
    for method, path, allow in (("POST", "/health", "GET, HEAD"), ("DELETE", "/v1/models", "GET, HEAD"),
                                ("GET", COMPLETIONS, "POST"), ("PUT", CHAT, "POST")):
        status, headers, raw = _raw(port, method, path, host)
        error = json.loads(raw)["error"]
        assert status == 405 and headers["allow"] == allow, (method, path, headers)
        assert error["type"] == "invalid_request_error" and error["code"] == "method_not_allowed"
        assert f"{path} takes {allow}, not {method}" in error["message"]
    for path in ("/health", "/metrics", "/v1/models"):
        get_status, get_headers, get_body = _raw(port, "GET", path, host)
        status, headers, body = _raw(port, "HEAD", path, host)
        assert (status, body) == (200, b"") and get_status == 200 and get_body, path
        assert headers["content-type"] == get_headers["content-type"], path


# --- param ----------------------------------------------------------------------------------------------------
def test_refused_adapter_names_name_the_model_param(served):
    with openai_client(served) as client:
        with pytest.raises(openai.NotFoundError) as info:
            client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
        assert info.value.param == "model" and "adapter 'no-such-adapter' is not loaded" in info.value.message
        for name in ("../outside", ".hidden", "a\\b", "pirate\n"):
            says = "is not allowed: use 1 to 128 letters, digits"
            with pytest.raises(openai.BadRequestError) as info:
                client.completions.create(model=name, prompt="Hi", max_tokens=2)
            assert info.value.param == "model" and info.value.code == "invalid_argument", name
            assert info.value.body["message"].startswith("model: adapter name ") and says in info.value.message, name


# --- chat templates -------------------------------------------------------------------------------------------
def test_chat_template_errors_are_in_our_words(served):
    """The template's own refusal is quoted; otherwise the message names the message and field, or says what
    kind of failure it was: never jinja2's or Python's wording."""
    user = {"role": "user", "content": "hi"}
    cases = [  # (messages, chat_template_kwargs, what the message says)
        ([{"role": "wizard", "content": "hi"}], None, "messages: the model's chat template refused them: unknown role wizard"),
        ([user, {"role": "assistant"}], None,
         "messages: the model's chat template needs 'content' in messages[1] (a message with role 'assistant'), "
         "which it does not have"),
        ([user, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}], None,
         "needs 'name' in messages[1].tool_calls[0].function (a message with role 'assistant')"),
        ([user], {"stamp": "today"}, "the model's chat template cannot render them: it failed on a value it does not "
                                     "handle (check each message's role and content, and chat_template_kwargs)"),
        ([user], {"probe": "x"}, "it failed on an operation its sandbox forbids"),
    ]
    with openai_client(served) as client:
        for messages, kwargs, says in cases:
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="pirate", messages=messages, max_tokens=2,
                                               extra_body={"chat_template_kwargs": kwargs} if kwargs else None)
            message = info.value.body["message"]
            assert says in message and info.value.param == "messages", message
            for leak in ("Error", "object", "dict", "str", "__class__", "concatenate", "unsafe"):
                assert leak not in message.replace("chat_template_kwargs", ""), (leak, message)
        reply = client.chat.completions.create(model="pirate", messages=[user], max_tokens=2)  # and it still serves
        assert reply.usage.completion_tokens == 2
    served.wait_idle()


# --- sampling -------------------------------------------------------------------------------------------------
def test_tiny_temperatures_are_greedy_on_both_doors(served):
    """Below 1e-5 a temperature is greedy (vLLM's rule); before, 1e-38 divided the logits into infinity and
    every step drew token 0. Both doors at once (one batch), against the engine's greedy reference."""
    prompt = served.engine.tokenizer.encode("Once upon a time")
    greedy = served.reference(prompt, None, 6, ignore_eos=True)
    assert set(greedy) != {0}

    def grpc_door(temperature: float) -> list[int]:
        with served.client() as client:
            return client.complete(prompt, temperature=temperature, seed=1, max_new_tokens=6, ignore_eos=True).token_ids

    def http_door(temperature: float) -> list[int]:
        status, reply, _ = post(served.server.http_port, COMPLETIONS, {
            "prompt": prompt, "temperature": temperature, "seed": 1, "max_tokens": 6, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 1})
        assert status == 200, reply
        return reply["choices"][0]["token_ids"]

    temperatures = (1e-30, 1e-38, 1e-40, 9e-6)
    with ThreadPoolExecutor(2 * len(temperatures)) as pool:
        runs = {(door.__name__, t): pool.submit(door, t) for door in (grpc_door, http_door) for t in temperatures}
        assert {key: run.result(60) for key, run in runs.items()} == {key: greedy for key in runs}
    served.wait_idle()


def test_repetition_penalties_that_overflow_are_refused(served):
    """A penalty of 1e-38 divided seen logits into infinity (NaN log-probabilities, and a 500 over HTTP): the
    penalty must lie in [1e-5, 1e5], on both doors, with the field named."""
    for penalty in (1e-38, 1e-6, 1e38):
        with served.client() as client, pytest.raises(InvalidArgumentError) as info:
            client.complete("Hi", repetition_penalty=penalty, max_new_tokens=2, logprobs=True)
        assert [v.field for v in info.value.field_violations] == ["sampling.repetition_penalty"]
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "must be in [1e-05, 100000] (1 = off)" in info.value.message
        status, reply, _ = post(served.server.http_port, COMPLETIONS, {"prompt": "Hi", "repetition_penalty": penalty,
                                                                       "max_tokens": 2, "logprobs": 1})
        assert status == 400 and reply["error"]["param"] == "repetition_penalty", reply
    for penalty in (1e-5, 1e5):  # the bounds themselves, as float32 carries them
        with served.client() as client:
            assert client.complete("Hi", repetition_penalty=penalty, max_new_tokens=2).usage.completion_tokens == 2
    served.wait_idle()
