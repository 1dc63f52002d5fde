"""logit_bias, presence/frequency penalties, min_p and prompt log-probabilities: each against transformers' own
processors or a plain per-row reference, seeded requests unchanged by what shares their batch, and prompt
log-probabilities against a full transformers (+ PEFT) forward, across prefill chunks."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper, SequenceBiasLogitsProcessor

from lora_compile import SamplingParams, Sequence
from lora_compile.sample.logits_processors import apply_min_p
from lora_compile.sample.sampling import NON_FINITE, sample
from service.runner.output import OutputProcessor
from tests.checkpoints import load_reference
from tests.conftest import build_engine
from tests.test_engine_golden import PROMPTS

# 61 tokens: three prefill chunks at the tests' budget of 24 tokens a step.
LONG_PROMPT = [(37 * i + 11) % 300 + 2 for i in range(61)]
VOCAB = 300


@pytest.fixture(scope="module")
def engine(models, adapters):
    return build_engine(models["llama"], adapters["llama"], compile=False)


def _seqs(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> list[Sequence]:
    outputs = outputs or [[]] * len(params)
    seqs = [Sequence(i, [3, 4, 5], p, output_ids=list(outputs[i])) for i, p in enumerate(params)]
    for s in seqs:
        if not s.sampling.greedy:
            s.generator = torch.Generator().manual_seed(s.sampling.seed)
    return seqs


def _logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _run(engine, seq: Sequence) -> Sequence:
    assert engine.try_admit(seq)
    while not seq.is_finished:
        engine.step([seq])
    engine.release(seq)
    return seq


# --- the sampler ------------------------------------------------------------------------------------------------
def test_logit_bias_matches_transformers_sequence_bias():
    biases = [((3, 5.0), (40, -2.5), (299, 100.0)), (), ((0, -100.0), (7, 0.25))]
    logits = _logits(3)
    processed = logits.clone()
    out = sample(processed, _seqs([SamplingParams(logit_bias=b) for b in biases]))
    for row, bias in enumerate(biases):
        expected = logits[row:row + 1]
        if bias:
            hf = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias])
            expected = hf(torch.tensor([[3, 4, 5]]), expected.clone())
        assert torch.equal(processed[row], expected[0])
        assert out.token_ids[row] == expected[0].argmax().item()
    assert out.token_ids[0] == 299 and out.token_ids[2] != 0


def _penalised(logits: torch.Tensor, prompt: list[int], output: list[int], sp: SamplingParams) -> torch.Tensor:
    """A plain per-row reference in vLLM v1's order: bias, repetition, frequency, presence."""
    row = logits.clone()
    for token, bias in sp.logit_bias:
        row[token] += bias
    seen = sorted(set(prompt) | set(output))
    if sp.repetition_penalty != 1.0:
        picked = row[seen]
        row[seen] = torch.where(picked > 0, picked / sp.repetition_penalty, picked * sp.repetition_penalty)
    counts = torch.zeros_like(row)
    for token in output:
        counts[token] += 1
    row -= sp.frequency_penalty * counts
    row -= sp.presence_penalty * (counts > 0).float()
    return row


def test_penalties_match_a_per_row_reference_as_outputs_grow():
    """Each step reads only the tokens appended since (the counts are kept on the sequence): after three steps of
    new tokens the logits still equal a reference rebuilt from the whole output."""
    params = [SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
              SamplingParams(frequency_penalty=-2.0, logit_bias=((5, 2.0), (9, -1.0)), repetition_penalty=1.3),
              SamplingParams(),
              SamplingParams(presence_penalty=-0.75, repetition_penalty=0.8)]
    outputs = [[5, 5, 9], [], [1, 2], [9, 9, 9, 4]]
    seqs = _seqs(params, outputs)
    for step in range(3):
        logits = _logits(len(seqs), seed=step)
        processed = logits.clone()
        sample(processed, seqs)
        for row, seq in enumerate(seqs):
            expected = _penalised(logits[row], seq.prompt_ids, seq.output_ids, seq.sampling)
            torch.testing.assert_close(processed[row], expected, rtol=1e-6, atol=1e-6)
        for i, seq in enumerate(seqs):
            seq.output_ids += [(7 * step + i) % 12, 5]
    assert seqs[0].sampler_state.num_counted == len(seqs[0].output_ids) - 2  # counted up to the last step


def test_min_p_matches_transformers():
    logits = _logits(4, seed=3)
    min_p = [0.0, 0.05, 0.3, 1.0]
    ours = apply_min_p(logits, torch.tensor(min_p))
    for row, p in enumerate(min_p):
        assert torch.equal(ours[row], MinPLogitsWarper(min_p=p)(None, logits[row:row + 1])[0])
    # Every draw of the sampler lies in what transformers keeps; without min_p, draws do fall outside.
    keep = ~MinPLogitsWarper(min_p=0.05)(None, logits[2:3])[0].isinf()
    draws = {p: sample(logits[2:3].repeat(200, 1), _seqs([SamplingParams(temperature=1.0, min_p=p, seed=s)
                                                          for s in range(200)])).token_ids for p in (0.05, 0.0)}
    assert all(keep[t] for t in draws[0.05]) and len(set(draws[0.05])) > 1
    assert not all(keep[t] for t in draws[0.0])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_row_leaves_rows_with_processors_alone(bad):
    params = [SamplingParams(logit_bias=((3, 2.0),), presence_penalty=1.0), SamplingParams(repetition_penalty=1.2),
              SamplingParams(temperature=0.8, min_p=0.1, frequency_penalty=1.0, seed=5),
              SamplingParams(temperature=1.1, top_p=0.9, seed=6, logprobs=True, top_logprobs=2)]
    outputs = [[3, 3], [4], [7, 7, 8], [2]]
    logits = _logits(5, seed=1)
    logits[4, 17] = bad
    batch = sample(logits.clone(), _seqs([*params, SamplingParams(presence_penalty=2.0)], [*outputs, [1]]))
    assert batch.token_ids[4] == NON_FINITE
    for row in range(4):
        alone = sample(logits[row:row + 1].clone(), _seqs([params[row]], [outputs[row]]))
        assert batch.token_ids[row] == alone.token_ids[0] != NON_FINITE
    assert batch.logprobs[3] == alone.logprobs[0] and batch.top_logprobs[3] == alone.top_logprobs[0]


# --- the engine: greedy and seeded tokens -----------------------------------------------------------------------
@torch.no_grad()
def test_penalised_greedy_tokens_match_transformers(engine, models):
    """Greedy with presence and frequency penalties and a logit_bias, against transformers' logits with the plain
    reference applied each step (OpenAI's formulas, over the generated tokens)."""
    sp = SamplingParams(presence_penalty=1.2, frequency_penalty=0.8, logit_bias=((42, 1.5),), max_new_tokens=18,
                        ignore_eos=True)
    ours = engine.generate([PROMPTS[0]], sp)[0]
    model = load_reference(models["llama"])
    ids, ref = list(PROMPTS[0]), []
    for _ in range(sp.max_new_tokens):
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        token = _penalised(logits, [], ref, sp).argmax()  # (no repetition penalty: the prompt plays no part)
        ref.append(int(token))
        ids.append(int(token))
    assert ours == ref
    # (the first repeat, at token 16 of plain greedy, is where the penalties change its course)
    assert ours != engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=18, ignore_eos=True))[0]


def test_greedy_follows_logit_bias_and_min_p_one(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    forced = next(t for t in range(2, VOCAB) if t not in greedy)
    params = [SamplingParams(logit_bias=((forced, 100.0),), max_new_tokens=8, ignore_eos=True),
              SamplingParams(logit_bias=((greedy[0], -100.0),), max_new_tokens=8, ignore_eos=True),
              # min_p 1 keeps only the top token: a draw at any temperature is the greedy token
              SamplingParams(temperature=1.5, min_p=1.0, seed=3, max_new_tokens=8, ignore_eos=True)]
    biased, banned, top_only = engine.generate([PROMPTS[0]] * 3, params)
    assert biased == [forced] * 8
    assert banned[0] != greedy[0]
    assert top_only == greedy


def test_seeded_tokens_are_independent_of_batch_mates_options(engine):
    seeded = [SamplingParams(temperature=0.9, min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3,
                             logit_bias=((5, 3.0),), seed=7, max_new_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=8, max_new_tokens=12, ignore_eos=True)]
    alone = [engine.generate([PROMPTS[i]], sp)[0] for i, sp in enumerate(seeded)]
    others = [SamplingParams(logit_bias=((9, 5.0),), repetition_penalty=1.3, max_new_tokens=14, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=20, top_p=0.8, seed=1, max_new_tokens=13, ignore_eos=True),
              SamplingParams(temperature=0.7, min_p=0.2, presence_penalty=-1.0, seed=2, logprobs=True, top_logprobs=2,
                             max_new_tokens=11, ignore_eos=True),
              SamplingParams(prompt_logprobs=2, frequency_penalty=1.0, max_new_tokens=10, ignore_eos=True)]
    crowded = engine.generate([PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1], LONG_PROMPT, PROMPTS[2]],
                              [others[0], seeded[0], others[1], seeded[1], others[2], others[3]])
    assert crowded[1] == alone[0] and crowded[3] == alone[1]
    reseeded = SamplingParams(**{**seeded[0].__dict__, "seed": 70})
    assert engine.generate([PROMPTS[0]], reseeded)[0] != alone[0]  # the options do sample


# --- prompt log-probabilities -------------------------------------------------------------------------------------
@torch.no_grad()
@pytest.mark.parametrize("adapter", [None, "all4"])
def test_prompt_logprobs_match_a_full_transformers_forward(engine, models, adapters, adapter):
    """Every prompt position's log-probability and top 3, through three prefill chunks, equal log_softmax of one
    transformers (+ PEFT) forward over the whole prompt."""
    seq = _run(engine, Sequence(1, LONG_PROMPT, SamplingParams(max_new_tokens=2, prompt_logprobs=3), adapter))
    model = load_reference(models["llama"], adapters["llama"][adapter] if adapter else None)
    expected = model(input_ids=torch.tensor([LONG_PROMPT])).logits[0, :-1].float().log_softmax(-1)
    targets = torch.tensor(LONG_PROMPT[1:])
    assert len(seq.prompt_logprobs) == len(LONG_PROMPT) - 1 == len(seq.prompt_top_logprobs)
    torch.testing.assert_close(torch.tensor(seq.prompt_logprobs), expected.gather(1, targets[:, None])[:, 0],
                               atol=2e-3, rtol=1e-3)
    top_values = torch.tensor([[lp for _, lp in top] for top in seq.prompt_top_logprobs])
    torch.testing.assert_close(top_values, expected.topk(3, dim=-1).values, atol=2e-3, rtol=1e-3)
    top_ids = torch.tensor([[t for t, _ in top] for top in seq.prompt_top_logprobs])
    torch.testing.assert_close(top_values, expected.gather(1, top_ids), atol=2e-3, rtol=1e-3)


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_smaller_chunks(engine):
    """A prompt cached by an earlier request is computed again when it asks for prompt log-probabilities (and its
    blocks stay cached for others); logits rows capped at 5 a step give the same values in more steps."""
    plain = _run(engine, Sequence(1, LONG_PROMPT, SamplingParams(max_new_tokens=1)))
    first = _run(engine, Sequence(2, LONG_PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=0)))
    assert first.num_cached_tokens == 0 and first.prompt_top_logprobs == [[]] * (len(LONG_PROMPT) - 1)
    again = _run(engine, Sequence(3, LONG_PROMPT, SamplingParams(max_new_tokens=1)))
    assert again.num_cached_tokens >= 48 and again.output_ids == plain.output_ids
    cap = engine.batch_init.max_prompt_logits_rows
    engine.batch_init.max_prompt_logits_rows = 5
    try:
        small = Sequence(4, LONG_PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
        assert engine.try_admit(small)
        steps = 0
        while not small.is_finished:
            engine.step([small])
            steps += 1
        engine.release(small)
    finally:
        engine.batch_init.max_prompt_logits_rows = cap
    assert steps >= math.ceil((len(LONG_PROMPT) - 1) / 5)
    torch.testing.assert_close(torch.tensor(small.prompt_logprobs), torch.tensor(first.prompt_logprobs),
                               atol=1e-5, rtol=0)
    assert small.output_ids == first.output_ids


def test_the_first_output_carries_the_prompt_logprobs(engine):
    """The runner's RequestOutput: the prompt's log-probabilities on the first output only, kept by merge."""
    seq = Sequence(1, PROMPTS[2], SamplingParams(max_new_tokens=3, prompt_logprobs=1, ignore_eos=True))
    proc = OutputProcessor(engine.tokenizer, seq, ())
    assert engine.try_admit(seq)
    outputs = []
    while not seq.is_finished:
        engine.step([seq])
        if (out := proc.process()) is not None:
            outputs.append(out)
    engine.release(seq)
    assert len(outputs) == 3 and len(outputs[0].prompt_logprobs) == len(PROMPTS[2]) - 1
    assert outputs[0].prompt_logprobs == seq.prompt_logprobs
    assert outputs[0].prompt_top_logprobs == seq.prompt_top_logprobs
    assert all(len(top) == 1 for top in outputs[0].prompt_top_logprobs)
    assert outputs[1].prompt_logprobs == [] == outputs[2].prompt_top_logprobs
    outputs[0].merge(outputs[1])
    assert outputs[0].prompt_logprobs == seq.prompt_logprobs and len(outputs[0].token_ids) == 2
