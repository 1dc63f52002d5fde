"""The clients users point at an OpenAI-compatible server, used unchanged against a real server over loopback:
LangChain (`OpenAI(...).batch`, which sends the prompts as one list in one request; `ChatOpenAI` invoke and stream)
and LiteLLM (`completion` through its `openai/` chat provider and `text-completion-openai/` completions provider,
`text_completion`, streaming), the base model and an adapter picked by model name. Each answer must be the text
the official openai client gets for the same greedy request, whose tokens are checked here against the engine's
own (and those, by the engine tests, against transformers + PEFT). Nothing reaches past loopback: LiteLLM reads
its bundled model cost map (LITELLM_LOCAL_MODEL_COST_MAP), and any other address is refused at once rather than
left to time out."""
from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import openai
import pydantic
import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before LiteLLM is imported: it fetches the map otherwise

import litellm  # noqa: E402
from langchain_openai import ChatOpenAI, OpenAI  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from lora_compile import SamplingParams  # noqa: E402
from tests.service_harness import ServerThread, chat_server, wait_for  # noqa: E402

NEW_TOKENS = 8
PROMPTS = ["Once upon a time", "The river ran", "A poet wrote"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
GREEDY = dict(temperature=0, max_tokens=NEW_TOKENS)
IGNORE_EOS = {"ignore_eos": True}  # vLLM's field, sent as each client sends extra fields: every answer is long
ACCESS_LOG = "service.telemetry.access_log"
LOOPBACK = ("127.0.0.1", "::1", "localhost")
# LiteLLM's own typed dicts, as pydantic builds their schemas on first use: not about this server.
pytestmark = pytest.mark.filterwarnings("ignore:Items? .* the `ReadOnly` qualifier:UserWarning")


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """A name lookup or connection for anything but loopback fails at once (a client that phones home fails the
    test instead of waiting for a network timeout)."""
    getaddrinfo, connect = socket.getaddrinfo, socket.socket.connect

    def lookup(host, *args, **kwargs):
        if host not in (None, *LOOPBACK):
            raise socket.gaierror(f"test looked up {host!r} (only loopback is allowed)")
        return getaddrinfo(host, *args, **kwargs)

    def guarded(sock, address):
        if isinstance(address, tuple) and address[0] not in LOOPBACK:
            raise OSError(f"test tried to reach {address} (only loopback is allowed)")
        return connect(sock, address)

    socket.getaddrinfo, socket.socket.connect = lookup, guarded
    yield
    socket.getaddrinfo, socket.socket.connect = getaddrinfo, connect


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo model with a chat template, and the pirate adapter."""
    server = chat_server(tmp_path_factory.mktemp("clients-model"), CHAT_TEMPLATE)
    yield server
    server.stop()


def _base_url(served: ServerThread) -> str:
    return f"http://127.0.0.1:{served.server.http_port}/v1"


@dataclass
class Expected:
    """What the openai client gets for each greedy request the other clients send."""

    completions: list[str]  # each of PROMPTS, base model
    chat: dict[str, str]    # MESSAGES, by model name (the base model and "pirate")


@pytest.fixture(scope="module")
def expected(served) -> Expected:
    """The openai client's answers (sent together: one batch on the server), each one's tokens equal to the
    engine's own for the same prompt ids (the chat's as transformers renders the template)."""
    base = served.engine.model_name
    tokenizer = AutoTokenizer.from_pretrained(served.engine.config.model)
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    chat_ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    prompts = [served.engine.tokenizer.encode(p) for p in PROMPTS] + [chat_ids, chat_ids]
    adapters = [None] * len(PROMPTS) + [None, "pirate"]
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reference = served.in_engine_thread(lambda: served.engine.generate(prompts, params, adapters=adapters))

    extra = {**IGNORE_EOS, "return_token_ids": True}
    with openai.OpenAI(base_url=_base_url(served), api_key="unused", max_retries=0, timeout=120) as sdk:
        def complete(prompt: str):
            return sdk.completions.create(model=base, prompt=prompt, **GREEDY, extra_body=extra).choices[0]

        def chat(model: str):
            return sdk.chat.completions.create(model=model, messages=MESSAGES, **GREEDY, extra_body=extra).choices[0]

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, PROMPTS)) + list(pool.map(chat, [base, "pirate"]))
    assert [a.model_extra["token_ids"] for a in answers] == reference
    texts = [a.text for a in answers[:len(PROMPTS)]] + [a.message.content for a in answers[len(PROMPTS):]]
    assert all(texts)
    return Expected(texts[:len(PROMPTS)], {base: texts[-2], "pirate": texts[-1]})


def _completion_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == ACCESS_LOG and '"POST /v1/completions ' in r.getMessage()]


# --- LangChain -------------------------------------------------------------------------------------------------
def test_langchain_batch_is_one_request_with_each_prompts_greedy_text(served, expected, caplog):
    llm = OpenAI(model=served.engine.model_name, base_url=_base_url(served), api_key="unused", max_retries=0,
                 timeout=120, extra_body=IGNORE_EOS, **GREEDY)
    caplog.set_level("INFO", logger=ACCESS_LOG)
    caplog.clear()
    assert llm.batch(PROMPTS) == expected.completions
    # One HTTP request carried the three prompts: its access-log line counts every choice's tokens.
    wait_for(lambda: _completion_lines(caplog), what="the access log line")
    lines = _completion_lines(caplog)
    assert len(lines) == 1 and f" completion_tokens={len(PROMPTS) * NEW_TOKENS} " in lines[0], lines


def test_langchain_chat_invoke_and_stream_pick_the_adapter_by_model_name(served, expected):
    pirate = expected.chat["pirate"]
    assert pirate != expected.chat[served.engine.model_name]  # the adapter changes the answer
    chat = ChatOpenAI(model="pirate", base_url=_base_url(served), api_key="unused", max_retries=0, timeout=120,
                      extra_body=IGNORE_EOS, **GREEDY)
    messages = [("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])]
    reply = chat.invoke(messages)
    assert reply.content == pirate
    assert (reply.response_metadata["finish_reason"], reply.response_metadata["model_name"]) == ("length", "pirate")
    assert reply.usage_metadata["output_tokens"] == NEW_TOKENS
    chunks = list(chat.stream(messages))
    assert "".join(c.content for c in chunks) == pirate
    assert sum(bool(c.content) for c in chunks) > 1  # streamed, not sent whole


# --- LiteLLM ---------------------------------------------------------------------------------------------------
def test_litellm_chat_and_stream(served, expected):
    kwargs = dict(model="openai/pirate", api_base=_base_url(served), api_key="unused", messages=MESSAGES,
                  extra_body=IGNORE_EOS, **GREEDY)
    reply = litellm.completion(**kwargs)
    assert reply.choices[0].message.content == expected.chat["pirate"]
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == NEW_TOKENS
    chunks = list(litellm.completion(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.chat["pirate"]
    assert sum(bool(c.choices and c.choices[0].delta.content) for c in chunks) > 1


def test_litellm_text_completion_and_stream(served, expected):
    kwargs = dict(model=f"text-completion-openai/{served.engine.model_name}", api_base=_base_url(served),
                  api_key="unused", extra_body=IGNORE_EOS, **GREEDY)
    reply = litellm.text_completion(prompt=PROMPTS[0], **kwargs)
    assert reply.choices[0].text == expected.completions[0]
    assert reply.choices[0].finish_reason == "length"
    chunks = list(litellm.text_completion(prompt=PROMPTS[0], stream=True, **kwargs))
    assert "".join(c.choices[0].text or "" for c in chunks if c.choices) == expected.completions[0]
    # completion() on the completions provider: one user message is sent as the prompt.
    reply = litellm.completion(messages=[{"role": "user", "content": PROMPTS[1]}], **kwargs)
    assert reply.choices[0].message.content == expected.completions[1]


# --- structured outputs ----------------------------------------------------------------------------------------
class Verdict(pydantic.BaseModel):
    """A verdict on a story."""

    liked: bool
    stars: int = pydantic.Field(ge=1, le=5)


def test_langchain_with_structured_output(served):
    """with_structured_output(Model) by json_schema (response_format json_schema) and json_mode (json_object):
    each answer is the model, sampled from the random demo model through the grammar."""
    chat = ChatOpenAI(model="pirate", base_url=_base_url(served), api_key="unused", max_retries=0, timeout=120,
                      temperature=1.0, max_tokens=200, seed=7)
    verdict = chat.with_structured_output(Verdict, method="json_schema").invoke(MESSAGES)
    assert isinstance(verdict, Verdict), verdict
    # json_mode sends response_format json_object: any object, whose free keys a random model rarely closes within
    # max_tokens, so the raw answer is checked: it is held to JSON from its first token.
    out = chat.with_structured_output(None, method="json_mode", include_raw=True).invoke(MESSAGES)
    assert out["raw"].content.startswith("{"), out
    if out["raw"].response_metadata["finish_reason"] == "stop":
        assert isinstance(out["parsed"], dict), out


def test_litellm_response_format(served):
    schema = Verdict.model_json_schema() | {"additionalProperties": False}
    reply = litellm.completion(model="openai/pirate", api_base=_base_url(served), api_key="unused", messages=MESSAGES,
                               max_tokens=200, temperature=1.0, seed=3, response_format={
                                   "type": "json_schema", "json_schema": {"name": "verdict", "schema": schema,
                                                                          "strict": True}})
    assert reply.choices[0].finish_reason == "stop"
    Verdict.model_validate_json(reply.choices[0].message.content)
