"""Generate over loopback gRPC against the real engine: concurrent streams of the base model and the demo
adapters each get exactly what engine.generate gives that request alone; stops, logprobs, UTF-8."""
from __future__ import annotations

import asyncio

import pytest

from service.client import AsyncLoraServeClient
from service.runner.detokenizer import REPLACEMENT_CHAR
from tests.service_harness import ServerThread, shared_engine

PROMPTS = ["Once upon a time", "The river", "In the morning the sun", "People in the town",
           "héllo wörld ✓", "Some of them have travelled"]


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine())
    yield server
    server.stop()


def test_concurrent_streams_match_engine_generate_alone(served):
    """12 streams at once (base + 3 adapters with 2 device slots: admission waits for adapter slots)."""
    tok = served.engine.tokenizer
    cases = [(PROMPTS[i % len(PROMPTS)], adapter, 8 + 5 * i)
             for i, adapter in enumerate([None, "pirate", "poet", "scribe"] * 3)]
    expected = [served.reference(tok.encode(p), a, n, ignore_eos=True) for p, a, n in cases]

    async def run_all():
        async with AsyncLoraServeClient(served.target) as client:
            async def one(prompt, adapter, n):
                chunks = [c async for c in client.generate(prompt, adapter=adapter, max_new_tokens=n, ignore_eos=True)]
                return chunks
            return await asyncio.gather(*(one(*case) for case in cases))

    results = asyncio.run(run_all())
    for (prompt, adapter, n), chunks, want in zip(cases, results, expected, strict=True):
        got = [t for c in chunks for t in c.token_ids]
        assert got == want, f"{adapter or 'base'} / {prompt!r}"
        last = chunks[-1]
        assert last.finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
        assert last.usage.completion_tokens == n and last.usage.prompt_tokens == len(tok.encode(prompt))
        # Streamed text deltas are the decode of the tokens, never splitting a character.
        assert "".join(c.text for c in chunks) == tok.decode(got)
        assert not any(c.text.endswith(REPLACEMENT_CHAR) for c in chunks[:-1])
    served.wait_idle()


def test_token_ids_input_and_eos(served):
    """token_ids input is used as is; without ignore_eos an EOS ends the stream with its id, not its text."""
    tok = served.engine.tokenizer
    prompt_ids = tok.encode("The quick brown fox")
    want = served.reference(prompt_ids, None, 40)
    with served.client() as client:
        result = client.complete(prompt_ids, max_new_tokens=40)
    assert result.token_ids == want
    if want[-1] in tok.eos_token_ids and len(want) < 40:
        assert result.finish_reason == "eos"
        assert result.text == tok.decode(want[:-1])
    else:
        assert result.finish_reason == "length"


def test_stop_string_truncates_and_never_leaks(served):
    tok = served.engine.tokenizer
    prompt = "The quick brown fox"
    tokens = served.reference(tok.encode(prompt), None, 60, ignore_eos=True)
    full = tok.decode(tokens)
    # A stop string that starts inside the text and straddles token boundaries.
    start = next(i for i in range(8, len(full) - 3) if REPLACEMENT_CHAR not in full[i:i + 3])
    stop = full[start:start + 3]
    start = full.find(stop)  # the first occurrence is where generation must end
    with served.client() as client:
        chunks = list(client.generate(prompt, max_new_tokens=60, ignore_eos=True, stop=[stop, "never-in-text-§"]))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop == stop
    assert "".join(c.text for c in chunks) == full[:start]
    streamed = [t for c in chunks for t in c.token_ids]
    assert streamed == tokens[:len(streamed)]  # the tokens up to the one that completed the stop
    assert len(tok.decode(streamed)) >= start + len(stop)
    served.wait_idle()


def test_stop_token_id(served):
    tok = served.engine.tokenizer
    tokens = served.reference(tok.encode("The river"), None, 30, ignore_eos=True)
    stop_id = tokens[6]
    with served.client() as client:
        result = client.complete("The river", max_new_tokens=30, ignore_eos=True, stop_token_ids=[stop_id])
    cut = tokens.index(stop_id) + 1
    assert result.finish_reason == "stop" and result.stop_token_id == stop_id and result.stop is None
    assert result.token_ids == tokens[:cut]
    assert result.text == tok.decode(tokens[:cut - 1])


def test_logprobs_and_top_logprobs(served):
    with served.client() as client:
        chunks = list(client.generate("In the morning", max_new_tokens=10, ignore_eos=True,
                                      logprobs=True, top_logprobs=3))
    for c in chunks:
        assert len(c.logprobs) == len(c.token_ids) == len(c.top_logprobs)
        for token, logprob, top in zip(c.token_ids, c.logprobs, c.top_logprobs, strict=True):
            assert len(top) == 3 and top[0][0] == token  # greedy: the chosen token is the most likely
            assert logprob == pytest.approx(top[0][1], abs=1e-5) and logprob <= 0
            assert top[0][1] >= top[1][1] >= top[2][1]


def test_seeded_sampling_is_reproducible(served):
    params = dict(max_new_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    with served.client() as client:
        a = client.complete("Once upon a time", **params)
        b = client.complete("Once upon a time", **params)
        c = client.complete("Once upon a time", **(params | {"seed": 99}))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_request_id_is_echoed_or_made_up(served):
    with served.client() as client:
        named = list(client.generate("Hi", max_new_tokens=2, request_id="req-42"))
        anon = list(client.generate("Hi", max_new_tokens=2))
    assert {c.request_id for c in named} == {"req-42"}
    assert len({c.request_id for c in anon}) == 1 and anon[0].request_id


def test_tokenize_and_model_info(served):
    tok = served.engine.tokenizer
    with served.client() as client:
        assert client.tokenize("héllo") == tok.encode("héllo")
        assert client.tokenize("héllo", add_special_tokens=False) == tok.encode("héllo", add_special_tokens=False)
        info = client.model_info()
    assert info.model == served.engine.model_name and info.architecture == "LlamaForCausalLM"
    assert (info.max_seq_len, info.max_batch_size, info.max_loras_per_batch, info.max_lora_rank) == (256, 8, 2, 16)
    assert info.vocab_size == 512 and info.compiled is False and set(info.eos_token_ids) == set(tok.eos_token_ids)
