"""Structured outputs (lora_compile.sample.structured_output): a constrained output always parses and validates, whatever
the model (random weights here, sampled); constrained, free and adapter requests share a batch and each gets its
solo tokens; a spec compiles once; a bad one is refused before any step, naming the problem. Then both doors:
the openai SDK (response_format, chat.completions.parse, vLLM's structured_outputs) and the gRPC SDK."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pydantic
import pytest

from lora_compile import SamplingParams
from lora_compile.sample.structured_output import GrammarError, StructuredOutput
from service.client import InvalidArgumentError
from service.server import ServerConfig
from tests.conftest import build_engine
from tests.service_harness import ServerThread, chat_server, shared_engine
from tests.test_http_api import CHAT_TEMPLATE

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "ok", "n", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}
CITIES = ["Paris", "London", "New York"]
EMAIL = r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)"


def _check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), PERSON)
    elif kind == "choice":
        assert text in CITIES, text
    else:
        assert re.fullmatch(EMAIL, text), text


SPECS = {"json": StructuredOutput("json", json.dumps(PERSON)), "choice": StructuredOutput("choice", json.dumps(CITIES)),
         "regex": StructuredOutput("regex", EMAIL)}


def sampled_workload(n: int) -> tuple[list[str], list[list[int]], list[SamplingParams], list[str | None]]:
    """n seeded sampled requests, the three kinds of constraint and base and two adapters in turn: (kinds, prompts,
    params, adapters)."""
    kinds = [list(SPECS)[i % 3] for i in range(n)]
    params = [SamplingParams(max_new_tokens=100, temperature=1.0, seed=i, structured_output=SPECS[k])
              for i, k in enumerate(kinds)]
    return kinds, [[5 + i % 50, 17, 9] for i in range(n)], params, [[None, "qv8", "all4"][i % 3] for i in range(n)]


def test_random_model_outputs_always_parse_and_validate(models, adapters):
    """200 sampled answers of a random-weights model, three kinds of constraint, base and adapters mixed: every
    one ends by its grammar (finish "grammar", or "eos" where it accepted one) and parses and validates."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False)
    kinds, prompts, params, names = sampled_workload(200)
    seqs = engine.generate_sequences(prompts, params, names)
    assert {s.finish_reason for s in seqs} <= {"eos", "grammar"}, {s.finish_reason for s in seqs}
    for kind, seq in zip(kinds, seqs):
        _check(kind, engine.tokenizer.decode(seq.output_ids))
    assert engine.grammars.compiles == 3  # once per spec, whatever the number of requests


def test_constrained_free_and_adapter_requests_share_a_batch(models, adapters):
    """Greedy: each request's tokens in a mixed batch equal its tokens run alone."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False)
    prompts = [[7, 8, 9, 10], [11, 12], [13, 14, 15], [16, 17, 18, 19, 20], [21, 22]]
    params = [SamplingParams(max_new_tokens=100, structured_output=SPECS["json"]),
              SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=40, structured_output=SPECS["choice"]),
              SamplingParams(max_new_tokens=40, structured_output=SPECS["regex"]),
              SamplingParams(max_new_tokens=12, ignore_eos=True)]
    names = ["qv8", None, "all4", None, "qv8"]
    batch = engine.generate(prompts, params, names)
    solo = [engine.generate([p], [sp], [n])[0] for p, sp, n in zip(prompts, params, names)]
    assert batch == solo
    for i, kind in ((0, "json"), (2, "choice"), (3, "regex")):
        _check(kind, engine.tokenizer.decode(batch[i]))
    assert len(set(map(tuple, batch))) == 5


@pytest.mark.parametrize("spec,problem", [
    (StructuredOutput("regex", "[a-"), "regex"),
    (StructuredOutput("json", '{"type": "nonsense"}'), "nonsense"),
    (StructuredOutput("json", "{not json"), "line 1 column 2"),
    (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
])
def test_a_spec_that_does_not_compile_is_refused(models, spec, problem):
    engine = build_engine(models["llama"], compile=False)
    with pytest.raises(GrammarError, match=problem):
        engine.grammars.compile(spec)
    with pytest.raises(GrammarError):  # and the engine refuses the request before admitting it
        engine.generate([[5, 6]], SamplingParams(max_new_tokens=4, structured_output=spec))


# --- the doors ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo model with a chat template, and one adapter."""
    server = chat_server(tmp_path_factory.mktemp("structured"), CHAT_TEMPLATE)
    yield server
    server.stop()


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    ok: bool
    n: int = pydantic.Field(ge=0, le=99)


def test_openai_sdk_response_format_and_parse(served, client):
    """chat.completions.parse with a pydantic model (response_format json_schema, strict), on base and adapter;
    json_object on completions; every answer parses."""
    for model in ("", "pirate"):
        done = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Who?"}],
                                             response_format=Person, max_tokens=200, temperature=1.0, seed=3)
        choice = done.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Person), choice
    out = client.completions.create(model="", prompt="Hi", max_tokens=200, seed=1,
                                    extra_body={"response_format": {"type": "json_object"}})
    if out.choices[0].finish_reason == "stop":  # (a random model may run out of tokens inside a long key)
        assert isinstance(json.loads(out.choices[0].text), dict)


def test_async_openai_client_parse(served):
    """The asyncio client: chat.completions.parse and a streamed constrained completion, several at once."""
    import asyncio

    async def main():
        async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{served.server.http_port}/v1", api_key="unused",
                                      max_retries=0, timeout=60) as sdk:
            async def parse(seed: int) -> Person:
                done = await sdk.chat.completions.parse(model="pirate", messages=[{"role": "user", "content": "?"}],
                                                        response_format=Person, max_tokens=200, temperature=1.0,
                                                        seed=seed)
                return done.choices[0].message.parsed

            async def stream() -> str:
                chunks = await sdk.completions.create(model="", prompt="Capital?", max_tokens=20, stream=True,
                                                      extra_body={"structured_outputs": {"choice": CITIES}})
                return "".join([c.choices[0].text async for c in chunks])

            return await asyncio.gather(parse(1), parse(2), stream())

    first, second, city = asyncio.run(main())
    assert isinstance(first, Person) and isinstance(second, Person) and city in CITIES


def test_vllm_structured_outputs_choice_regex_and_json(served, client):
    """vLLM's structured_outputs field, streamed and not: the guided_choice case that came back as free text."""
    for i in range(4):
        out = client.completions.create(model="pirate", prompt="Capital?", max_tokens=20, seed=i,
                                        extra_body={"structured_outputs": {"choice": CITIES}})
        assert out.choices[0].text in CITIES and out.choices[0].finish_reason == "stop"
    stream = client.completions.create(model="", prompt="Mail:", max_tokens=40, seed=5, stream=True,
                                       extra_body={"structured_outputs": {"regex": EMAIL}})
    assert re.fullmatch(EMAIL, "".join(c.choices[0].text for c in stream))
    out = client.completions.create(model="", prompt="JSON:", max_tokens=200, seed=2,
                                    extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


@pytest.mark.parametrize("extra,param,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "a JSON schema object is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "must be \"text\", \"json_object\""),
    ({"structured_outputs": {"choice": ["a"], "regex": "a"}}, "structured_outputs", "set exactly one of"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
])
def test_a_bad_constraint_is_a_400_naming_it(served, client, extra, param, message):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt="Hi", max_tokens=4, extra_body=extra)
    assert info.value.param == param and message in info.value.body["message"], info.value.body


def test_grpc_constraint(served):
    with served.client() as sdk:
        for i in range(3):
            done = sdk.complete("Capital?", adapter="pirate", choice=CITIES, temperature=1.0, seed=i)
            assert done.text in CITIES, done
        done = sdk.complete("JSON:", json_schema=PERSON, temperature=1.0, seed=4, max_new_tokens=200)
        jsonschema.validate(json.loads(done.text), PERSON)
        with pytest.raises(InvalidArgumentError) as info:
            sdk.complete("Hi", regex="[a-", max_new_tokens=4)
        assert [v.field for v in info.value.field_violations] == ["structured_output"]
        assert "does not compile" in info.value.field_violations[0].description


def test_lora_client_cli_flags(served, tmp_path, capsys):
    """lora-client generate --choice / --json-schema FILE, as pasted from the README."""
    from service.client.cli import main as client_main

    target = ["--target", served.target]
    assert client_main([*target, "generate", "Capital?", "--choice", "Paris", "--choice", "London",
                        "--temperature", "1", "--seed", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[0] in ("Paris", "London")
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert client_main([*target, "generate", "JSON:", "--json-schema", str(schema), "--max-new-tokens", "200"]) == 0
    jsonschema.validate(json.loads(capsys.readouterr().out.splitlines()[0]), PERSON)
    assert client_main([*target, "generate", "Hi", "--regex", "[a-", "--max-new-tokens", "4"]) == 1
    assert "structured_output: does not compile" in capsys.readouterr().err


def test_grpc_chat_renders_the_template_as_the_http_door(served, client):
    """GenerateRequest.chat: the same template rendering as /v1/chat/completions (greedy: the same tokens), a
    structured output on it too; without a template, FAILED_PRECONDITION naming what to do."""
    from service.client import FailedPreconditionError

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    http = client.chat.completions.create(model="pirate", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True})
    with served.client() as sdk:
        done = sdk.complete(messages, adapter="pirate", max_new_tokens=8, ignore_eos=True)
        assert done.token_ids == http.choices[0].model_extra["token_ids"] and done.text == http.choices[0].message.content
        assert sdk.complete(messages, choice=CITIES, temperature=1.0, seed=1).text in CITIES
    plain = ServerThread(shared_engine(), ServerConfig(port=0))  # the demo model: no chat template
    try:
        with plain.client() as sdk, pytest.raises(FailedPreconditionError, match="has no chat template"):
            sdk.complete(messages, max_new_tokens=2)
    finally:
        plain.stop()


def test_chat_template_flag(tmp_path):
    """--chat-template FILE gives a model without a template one (both doors); an unreadable one stops the start."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}assistant>")
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, chat_template=str(template)))
    try:
        with server.client() as sdk:
            done = sdk.complete([{"role": "user", "content": "Hi"}], max_new_tokens=3, ignore_eos=True)
        ids = shared_engine().tokenizer.encode("user> Hi\nassistant>", add_special_tokens=False)
        assert done.usage.prompt_tokens == len(ids)
    finally:
        server.stop()
    with pytest.raises(ValueError, match="--chat-template .*cannot be read"):
        ServerThread(shared_engine(), ServerConfig(port=0, chat_template=str(tmp_path / "missing.jinja")))
