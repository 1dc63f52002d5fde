"""Sampling: seeded draws independent of batch-mates, filters, repetition penalty as transformers, stops."""
from __future__ import annotations

import math

import pytest
import torch

from lora_compile import SamplingParams, Sequence
from lora_compile.sample.sampling import GREEDY_BELOW_TEMPERATURE, NON_FINITE, argmax, sample
from tests.checkpoints import load_reference
from tests.conftest import build_engine
from tests.test_engine_golden import PROMPTS

SAMPLED = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234, max_new_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(models):
    return build_engine(models["llama"], compile=False)


def test_seeded_sampling_is_independent_of_the_batch(engine):
    alone = engine.generate([PROMPTS[0]], SAMPLED)[0]
    others = [SamplingParams(temperature=1.2, seed=s, max_new_tokens=30, ignore_eos=True) for s in (1, 2)]
    crowded = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[1]], [others[0], SAMPLED, others[1]])
    assert crowded[1] == alone
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(**{**SAMPLED.__dict__, "seed": 99}))[0]
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert other_seed != alone and greedy != alone  # sampling is really random, and seeded


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    top1 = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.5, top_k=1, seed=3, max_new_tokens=16, ignore_eos=True))[0]
    nucleus = engine.generate([PROMPTS[0]], SamplingParams(temperature=1.5, top_p=1e-6, seed=3, max_new_tokens=16, ignore_eos=True))[0]
    assert top1 == greedy and nucleus == greedy


@torch.no_grad()
def test_repetition_penalty_matches_transformers(engine, models):
    ref_model = load_reference(models["llama"])
    for penalty in (1.3, 0.8):
        ours = engine.generate([PROMPTS[0]], SamplingParams(repetition_penalty=penalty, max_new_tokens=24, ignore_eos=True))[0]
        ids = torch.tensor([PROMPTS[0]])
        ref = ref_model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                                 eos_token_id=None, repetition_penalty=penalty)[0, ids.shape[1]:].tolist()
        assert ours == ref
    assert ours != engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]


def _run(engine, seq):
    assert engine.try_admit(seq)
    while not seq.is_finished:
        engine.step([seq])
    engine.release(seq)
    return seq


def test_stop_token_eos_and_length(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=16, ignore_eos=True))[0]
    target = greedy[5]
    first = greedy.index(target)
    stopped = _run(engine, Sequence(1, PROMPTS[0], SamplingParams(max_new_tokens=16, stop_token_ids=(target,))))
    assert stopped.finish_reason == "stop" and stopped.output_ids == greedy[: first + 1]
    length = _run(engine, Sequence(2, PROMPTS[0], SamplingParams(max_new_tokens=7, ignore_eos=True)))
    assert length.finish_reason == "length" and len(length.output_ids) == 7
    eos_before = engine.tokenizer.eos_token_ids
    engine.tokenizer.eos_token_ids = frozenset({target})
    try:
        eos = _run(engine, Sequence(3, PROMPTS[0], SamplingParams(max_new_tokens=16)))
        ignored = _run(engine, Sequence(4, PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True)))
    finally:
        engine.tokenizer.eos_token_ids = eos_before
    assert eos.finish_reason == "eos" and eos.output_ids == greedy[: first + 1]
    assert ignored.finish_reason == "length" and ignored.output_ids == greedy


def test_logprobs(engine):
    seq = Sequence(1, PROMPTS[1], SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=True, top_logprobs=3))
    assert engine.try_admit(seq)
    logits = []
    while not seq.is_finished:
        logits.append(engine.step([seq], return_logits=True).logits[0])
    engine.release(seq)
    for token, lp, top, row in zip(seq.output_ids, seq.output_logprobs, seq.output_top_logprobs, logits):
        expected = torch.log_softmax(row, -1)
        assert lp == pytest.approx(expected[token].item(), abs=1e-5)
        assert top[0][0] == token and [t for t, _ in top] == expected.topk(3).indices.tolist()


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(repetition_penalty=0.0), dict(repetition_penalty=1e-38),
                                 dict(repetition_penalty=1e38), dict(temperature=float("nan")), dict(max_new_tokens=0)])
def test_invalid_sampling_params(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SamplingParams(**bad)


def test_temperatures_below_the_floor_are_greedy(engine):
    """Below GREEDY_BELOW_TEMPERATURE (vLLM's 1e-5) a request is greedy: before, 1e-38 divided the logits into
    infinity and every step drew token 0."""
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0]
    for temperature in (1e-38, 1e-45, 1e-30, 9.9e-6):
        params = SamplingParams(temperature=temperature, seed=3, max_new_tokens=12, ignore_eos=True)
        assert params.greedy and engine.generate([PROMPTS[0]], params)[0] == greedy, temperature
    assert not SamplingParams(temperature=GREEDY_BELOW_TEMPERATURE).greedy
    # The sampler itself: a row with a tiny temperature gets the argmax, and a finite log-probability.
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(0)) * 30
    seqs = [Sequence(i, [1, 2], SamplingParams(temperature=t, logprobs=True)) for i, t in enumerate((1e-38, 0.0))]
    out = sample(logits.clone(), seqs)
    assert out.token_ids == logits.argmax(dim=-1).tolist() and all(math.isfinite(lp) for lp in out.logprobs)


def test_requests_that_cannot_fit_are_refused(engine):
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.try_admit(Sequence(1, [1] * 150, SamplingParams(max_new_tokens=100)))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.try_admit(Sequence(2, [1, 10**6], SamplingParams()))
    with pytest.raises(ValueError, match="at least one token"):
        engine.try_admit(Sequence(3, [], SamplingParams()))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_row_gets_no_token_and_leaves_the_others_alone(bad):
    """A row with one NaN or infinity gets NON_FINITE; the greedy, seeded and logprob rows beside it get what they
    get alone."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=gen) * 3
    logits[1, 17] = bad
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=5),
              SamplingParams(logprobs=True, top_logprobs=2)]

    def seqs():
        out = [Sequence(i, [1, 2], p) for i, p in enumerate(params)]
        for s in out:
            if not s.sampling.greedy:
                s.generator = torch.Generator().manual_seed(s.sampling.seed)
        return out

    batch = sample(logits.clone(), seqs())
    assert batch.token_ids[1] == NON_FINITE
    for row in (0, 2, 3):
        alone = sample(logits[row:row + 1].clone(), [seqs()[row]])
        assert batch.token_ids[row] == alone.token_ids[0] != NON_FINITE
    assert batch.logprobs[3] == alone.logprobs[0] and batch.top_logprobs[3] == alone.top_logprobs[0]


def test_argmax_picks_as_torch_argmax_does():
    """The sampler's one-pass argmax (max's indices) against torch.argmax: the first of equal maxima, however far
    apart across a vocabulary-sized row, a NaN wherever it is, and a row of -inf."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 49152, generator=gen)
    x[0, [100, 40000]] = 9.0           # tied, far apart
    x[1, [30000, 45000]] = math.nan    # NaN counts as the largest, the first one
    x[2] = -math.inf
    x[3, [7, 8]] = math.inf
    x[4, 49151] = 50.0                 # the last column
    assert argmax(x).tolist() == x.argmax(dim=-1).tolist() == [100, 30000, 0, 7, 49151, int(x[5].argmax())]
