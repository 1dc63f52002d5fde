"""Activated LoRA (PEFT's alora_invocation_tokens): the adapter acts from the last occurrence of its invocation
tokens in the prompt on, exactly as PEFT computes it, in one batch with plain adapters and the base model; the
prompt's blocks before that are the base model's KV, shared through the prefix cache with base requests and
with other activated adapters."""
from __future__ import annotations

import json
import shutil

import pytest

from lora_compile import SamplingParams, Sequence
from lora_compile.errors import AdapterError
from tests.checkpoints import make_peft_adapter, reference_greedy
from tests.conftest import build_engine
from tests.test_engine_golden import NEW_TOKENS, assert_matches_reference, run_joining

INVOKE = (77, 78, 79)  # an activated adapter's invocation tokens
OTHER_INVOKE = (81, 82)
# A conversation of 3+ KV blocks (16 tokens each), then the invocation, then what follows it.
CONVERSATION = [(i * 37 + 11) % 300 + 1 for i in range(53)]
PROMPTS = [
    CONVERSATION + list(INVOKE) + [5, 6],               # acts from position 53 (block 3, offset 5)
    [9, 8] + list(INVOKE) + [40, 41] + list(INVOKE),    # the last occurrence counts: from position 7
    CONVERSATION[:20],                                   # no invocation: the base model answers
    list(INVOKE),                                        # acts from position 0
]


@pytest.fixture(scope="module")
def activated(models, adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("alora")
    base = models["llama"]
    return {"checker": make_peft_adapter(base, root / "checker", r=8, lora_alpha=16, seed=31,
                                         target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "down_proj"),
                                         alora_invocation_tokens=INVOKE),
            "rewriter": make_peft_adapter(base, root / "rewriter", r=4, lora_alpha=8, seed=32,
                                          alora_invocation_tokens=OTHER_INVOKE),
            "qv8": adapters["llama"]["qv8"]}


def test_activated_adapter_matches_peft_in_a_mixed_batch(models, activated):
    engine = build_engine(models["llama"], activated, compile=False)
    names = ["checker"] * len(PROMPTS) + [None, "qv8"]
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[0]]
    tokens, logits = run_joining(engine, prompts, adapters=names, join_at=[0, 0, 1, 2, 0, 3])
    assert_matches_reference(models["llama"], prompts, tokens, logits, [activated.get(n) for n in names])
    # Non-degenerate: it acts (its tokens are not the base model's) and only from its invocation on (not those of
    # the same weights on every position: served as a plain LoRA).
    reference_plain = reference_greedy(models["llama"], PROMPTS[0], NEW_TOKENS, _as_plain(activated["checker"]))[0]
    assert tokens[0] != tokens[4] and tokens[0] != reference_plain
    assert tokens[2] == reference_greedy(models["llama"], PROMPTS[2], NEW_TOKENS)[0]


def _as_plain(adapter_dir):
    plain = adapter_dir.parent / (adapter_dir.name + "-plain")
    if not plain.exists():
        shutil.copytree(adapter_dir, plain)
        config = json.loads((plain / "adapter_config.json").read_text())
        (plain / "adapter_config.json").write_text(json.dumps(config | {"alora_invocation_tokens": None}))
    return plain


def _run(engine, prompt, adapter):
    seq = Sequence(0, prompt, SamplingParams(max_new_tokens=8, ignore_eos=True), adapter)
    assert engine.try_admit(seq)
    running = [seq]
    while running:
        engine.step(running)
        engine.release_finished(running)
    return seq


def test_the_conversation_is_prefilled_once_for_the_base_and_every_activated_adapter(models, activated):
    engine = build_engine(models["llama"], activated, compile=False)
    bs = engine.config.block_size
    shared = len(CONVERSATION) // bs * bs  # the conversation's full blocks: before any adapter acts
    asked = CONVERSATION + list(INVOKE) + list(range(5, 15))  # its invocation in block 3, which it fills
    base = _run(engine, CONVERSATION + [3, 4], None)
    assert base.num_cached_tokens == 0
    checker = _run(engine, asked, "checker")
    rewriter = _run(engine, CONVERSATION + list(OTHER_INVOKE) + [7], "rewriter")
    assert checker.num_cached_tokens == shared and rewriter.num_cached_tokens == shared
    again = _run(engine, asked, "checker")  # its own blocks past the invocation too
    assert again.num_cached_tokens == (len(asked) - 1) // bs * bs > shared
    plain = _run(engine, asked, "qv8")  # a plain adapter's KV differs from the first block
    assert plain.num_cached_tokens == 0
    for seq, adapter in ((checker, "checker"), (rewriter, "rewriter"), (again, "checker")):
        assert seq.output_ids == reference_greedy(models["llama"], seq.prompt_ids, 8, activated[adapter])[0]


def test_activated_adapter_matches_peft_compiled(models, activated, compiled_engines):
    engine = compiled_engines("llama")
    engine.adapters.register("checker", str(activated["checker"]))
    try:
        names = ["checker", "checker", None, "qv8"]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[3]]
        tokens, logits = run_joining(engine, prompts, adapters=names, join_at=[0, 1, 0, 2])
        assert_matches_reference(models["llama"], prompts, tokens, logits, [activated.get(n) for n in names])
    finally:
        engine.adapters.unregister("checker")


@pytest.mark.parametrize("value, says", [
    ("77", "must be a list of 1 to 256 token ids"),
    ([], "must be a list of 1 to 256 token ids"),
    ([77, 100000], "holds 100000, not a token id"),
    ([77, True], "holds True, not a token id"),
])
def test_bad_invocation_tokens_are_refused(models, activated, tmp_path, value, says):
    bad = shutil.copytree(activated["checker"], tmp_path / "bad")
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps(config | {"alora_invocation_tokens": value}))
    engine = build_engine(models["llama"], {}, compile=False)
    with pytest.raises(AdapterError, match=says):
        engine.adapters.register("bad", str(bad))


def test_an_activated_adapter_from_an_adapter_directory_through_both_doors(models, activated, tmp_path):
    """On demand, gRPC then HTTP: the conversation the base model was asked about is read from the cache (usage),
    and the answer is PEFT's."""
    from service.server import ServerConfig
    from tests.http_wire import post
    from tests.service_harness import ServerThread, build_engine as build_served_engine

    library = tmp_path / "adapters"
    shutil.copytree(activated["checker"], library / "checker")
    engine = build_served_engine(models["llama"], {}, adapter_dirs=(str(library),))
    server = ServerThread(engine, ServerConfig(port=0, http_port=0, grace_period_s=10.0))
    shared = len(CONVERSATION) // engine.config.block_size * engine.config.block_size
    try:
        asked = CONVERSATION + list(INVOKE) + [5]
        with server.client() as client:
            assert client.complete(CONVERSATION + [3], max_new_tokens=2).usage.cached_tokens == 0
            out = client.complete(asked, adapter="checker", max_new_tokens=8, ignore_eos=True)
        assert out.usage.cached_tokens == shared
        assert list(out.token_ids) == reference_greedy(models["llama"], asked, 8, activated["checker"])[0]
        body = {"model": "checker", "prompt": CONVERSATION + list(INVOKE) + [6], "max_tokens": 2, "temperature": 0}
        status, reply, _ = post(server.server.http_port, "/v1/completions", body)
        assert status == 200, reply
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
        server.wait_idle()
    finally:
        server.stop()
