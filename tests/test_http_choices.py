"""Several choices per call on both doors, against a real server: n (choice i of a seeded request is the lone request
seeded seed + i; a prompt's choices share its prefill through the prefix cache; cancelling the call frees every
choice), prompt lists on /v1/completions (one choice per prompt x n), echo with the prompt's logprobs, and the
logprobs' token texts and text offsets. HTTP through the openai client."""
from __future__ import annotations

import itertools
import random

import grpc
import openai
import pytest

from lora_serve_demo import BOS_TOKEN, EOS_TOKEN
from service._proto import pb, pb_grpc
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.http_wire import post
from tests.service_harness import ServerThread, make_request, shared_engine, wait_for

PROMPT = "Once upon a time"
# With the engine's 8 sequences: 10 choices in flight at most; one call may take them all (its share: whole), so
# the queue's accounting of choices shows alone (the share: tests/test_fair_share.py).
LIMITS = RequestLimits(max_queue=2, max_request_share=1.0)


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, http_port=0, grace_period_s=10.0, limits=LIMITS))
    yield server
    server.stop()


def _unique_ids(served: ServerThread, seed: int, blocks: int = 2) -> list[int]:
    """Token ids no other test sends: `blocks` full KV blocks and 3 tokens."""
    rng = random.Random(seed)
    vocab = served.server.runner.model_info().vocab_size
    return [rng.randrange(3, vocab) for _ in range(blocks * served.engine.kv_cache.block_size + 3)]


def _grpc_stream(served: ServerThread, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(served.target) as channel:
        return list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))


def _check_offsets(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each token's text sits at its offset in the text; a special token and part of a character take no room."""
    assert offsets == sorted(offsets)
    for token, offset in zip(tokens, offsets):
        if token not in (BOS_TOKEN, EOS_TOKEN) and not token.startswith("bytes:"):
            assert text[offset:offset + len(token)] == token, (token, offset, text)
    if not any(t.startswith("bytes:") or t in (BOS_TOKEN, EOS_TOKEN) for t in tokens):  # cumulative lengths
        assert offsets == list(itertools.accumulate([offsets[0]] + [len(t) for t in tokens[:-1]]))


# --- n ----------------------------------------------------------------------------------------------------------
def test_choice_i_is_the_lone_request_seeded_seed_plus_i(served, client):
    ids = _unique_ids(served, seed=31)
    kwargs = dict(model="", prompt=ids, max_tokens=6, temperature=0.9, extra_body={"ignore_eos": True,
                                                                                 "return_token_ids": True})
    many = client.completions.create(n=3, seed=5, **kwargs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    lone = [client.completions.create(seed=5 + i, **kwargs).choices[0] for i in range(3)]
    tokens = [c.model_extra["token_ids"] for c in many.choices]
    assert tokens == [c.model_extra["token_ids"] for c in lone]
    assert [c.text for c in many.choices] == [c.text for c in lone]
    assert len(set(map(tuple, tokens))) > 1  # other seeds, other tokens
    assert (many.usage.prompt_tokens, many.usage.completion_tokens) == (len(ids), 18)  # the prompt counted once
    greedy = client.completions.create(model="", prompt=ids, n=3, max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    expected = served.reference(ids, None, 6, ignore_eos=True)
    assert [c.model_extra["token_ids"] for c in greedy.choices] == [expected] * 3
    served.wait_idle()


def test_grpc_choices_stream_with_their_index_and_share_the_prefill(served):
    ids = _unique_ids(served, seed=32, blocks=3)
    fields = dict(token_ids__ids=ids, sampling__temperature=0.8, stopping__max_new_tokens=5, stopping__ignore_eos=True)
    messages = _grpc_stream(served, make_request(None, sampling__n=2, sampling__seed=3, **fields))
    assert {m.index for m in messages} == {0, 1}
    choices = [[m for m in messages if m.index == i] for i in (0, 1)]
    for own in choices:  # each choice ends with its own last message
        assert [m.finish_reason != pb.FINISH_REASON_UNSPECIFIED for m in own] == [False] * (len(own) - 1) + [True]
        assert own[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert own[-1].usage.completion_tokens == sum(len(m.token_ids) for m in own) == 5
    # Choice 0 computed the prompt; choice 1 read its full blocks from the prefix cache.
    block = served.engine.kv_cache.block_size
    assert choices[0][-1].usage.cached_tokens == 0
    assert choices[1][-1].usage.cached_tokens == (len(ids) - 1) // block * block > 0
    lone = _grpc_stream(served, make_request(None, sampling__seed=4, **fields))
    assert [t for m in choices[1] for t in m.token_ids] == [t for m in lone for t in m.token_ids]
    served.wait_idle()


def test_each_choice_counts_against_the_queue_and_cancelling_frees_them_all(served, client):
    runner = served.server.runner
    batch = served.engine.config.max_num_seqs
    stream = client.completions.create(model="", prompt=_unique_ids(served, seed=33), n=batch, max_tokens=200,
                                       temperature=0.7, stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    wait_for(lambda: runner.num_running == batch, what="every choice to run")
    with pytest.raises(openai.RateLimitError) as info:  # 3 more choices, 2 places left in the queue
        client.completions.create(model="", prompt=PROMPT, n=3, max_tokens=1)
    assert "the 3 choices of this request need 3 places, 2 are left" in info.value.message
    stream.close()
    served.wait_idle()  # every KV block and adapter slot back
    wait_for(lambda: runner.num_open_streams == 0, what="the call's streams to close")
    assert runner.stats().kv_cache_usage == 0


# --- prompt lists -----------------------------------------------------------------------------------------------
def test_a_prompt_list_gives_n_choices_per_prompt(served, client):
    prompts = [PROMPT, "The river"]
    kwargs = dict(model="", max_tokens=5, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    answer = client.completions.create(prompt=prompts, n=2, **kwargs)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]  # prompt_index * n + i
    encoded = [served.engine.tokenizer.encode(p) for p in prompts]
    for p, ids in enumerate(encoded):
        expected = served.reference(ids, None, 5, ignore_eos=True)
        assert [c.model_extra["token_ids"] for c in answer.choices[2 * p:2 * p + 2]] == [expected] * 2
    assert answer.usage.prompt_tokens == sum(map(len, encoded)) and answer.usage.completion_tokens == 20
    by_ids = client.completions.create(prompt=encoded, **kwargs)  # a list of token-id lists
    assert [c.text for c in by_ids.choices] == [answer.choices[0].text, answer.choices[2].text]
    chunks = list(client.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True},
                                            **kwargs))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert texts == [c.text for c in answer.choices]
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == answer.usage.prompt_tokens
    # Each prompt is checked on its own, and a refusal names it.
    vocab = served.server.runner.model_info().vocab_size
    status, body, _ = post(served.server.http_port, "/v1/completions",
                           {"prompt": [encoded[0], [vocab + 1]], "max_tokens": 2})
    assert status == 400 and body["error"]["param"] == "prompt[1][0]", body
    served.wait_idle()


# --- echo and logprobs --------------------------------------------------------------------------------------------
def test_echo_returns_the_prompt_and_its_logprobs(served, client):
    tokenizer = served.engine.tokenizer
    ids = tokenizer.encode(PROMPT)
    kwargs = dict(model="", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                  extra_body={"ignore_eos": True, "return_token_ids": True})
    plain = client.completions.create(**kwargs).choices[0]
    # Tokens are their decoded text ("Ġmate" is " mate"), at their offset in the text.
    generated = plain.model_extra["token_ids"]
    for token, token_id in zip(plain.logprobs.tokens, generated):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        assert token == text if "\ufffd" not in text else token.startswith("bytes:")
    assert plain.logprobs.text_offset[0] == 0
    _check_offsets(plain.text, plain.logprobs.tokens, plain.logprobs.text_offset)

    echoed = client.completions.create(echo=True, **kwargs).choices[0]
    assert echoed.text == PROMPT + plain.text
    lp, n = echoed.logprobs, len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 4
    assert lp.tokens[0] == BOS_TOKEN and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs)
    assert lp.text_offset[n:] == [o + len(PROMPT) for o in plain.logprobs.text_offset]
    _check_offsets(echoed.text, lp.tokens, lp.text_offset)
    # Streamed as vLLM streams it: the prompt, its tokens and offsets come with the first chunk.
    chunks = [c.choices[0] for c in client.completions.create(echo=True, stream=True, **kwargs)]
    assert chunks[0].text.startswith(PROMPT) and "".join(c.text for c in chunks) == echoed.text
    assert [t for c in chunks for t in c.logprobs.tokens] == lp.tokens
    assert [o for c in chunks for o in c.logprobs.text_offset] == lp.text_offset
    served.wait_idle()
