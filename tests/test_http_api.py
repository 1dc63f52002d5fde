"""The OpenAI-compatible HTTP door, driven by the official `openai` client (and raw HTTP for bad input) against
a real server over loopback: the same tokens as the gRPC door, the same batch, the same limits and errors."""
from __future__ import annotations

import http.client
import json
import threading

import grpc
import openai
import pytest

from service._proto import pb, pb_grpc
from service.limits import RequestLimits
from service.runner.observer_group import ObserverGroup
from service.server import ServerConfig
from tests.http_wire import metric_value, metrics, post
from tests.service_harness import (
    ServerThread,
    chat_server,
    make_request,
    openai_client,
    shared_engine,
    wait_for,
)

PROMPT = "Once upon a time"
LIMITS = RequestLimits(max_prompt_tokens=200, max_new_tokens=220)
# Roles on lines, as many small chat models do; unknown roles are refused through raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, grace_period_s=10.0, limits=LIMITS))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def chat_served(tmp_path_factory):
    """A copy of the demo model with a chat template (the demo model has none)."""
    server = chat_server(tmp_path_factory.mktemp("chat-model"), CHAT_TEMPLATE)
    yield server
    server.stop()


def _grpc_stream(server: ServerThread, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(server.target) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))


# --- the happy paths ---------------------------------------------------------------------------------------
def test_models_lists_the_base_and_every_adapter(served, client):
    models = {m.id: m for m in client.models.list().data}
    base = shared_engine().model_name
    assert set(models) == {base, "pirate", "poet", "scribe"}
    assert models[base].parent is None  # (extra fields are kept by the client's models)
    assert {models[a].parent for a in ("pirate", "poet", "scribe")} == {base}


@pytest.mark.parametrize("adapter", [None, "pirate"])
def test_greedy_completion_equals_the_grpc_stream(served, client, adapter):
    ids = served.engine.tokenizer.encode(PROMPT)
    grpc_out = _grpc_stream(served, make_request(None, token_ids__ids=ids, adapter=adapter or "",
                                                 stopping__max_new_tokens=12, stopping__ignore_eos=True,
                                                 response__logprobs=True))
    grpc_ids = [t for m in grpc_out for t in m.token_ids]
    assert grpc_ids == served.reference(ids, adapter, 12, ignore_eos=True)
    http = client.completions.create(model=adapter or shared_engine().model_name, prompt=ids, max_tokens=12,
                                     temperature=0, logprobs=0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = http.choices[0]
    assert choice.model_extra["token_ids"] == grpc_ids
    assert choice.text == "".join(m.text for m in grpc_out)
    assert len(choice.logprobs.tokens) == len(grpc_ids)  # the same tokens, one by one (their texts: test_http_choices)
    assert choice.logprobs.token_logprobs == pytest.approx([lp for m in grpc_out for lp in m.logprobs])
    assert choice.finish_reason == "length"
    assert (http.usage.prompt_tokens, http.usage.completion_tokens) == (len(ids), 12)
    # A text prompt is tokenized as the gRPC door tokenizes it: the same answer.
    again = client.completions.create(model=adapter or "", prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == choice.text
    served.wait_idle()


def test_streaming_completion_ends_with_done_and_usage(served, client):
    whole = client.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, model="poet",
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, model="poet", stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    finished = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finished == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10  # the usage chunk comes last
    status, body, headers = post(served.server.http_port, "/v1/completions", json.dumps(
        {"prompt": PROMPT, "max_tokens": 3, "stream": True}).encode())
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert body["raw"].rstrip().endswith("data: [DONE]")


def test_sampling_fields_reach_the_engine(served, client):
    """seed: the same seed, the same tokens; stop: the text ends before the stop string, stop_reason says it."""
    kwargs = dict(model="", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                  extra_body={"top_k": 20, "repetition_penalty": 1.1, "ignore_eos": True})
    first, second = (client.completions.create(**kwargs).choices[0].text for _ in range(2))
    assert first == second
    greedy = client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    stop = greedy[4:6]
    assert stop and stop not in greedy[:4]
    stopped = client.completions.create(model="", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop, "zzz"])
    assert stopped.choices[0].text == greedy[:greedy.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.model_extra is not None and stopped.choices[0].model_extra["stop_reason"] == stop


# --- chat -----------------------------------------------------------------------------------------------------
def test_chat_uses_the_models_template_as_transformers_renders_it(chat_served):
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story"}]
    model_dir = chat_served.engine.config.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    expected = chat_served.reference(ids, "pirate", 8, ignore_eos=True)
    with openai_client(chat_served) as c:
        reply = c.chat.completions.create(model="pirate", messages=messages, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        assert reply.usage.prompt_tokens == len(ids)
        content = reply.choices[0].logprobs.content
        # Each token as transformers decodes it alone (" mate", not the piece "Ġmate"); part of a character is
        # OpenAI's "bytes:\x..", and the bytes of every token, concatenated, are the reply's text.
        for entry, token_id in zip(content, expected, strict=True):
            text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            assert entry.token == text if "\ufffd" not in text else entry.token.startswith("bytes:")
        text_bytes = bytes(b for t in content for b in t.bytes or [])  # (a special token has none)
        assert text_bytes.decode("utf-8", "replace") == reply.choices[0].message.content
        assert all(len(t.top_logprobs) == 2 for t in content)
        assert reply.choices[0].message.role == "assistant"
        stream = list(c.chat.completions.create(model="pirate", messages=messages, max_tokens=8, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(s.choices[0].delta.content or "" for s in stream) == reply.choices[0].message.content
        # The role comes with the first token (vLLM's first chunk), so a client timing its first chunk times it.
        one = c.chat.completions.create(model="pirate", messages=messages, max_tokens=1, temperature=0,
                                        extra_body={"ignore_eos": True})
        (chunk,) = c.chat.completions.create(model="pirate", messages=messages, max_tokens=1, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True})
        assert chunk.choices[0].delta.role == "assistant" and chunk.choices[0].finish_reason == "length"
        assert chunk.choices[0].delta.content == one.choices[0].message.content
        assert stream[0].choices[0].delta.role == "assistant"
        firsts = {}  # n = 2: each choice's first chunk carries the role
        for s in c.chat.completions.create(model="pirate", messages=messages, max_tokens=3, n=2, seed=1,
                                           stream=True):
            firsts.setdefault(s.choices[0].index, s.choices[0].delta)
        assert sorted(firsts) == [0, 1] and all(d.role == "assistant" for d in firsts.values())
        with pytest.raises(openai.BadRequestError) as info:  # the template's own refusal
            c.chat.completions.create(model="pirate", messages=[{"role": "wizard", "content": "hi"}])
        assert "unknown role wizard" in info.value.message
    chat_served.wait_idle()


def test_chat_without_a_template_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="", messages=[{"role": "user", "content": "hi"}])
    assert "has no chat template" in info.value.message


# --- one batch, two doors -----------------------------------------------------------------------------------
class _StepRecorder:
    """Records the request ids of every engine step (an observer beside the server's own)."""

    def __init__(self):
        self.steps: list[set[str]] = []

    def on_added(self, state):
        pass

    def on_iteration(self, result):
        if result.step is not None:
            self.steps.append({s.request.request_id for s in result.stepped})

    def on_finished(self, state):
        pass


def test_http_and_grpc_requests_share_engine_steps(served, client):
    runner = served.server.runner
    recorder = _StepRecorder()
    own = runner.observer
    runner.observer = ObserverGroup([own, recorder])
    try:
        grpc_done = threading.Event()

        def grpc_side():
            _grpc_stream(served, make_request(PROMPT, request_id="from-grpc", stopping__max_new_tokens=40,
                                              stopping__ignore_eos=True))
            grpc_done.set()

        thread = threading.Thread(target=grpc_side)
        thread.start()
        wait_for(lambda: any("from-grpc" in s for s in recorder.steps), what="the gRPC request's first step")
        http = client.completions.create(model="", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True},
                                         extra_headers={"x-request-id": "from-http"})
        thread.join(60)
        assert http.id == "from-http" and grpc_done.is_set()
    finally:
        runner.observer = own
    shared = [s for s in recorder.steps if {"from-grpc", "from-http"} <= s]
    assert shared, recorder.steps  # the HTTP request ran in steps of the gRPC one
    served.wait_idle()


def test_client_disconnect_mid_stream_frees_the_slot(served, client):
    runner = served.server.runner
    cancelled = metric_value(_metrics(served), "lora_serve:request_success_total", finished_reason="cancelled")
    stream = client.completions.create(model="", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert runner.num_running == 1
    stream.close()  # closes the connection
    served.wait_idle()
    wait_for(lambda: runner.num_open_streams == 0, what="the stream's handler to end")
    # Ended by the disconnect, not by its 200 tokens:
    assert metric_value(_metrics(served), "lora_serve:request_success_total", finished_reason="cancelled") == cancelled + 1
    assert client.completions.create(model="", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_client_disconnect_while_waiting_for_a_whole_answer_frees_the_slot(served):
    """Not streaming: the client closes its connection before the answer; the request leaves the batch."""
    runner = served.server.runner
    cancelled = metric_value(_metrics(served), "lora_serve:request_success_total", finished_reason="cancelled")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", served.server.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
    wait_for(lambda: runner.num_running == 1, what="the request to run")
    conn.close()
    served.wait_idle()
    wait_for(lambda: runner.num_open_streams == 0, what="the handler to end")
    assert runner.engine.kv_cache.num_free_blocks == runner.engine.kv_cache.num_blocks
    # Ended by the disconnect, not by its 200 tokens:
    assert metric_value(_metrics(served), "lora_serve:request_success_total", finished_reason="cancelled") == cancelled + 1


# --- /metrics -------------------------------------------------------------------------------------------------
def _metrics(server: ServerThread) -> dict[str, list]:
    return metrics(server.server.http_port)


def test_metrics_reflect_a_known_load(served):
    """8 requests on `pirate` fill the batch (running), 2 on `poet` wait; the gauges and the LoRA info say so;
    when they end, the counters have counted them."""
    before = _metrics(served)
    batch = served.engine.config.max_batch_size
    runner = served.server.runner
    channel = grpc.insecure_channel(served.target)
    stub = pb_grpc.GenerationStub(channel)
    calls = []  # (a unary-stream call starts when made)
    for i in range(batch + 2):
        calls.append(stub.Generate(make_request(PROMPT, adapter="pirate" if i < batch else "poet",
                                                stopping__max_new_tokens=200, stopping__ignore_eos=True)))
        if i == batch - 1:
            wait_for(lambda: runner.num_running == batch, what="a full batch")
    wait_for(lambda: runner.num_waiting == 2, what="two waiting requests")
    families = _metrics(served)
    assert metric_value(families, "lora_serve:num_requests_running") == batch
    assert metric_value(families, "lora_serve:num_requests_waiting") == 2
    assert 0 < metric_value(families, "lora_serve:kv_cache_usage_perc") <= 1
    (info,) = families["lora_serve:lora_requests_info"]
    assert info.labels == {"max_lora": str(served.engine.config.max_loras_per_batch),
                           "running_lora_adapters": "pirate", "waiting_lora_adapters": "poet"}
    assert metric_value(families, "lora_serve:lora_adapter_resident", adapter="pirate", tier="device") == 1
    for call in calls:
        call.cancel()
    channel.close()
    served.wait_idle()
    wait_for(lambda: runner.num_open_streams == 0, what="every stream to close")
    after = _metrics(served)
    assert metric_value(after, "lora_serve:num_requests_running") == metric_value(after, "lora_serve:num_requests_waiting") == 0
    assert metric_value(after, "lora_serve:request_success_total", finished_reason="cancelled") - metric_value(
        before, "lora_serve:request_success_total", finished_reason="cancelled") == batch + 2
    assert metric_value(after, "lora_serve:prompt_tokens_total") > metric_value(before, "lora_serve:prompt_tokens_total")
    assert (metric_value(after, "lora_serve:time_to_first_token_seconds_count")
            - metric_value(before, "lora_serve:time_to_first_token_seconds_count")) == batch
    (info,) = after["lora_serve:lora_requests_info"]
    assert info.labels["running_lora_adapters"] == info.labels["waiting_lora_adapters"] == ""
