"""Tool calls on /v1/chat/completions (service/http_api/tool_calls.py), with the clients users have: tools and tool
results reach the chat template as transformers renders them; "required" and a named function are forced by the
grammar, so a random-weights model's calls always parse and validate; "auto" parses hermes <tool_call> blocks
(here held to that form by a grammar, as a trained model writes it); streamed as OpenAI streams calls; refusals
name the field."""
from __future__ import annotations

import json
import os

import jsonschema
import openai
import pydantic
import pytest

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # before LiteLLM is imported: it fetches the map otherwise

import litellm  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from service.server import ServerConfig  # noqa: E402
from tests.http_wire import post  # noqa: E402
from tests.service_harness import (  # noqa: E402
    ServerThread,
    build_engine,
    chat_server,
    openai_client,
    shared_engine,
)

# A hermes-style template: the tools in a system line, assistant calls as <tool_call> JSON, tool results.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}system: tools {% for t in tools %}{{ t['function']['name'] }}"
    "({{ t['function']['parameters']['required'] | join(', ') }}){% if not loop.last %}, {% endif %}{% endfor %}\n"
    "{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}tool {{ m['tool_call_id'] }}: {{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' and m['tool_calls'] is defined %}assistant:{% for c in m['tool_calls'] %}"
    " <tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}\n{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["C", "F"]}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    server = chat_server(tmp_path_factory.mktemp("tools"), TOOLS_TEMPLATE,
                         ServerConfig(port=0, http_port=0, tool_call_parser="hermes"))
    yield server
    server.stop()


def _valid(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed_calls(chunks) -> tuple[dict[int, dict], str | None]:
    """OpenAI's streamed tool calls put together by index (first delta: id, name; then argument fragments)."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or ():
            call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
            assert d.id in (None, call["id"]) and d.function.name in (None, call["name"])
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return calls, finish


def test_tools_and_tool_results_reach_the_template_as_transformers_renders_them(served):
    """/tokenize's chat form with tools: the ids of transformers' apply_chat_template(tools=...), an assistant
    call's JSON-text arguments given to the template as an object, and a tool result."""
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"C\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    status, reply, _ = post(served.server.http_port, "/tokenize", {"messages": messages, "tools": TOOLS})
    assert status == 200, reply
    tokenizer = AutoTokenizer.from_pretrained(served.engine.config.model)
    for_hf = [*messages[:1], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}}]}, messages[2]]
    rendered = tokenizer.apply_chat_template(for_hf, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    assert reply["tokens"] == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_required_tool_calls_always_parse(served, client):
    """tool_choice "required", sampled on base and adapter: every call names a tool and its arguments validate;
    finish_reason "tool_calls"; streamed, the same calls put together."""
    for seed in range(4):
        done = client.chat.completions.create(model=["", "pirate"][seed % 2], messages=ASK, tools=TOOLS,
                                              tool_choice="required", temperature=1.0, seed=seed, max_tokens=200)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            _valid(call)
    stream = client.chat.completions.create(model="pirate", messages=ASK, tools=TOOLS, tool_choice="required",
                                            temperature=1.0, seed=9, max_tokens=200, stream=True)
    calls, finish = _streamed_calls(stream)
    assert finish == "tool_calls" and calls
    for call in calls.values():
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_named_tool_choice_streams_its_arguments(served, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    done = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=named, temperature=1.0,
                                          seed=1, max_tokens=100)
    (call,) = done.choices[0].message.tool_calls
    assert call.function.name == "get_time" and done.choices[0].finish_reason == "stop"  # (OpenAI's, for a named call)
    _valid(call)
    chunks = list(client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice=named,
                                                 temperature=1.0, seed=2, max_tokens=100, stream=True))
    calls, finish = _streamed_calls(chunks)
    assert list(calls) == [0] and calls[0]["name"] == "get_time" and finish == "stop"
    jsonschema.validate(json.loads(calls[0]["arguments"]), CLOCK)
    fragments = sum(bool(c.choices[0].delta.tool_calls and c.choices[0].delta.tool_calls[0].function.arguments)
                    for c in chunks)
    assert fragments > 1  # the arguments came as they were written


# The hermes form a trained model writes, as a grammar: "auto" must parse it.
HERMES_GRAMMAR = ('start: "I will check. <tool_call>" call "</tool_call>"\n'
                  'call: %json {"type": "object", "additionalProperties": false, "required": ["name", "arguments"], '
                  '"properties": {"name": {"const": "get_weather"}, "arguments": ' + json.dumps(WEATHER) + '}}\n')


def test_auto_parses_hermes_calls(served, client):
    extra = {"structured_outputs": {"grammar": HERMES_GRAMMAR}}
    done = client.chat.completions.create(model="pirate", messages=ASK, tools=TOOLS, temperature=1.0, seed=4,
                                          max_tokens=200, extra_body=extra)  # (no tool_choice: "auto")
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid(call)
    chunks = list(client.chat.completions.create(model="pirate", messages=ASK, tools=TOOLS, temperature=1.0,
                                                 seed=4, max_tokens=200, extra_body=extra, stream=True))
    calls, finish = _streamed_calls(chunks)
    assert finish == "tool_calls" and calls[0]["arguments"] == call.function.arguments
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "I will check. "
    # No call written: the answer is content.
    plain = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=6,
                                           extra_body={"ignore_eos": True})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


def test_auto_parses_llama3_json_calls(tmp_path):
    """--tool-call-parser llama3_json: an answer that is a {"name", "parameters"} object is a call (held to that
    form by a JSON schema here), streamed or not; a text answer stays content."""
    server = chat_server(tmp_path, TOOLS_TEMPLATE, ServerConfig(port=0, http_port=0, tool_call_parser="llama3_json"))
    call_form = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                 "properties": {"name": {"const": "get_time"}, "parameters": CLOCK}}
    extra = {"structured_outputs": {"json": call_form}}
    try:
        with openai_client(server) as sdk:
            done = sdk.chat.completions.create(model="", messages=ASK, tools=TOOLS, temperature=1.0, seed=3,
                                               max_tokens=100, extra_body=extra)
            (call,) = done.choices[0].message.tool_calls
            assert (call.function.name, done.choices[0].finish_reason) == ("get_time", "tool_calls")
            _valid(call)
            calls, finish = _streamed_calls(sdk.chat.completions.create(
                model="", messages=ASK, tools=TOOLS, temperature=1.0, seed=3, max_tokens=100, extra_body=extra,
                stream=True))
            assert finish == "tool_calls" and calls[0]["arguments"] == call.function.arguments
            plain = sdk.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=20,
                                                extra_body={"structured_outputs": {"choice": ["It is noon."]}})
            assert (plain.choices[0].message.content, plain.choices[0].message.tool_calls) == ("It is noon.", None)
    finally:
        server.stop()


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=6)
    unit: str = pydantic.Field(pattern="^[CF]$")


def test_langchain_bind_tools_and_function_calling(served):
    chat = ChatOpenAI(model="pirate", base_url=f"http://127.0.0.1:{served.server.http_port}/v1", api_key="unused",
                      max_retries=0, timeout=120, temperature=1.0, seed=5, max_tokens=200)
    # strict: the schema closed to other properties (a random model would otherwise spend its tokens on one)
    reply = chat.bind_tools([Weather], tool_choice="required", strict=True).invoke("Weather in Paris?")
    assert reply.tool_calls and reply.tool_calls[0]["name"] == "Weather"
    Weather.model_validate(reply.tool_calls[0]["args"])
    assert isinstance(chat.with_structured_output(Weather, method="function_calling", strict=True).invoke("Paris?"),
                      Weather)


def test_litellm_tools(served):
    reply = litellm.completion(model="openai/pirate", api_base=f"http://127.0.0.1:{served.server.http_port}/v1",
                               api_key="unused", messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0,
                               seed=6, max_tokens=200)
    assert reply.choices[0].finish_reason == "tool_calls"
    for call in reply.choices[0].message.tool_calls:
        _valid(call)


@pytest.mark.parametrize("extra,param,message", [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name",
     "must be 1-64 letters"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "must be {\"type\": \"function\""),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "'nope' is not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "drop response_format"),
])
def test_a_bad_tool_request_is_a_400_naming_it(client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=ASK, max_tokens=4, **extra)
    assert info.value.param == param and message in info.value.body["message"], info.value.body


def test_auto_needs_a_tool_call_parser():
    """Without --tool-call-parser: "auto" is refused by name; unset, the tools reach the template and the answer
    is text (the server is the demo model's, which has no template: the refusal comes first)."""
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0))
    try:
        with openai_client(server) as sdk, pytest.raises(openai.BadRequestError) as info:
            sdk.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=4)
        assert info.value.param == "tool_choice" and "--tool-call-parser" in info.value.body["message"]
    finally:
        server.stop()


def test_the_readmes_tool_call_example_runs_as_pasted():
    """The README's tool-call code, run as written against the demo (SmolLM2) served as its command line says
    (--chat-template lora_serve_demo/tools_chat_template.jinja --tool-call-parser hermes)."""
    import contextlib
    import io
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    command = re.search(r"\./scripts/serve\.sh --chat-template (\S+) --tool-call-parser (\w+)", readme)
    code = re.search(r"```python\n(tools = .*?)```", readme, re.DOTALL).group(1)
    from lora_serve_demo.smollm2 import demo_adapters, fetch_smollm2

    model = fetch_smollm2()  # the demo ./scripts/serve.sh serves (the template's system line takes ~280 tokens)
    engine = build_engine(model, {"pirate": demo_adapters()["pirate"]}, max_seq_len=512)
    server = ServerThread(engine, ServerConfig(port=0, http_port=0, chat_template=str(root / command[1]),
                                               tool_call_parser=command[2]))
    try:
        with openai_client(server, timeout=600) as client:  # a bound, not a speed: 30 layers, eager
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(code, {"client": client})  # noqa: S102 - the README's own example
        assert printed.getvalue().startswith("tool_calls [ChatCompletionMessage"), printed.getvalue()
        assert "name='get_weather'" in printed.getvalue()
    finally:
        server.stop()
