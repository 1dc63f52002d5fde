"""vLLM's and OpenAI's sampling fields over both doors, through real clients (the openai SDK, the gRPC stub, the
SDK): each honoured end to end (tokens against the engine's own greedy run, and against transformers with the
penalties applied by OpenAI's formula), or refused with its name. The engine's sampler itself is checked against
transformers' processors in tests/test_sampling_processors.py; here, that what a client sends reaches it through
either door."""
from __future__ import annotations

from collections import Counter

import grpc
import openai
import pytest
import torch

from service._proto import pb, pb_grpc
from service.client import InvalidArgumentError
from service.errors import InvalidArgument
from service.front.generate_params import GenerateParams
from service.front.prepare import validate
from service.grpc_api.params import GRPC_NAMES
from service.http_api.openai_params import COMPLETION_NAMES, NOT_HONOURED, REMOVED_GUIDED_FIELDS, generate_params
from service.http_api.protocol import ChatCompletionRequest, CompletionRequest
from service.limits import RequestLimits
from service.runner.request import ModelInfo
from service.server import ServerConfig
from tests.checkpoints import load_reference
from tests.http_wire import post
from tests.service_harness import ServerThread, demo_paths, make_request, shared_engine

PROMPT = "Once upon a time"
N = 12


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def prompt_ids(served) -> list[int]:
    return served.engine.tokenizer.encode(PROMPT)


@pytest.fixture(scope="module")
def greedy(served, prompt_ids) -> list[int]:
    """The engine's greedy tokens for the prompt, alone (engine.generate)."""
    tokens = served.reference(prompt_ids, None, N, ignore_eos=True)
    assert len(set(tokens)) > N // 2, tokens  # a lively reference, not one token repeated
    return tokens


def _http(client, prompt_ids, max_tokens: int = N, temperature: float = 0.0, **extra):
    """One completion's choice, with its token ids; vLLM's fields go in extra_body, as the SDK sends them."""
    return client.completions.create(model="", prompt=prompt_ids, max_tokens=max_tokens, temperature=temperature,
                                     extra_body={"ignore_eos": True, "return_token_ids": True, **extra}).choices[0]


def _grpc(served, prompt_ids, max_tokens: int = N, **fields) -> list[pb.GenerateResponse]:
    request = make_request(None, token_ids__ids=prompt_ids, stopping__max_new_tokens=max_tokens,
                           stopping__ignore_eos=True, **{k: v for k, v in fields.items() if k != "logit_bias"})
    request.sampling.logit_bias.update(fields.get("logit_bias", {}))
    with grpc.insecure_channel(served.target) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))


def _tokens(messages: list[pb.GenerateResponse]) -> list[int]:
    return [t for m in messages for t in m.token_ids]


# --- honoured ----------------------------------------------------------------------------------------------
def test_stop_token_ids_stop_on_both_doors(served, client, prompt_ids, greedy):
    """vLLM's extra field was ignored on HTTP; now, as over gRPC, the id ends generation (finish_reason stop,
    stop_reason the id; the id is the last token, its text is not sent)."""
    k = next(i for i in range(2, N) if greedy[i] not in greedy[:i])  # a token the greedy run first makes at k
    stop = greedy[k]
    choice = _http(client, prompt_ids, stop_token_ids=[stop])
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", stop)
    assert choice.model_extra["token_ids"] == greedy[:k + 1]
    over_grpc = _grpc(served, prompt_ids, stopping__stop_token_ids=[stop])
    assert _tokens(over_grpc) == greedy[:k + 1]
    assert (over_grpc[-1].finish_reason, over_grpc[-1].stop_token_id) == (pb.FINISH_REASON_STOP, stop)
    assert choice.text == "".join(m.text for m in over_grpc)
    served.wait_idle()


def test_logit_bias_forces_and_bans_tokens(served, client, prompt_ids, greedy):
    """+100 makes a token the argmax at every step; -100 on the greedy first token leaves the second most likely
    one (read from the unbiased run's raw top-2). Keys are OpenAI's token-id strings on HTTP, a map on gRPC."""
    forced = next(t for t in range(100, 512) if t not in greedy)
    assert _http(client, prompt_ids, logit_bias={str(forced): 100}).model_extra["token_ids"] == [forced] * N
    assert _tokens(_grpc(served, prompt_ids, logit_bias={forced: 100.0})) == [forced] * N
    first = _grpc(served, prompt_ids, max_tokens=1, response__logprobs=True, response__top_logprobs=2)[0]
    top2 = first.top_logprobs[0].token_ids
    assert top2[0] == greedy[0]
    banned = _http(client, prompt_ids, max_tokens=1, logit_bias={str(greedy[0]): -100}).model_extra["token_ids"]
    assert banned == [top2[1]]
    assert _tokens(_grpc(served, prompt_ids, max_tokens=1, logit_bias={greedy[0]: -100.0})) == [top2[1]]
    served.wait_idle()


# A prompt whose greedy run repeats a token within PENALTY_TOKENS (so positive penalties change it too), and the
# (presence, frequency) pairs tried on it.
PENALTY_PROMPT, PENALTY_TOKENS = "In the beginning there was", 24
PENALTIES = {"none": (0.0, 0.0), "discouraged": (1.5, 0.5), "encouraged": (-2.0, -1.0)}


@pytest.fixture(scope="module")
def penalised(served) -> dict[str, list[int]]:
    """transformers' logits, with OpenAI's penalties on the generated tokens (logit - count x frequency -
    (count > 0) x presence), then the argmax: the tokens each PENALTIES entry must give."""
    model, out = load_reference(demo_paths()[0]), {}
    prompt = served.engine.tokenizer.encode(PENALTY_PROMPT)
    for name, (presence, frequency) in PENALTIES.items():
        seq, counts = list(prompt), Counter()
        for _ in range(PENALTY_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([seq])).logits[0, -1]
            for token, count in counts.items():
                logits[token] -= count * frequency + presence
            seq.append(int(logits.argmax()))
            counts[seq[-1]] += 1
        out[name] = seq[len(prompt):]
    return out


def _repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def test_presence_and_frequency_penalties_follow_openais_formula(served, client, penalised):
    """Positive penalties remove the greedy run's repeat, negative ones make repeats; either door gives exactly
    the tokens of OpenAI's formula on transformers' logits."""
    prompt = served.engine.tokenizer.encode(PENALTY_PROMPT)
    plain = penalised["none"]
    assert plain == served.reference(prompt, None, PENALTY_TOKENS, ignore_eos=True) and _repeats(plain) > 0
    assert penalised["discouraged"] != plain and _repeats(penalised["discouraged"]) < _repeats(plain)
    assert penalised["encouraged"] != plain and _repeats(penalised["encouraged"]) > _repeats(plain)
    for name in ("discouraged", "encouraged"):
        presence, frequency = PENALTIES[name]
        choice = _http(client, prompt, PENALTY_TOKENS, presence_penalty=presence, frequency_penalty=frequency)
        assert choice.model_extra["token_ids"] == penalised[name], name
        assert _tokens(_grpc(served, prompt, PENALTY_TOKENS, sampling__presence_penalty=presence,
                             sampling__frequency_penalty=frequency)) == penalised[name], name
    served.wait_idle()


def test_min_p_one_keeps_only_the_top_token(served, client, prompt_ids, greedy):
    """min_p = 1 drops every token less likely than the top one: sampling at temperature 1 gives the greedy
    tokens, where the same seed without min_p does not."""
    sampled = _http(client, prompt_ids, temperature=1.0, seed=3).model_extra["token_ids"]
    assert sampled != greedy
    assert _http(client, prompt_ids, temperature=1.0, seed=3, min_p=1.0).model_extra["token_ids"] == greedy
    assert _tokens(_grpc(served, prompt_ids, sampling__temperature=1.0, sampling__seed=3,
                         sampling__min_p=1.0)) == greedy
    served.wait_idle()


def test_add_special_tokens_and_request_id(client, prompt_ids):
    """vLLM's add_special_tokens: false tokenizes a text prompt without BOS; request_id names the response."""
    with_bos = client.completions.create(model="", prompt=PROMPT, max_tokens=1)
    without = client.completions.create(model="", prompt=PROMPT, max_tokens=1,
                                        extra_body={"add_special_tokens": False, "request_id": "mine"})
    assert with_bos.usage.prompt_tokens == len(prompt_ids) == without.usage.prompt_tokens + 1
    assert without.id == "cmpl-mine"


def test_the_sdk_sends_the_new_fields(served, prompt_ids, greedy, penalised):
    forced = next(t for t in range(100, 512) if t not in greedy)
    with served.client() as sdk:
        assert sdk.complete(prompt_ids, max_new_tokens=N, ignore_eos=True, logit_bias={forced: 100.0}).token_ids \
            == [forced] * N
        assert sdk.complete(prompt_ids, max_new_tokens=N, ignore_eos=True, temperature=1.0, seed=3,
                            min_p=1.0).token_ids == greedy
        penalty_prompt = served.engine.tokenizer.encode(PENALTY_PROMPT)
        assert sdk.complete(penalty_prompt, max_new_tokens=PENALTY_TOKENS, ignore_eos=True, presence_penalty=1.5,
                            frequency_penalty=0.5).token_ids == penalised["discouraged"]
        stopped = sdk.complete(prompt_ids, max_new_tokens=N, ignore_eos=True, stop_token_ids=[greedy[3]])
        assert stopped.stop_token_id == greedy[3] and stopped.token_ids[-1] == greedy[3]
        with pytest.raises(InvalidArgumentError) as info:
            sdk.complete(prompt_ids, n=0, min_p=2.0, logit_bias={600: 1.0}, prompt_logprobs=21)
        assert {v.field for v in info.value.field_violations} == {
            "sampling.n", "sampling.min_p", "sampling.logit_bias", "response.prompt_logprobs"}
        with pytest.raises(ValueError, match="complete_choices"):
            sdk.complete(prompt_ids, n=2)


# --- refused, by name ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra,param", [
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"guided_regex": "[a-z]+"}, "guided_regex"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop_token_ids": [7, 9999]}, "stop_token_ids[1]"),
    ({"n": 100}, "n"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_the_openai_sdk_gets_a_400_naming_the_field(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="", prompt=PROMPT, max_tokens=2, extra_body=extra)
    assert info.value.param == param and info.value.body["message"].startswith(f"{param}: "), info.value.body


# A value other than the neutral one, for each field lora-serve does not honour.
NON_NEUTRAL = {
    "use_beam_search": True, "length_penalty": 0.5, "include_stop_str_in_output": True, "min_tokens": 2,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 4,
    "allowed_token_ids": [5, 6], "bad_words": ["x"], "logprob_token_ids": [5], "watermarking": True,
    "priority": 1, "cache_salt": "salt", "kv_transfer_params": {"a": 1},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "repetition_detection": {"max_pattern_size": 3},
    "thinking_token_budget": 10, "stream_interval": 4, "return_tokens_as_token_ids": True, "suffix": "end",
    "prompt_embeds": "AAAA",
    "reasoning_effort": "low", "continue_final_message": True, "chat_template": "{{ messages }}",
    "media_io_kwargs": {"image": {}}, "mm_processor_kwargs": {"a": 1}, "return_prompt_text": True,
}
CHAT_ONLY = {"reasoning_effort", "continue_final_message", "chat_template", "media_io_kwargs",
             "mm_processor_kwargs", "return_prompt_text"}


def test_every_field_not_honoured_is_refused_by_name(served):
    """Each one set alone: a 400 naming it (before any work: the demo model has no chat template, and the chat
    fields are refused before it is needed). At its neutral value, it is accepted."""
    assert set(NON_NEUTRAL) == set(NOT_HONOURED)
    port = served.server.http_port
    for name, value in NON_NEUTRAL.items():
        path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}) if name in CHAT_ONLY
                      else ("/v1/completions", {"prompt": "Hi", "max_tokens": 1}))
        status, reply, _ = post(port, path, body | {name: value})
        assert (status, reply["error"]["param"]) == (400, name), (name, reply)
    neutral = {"use_beam_search": False, "length_penalty": 1, "min_tokens": 0, "skip_special_tokens": True,
               "priority": 0, "stream_interval": 1, "bad_words": [], "allowed_token_ids": None, "guided_json": None,
               "truncation_side": "left", "session_id": "s", "tool_choice": "none"}
    status, reply, _ = post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 1} | neutral)
    assert status == 200, reply


# vLLM 0.32's request fields (vllm/entrypoints/openai/{completion,chat_completion}/protocol.py).
VLLM_COMPLETION_FIELDS = """model prompt echo frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed
stop stream stream_options suffix temperature top_p user use_beam_search top_k min_p repetition_penalty watermarking
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens truncation_side allowed_token_ids prompt_logprobs
logprob_token_ids bad_words prompt_embeds add_special_tokens response_format structured_outputs priority request_id
session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets mm_payload
return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs repetition_detection
thinking_token_budget stream_interval""".split()
VLLM_CHAT_FIELDS = """messages model frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens
n presence_penalty response_format seed stop stream stream_options temperature top_p tools tool_choice
reasoning_effort thinking_token_budget include_reasoning parallel_tool_calls user use_beam_search top_k min_p
repetition_penalty watermarking length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens
skip_special_tokens spaces_between_special_tokens truncate_prompt_tokens truncation_side prompt_logprobs
logprob_token_ids allowed_token_ids bad_words echo add_generation_prompt continue_final_message add_special_tokens
documents chat_template chat_template_kwargs media_io_kwargs mm_processor_kwargs structured_outputs priority
request_id session_id return_tokens_as_token_ids return_token_ids routed_experts_prompt_start return_token_offsets
return_prompt_text mm_payload return_mm_kwargs cache_salt kv_transfer_params ec_transfer_params vllm_xargs
repetition_detection stream_interval""".split()
RENDER_ONLY = {"return_token_offsets", "mm_payload", "return_mm_kwargs"}  # vLLM ignores them on generation too


def test_every_vllm_field_is_declared():
    """None is dropped as unknown: each is honoured or refused (or, render-only, ignored as vLLM does)."""
    for model, fields in ((CompletionRequest, VLLM_COMPLETION_FIELDS), (ChatCompletionRequest, VLLM_CHAT_FIELDS)):
        assert set(fields) - set(model.model_fields) == RENDER_ONLY, model.__name__
    assert set(REMOVED_GUIDED_FIELDS) <= set(CompletionRequest.model_fields)


# --- one prepare, two vocabularies ------------------------------------------------------------------------
def test_prepare_names_fields_in_each_doors_vocabulary():
    """The same mistakes, named as a gRPC client and as an OpenAI client names them; a valid call carries every
    new field into the runner's request (n for the fan-out, prompt_logprobs for echo)."""
    info = ModelInfo(model="m", architecture="LlamaForCausalLM", vocab_size=512, max_seq_len=256, max_num_seqs=8,
                     max_loras_per_batch=2, max_lora_rank=16, dtype="float32", device="cpu", compiled=False,
                     eos_token_ids=(2,), max_token_chars=8)
    wrong = dict(text="Hi", min_p=2.0, n=0, logit_bias={600: 1.0}, stop=["", "x"], max_new_tokens=0,
                 prompt_logprobs=30)
    names = {}
    for door, vocabulary in (("grpc", GRPC_NAMES), ("openai", COMPLETION_NAMES)):
        with pytest.raises(InvalidArgument) as refused:
            validate(GenerateParams(names=vocabulary, **wrong), [1, 5], RequestLimits(), info)
        names[door] = {v.field for v in refused.value.violations}
    assert names["grpc"] == {"sampling.min_p", "stopping.max_new_tokens", "stopping.stop[0]", "sampling.n",
                                 "sampling.logit_bias", "response.prompt_logprobs"}
    assert names["openai"] == {"min_p", "max_tokens", "stop[0]", "n", "logit_bias", "prompt_logprobs"}
    body = CompletionRequest.model_validate({"prompt": "Hi", "n": 3, "echo": True, "logprobs": 2, "min_p": 0.1,
                                             "presence_penalty": 0.5, "frequency_penalty": -0.5,
                                             "logit_bias": {"7": -3}, "stop_token_ids": [9]})
    req = validate(generate_params(body, "", "r", text="Hi"), [1, 5], RequestLimits(), info)
    s = req.sampling
    assert (req.n, s.prompt_logprobs, s.top_logprobs, s.min_p, s.presence_penalty, s.frequency_penalty,
            s.logit_bias, s.stop_token_ids) == (3, 2, 2, 0.1, 0.5, -0.5, ((7, -3.0),), (9,))
