"""Weighted adapter mixes (lora_compile/lora/mixes.py): several adapters with weights, one slot, exactly PEFT's
add_weighted_adapter(combination_type="cat"), in one batched step with single adapters, other mixes and the base
model; keyed in the prefix cache by their members' weights digests and weights; refused precisely where they
cannot be served."""
from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from lora_compile import SamplingParams, Sequence
from lora_compile.errors import AdapterInUseError, AdapterMixError, AdapterOutputError
from lora_compile.lora.mixes import AdapterMix, make_mix, mix_problems
from tests.checkpoints import greedy, load_reference, make_peft_adapter
from tests.conftest import build_engine
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, run_joining

PIRATE_ROBOT = (("qv8", 0.7), ("all4", 0.3))
ROBOT_PIRATE = (("all4", -0.5), ("qv8", 1.25))   # other order, a negative weight
SCALED = (("all4", 0.5),)                         # one adapter with a weight: a scale


def mix_name(members) -> str:
    return AdapterMix(tuple(members)).name


@torch.no_grad()
def reference_mix(model_dir, prompt, dirs, members):
    """PEFT's own mix: every member loaded, add_weighted_adapter(..., "cat") with the same weights."""
    model = load_reference(model_dir)
    first, *rest = members
    model = PeftModel.from_pretrained(model, dirs[first[0]], adapter_name=first[0])
    for name, _ in rest:
        model.load_adapter(dirs[name], adapter_name=name)
    model.add_weighted_adapter([n for n, _ in members], [w for _, w in members], "mix", combination_type="cat")
    model.set_adapter("mix")
    return greedy(model.eval(), prompt, NEW_TOKENS)


def reference(model_dir, prompt, dirs, spec):
    if spec is None:
        return greedy(load_reference(model_dir), prompt, NEW_TOKENS)
    if isinstance(spec, str):
        return greedy(load_reference(model_dir, dirs[spec]), prompt, NEW_TOKENS)
    return reference_mix(model_dir, prompt, dirs, spec)


def check_against_peft(engine, model_dir, dirs, specs, join_at):
    names = [s if s is None or isinstance(s, str) else mix_name(s) for s in specs]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(specs))]
    tokens, logits = run_joining(engine, prompts, adapters=names, join_at=join_at)
    for i, spec in enumerate(specs):
        ref_tokens, ref_logits = reference(model_dir, prompts[i], dirs, spec)
        assert len(set(ref_tokens)) > 4, "degenerate reference: the test would prove nothing"
        assert tokens[i] == ref_tokens, f"sequence {i} ({names[i]}) differs from PEFT's"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-3, rtol=1e-3)
    return tokens


def test_mixes_match_peft_in_one_batch_with_singles_and_the_base_eager(models, adapters):
    dirs = adapters["llama"]
    engine = build_engine(models["llama"], dirs, compile=False, max_loras_per_batch=4)
    specs = [None, "qv8", PIRATE_ROBOT, ROBOT_PIRATE, SCALED]
    tokens = check_against_peft(engine, models["llama"], dirs, specs, join_at=[0, 0, 0, 1, 2])
    # Non-degenerate: a mix answers otherwise than its members alone, and the weights matter.
    alone = run_joining(engine, [PROMPTS[2]] * 2, adapters=["qv8", "all4"], join_at=[0, 0])[0]
    assert tokens[2] not in alone
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_mixes_share_the_compiled_graph(models, adapters, compiled_engines):
    """On the shared compiled engine (fail_on_recompile): mixes are slot constants, not another graph."""
    engine, dirs = compiled_engines("llama"), adapters["llama"]
    check_against_peft(engine, models["llama"], dirs, [PIRATE_ROBOT, "mlp16rs", None, SCALED], join_at=[0, 0, 1, 1])


def _admit_and_run(engine, prompt, name):
    seq = Sequence(0, prompt, SamplingParams(max_new_tokens=2, ignore_eos=True), name)
    assert engine.try_admit(seq)
    while not seq.is_finished:
        engine.step([seq])
    engine.release(seq)
    return seq


def test_prefix_cache_keys_a_mix_by_its_members_and_weights(models, adapters, tmp_path):
    dirs = dict(adapters["llama"])
    engine = build_engine(models["llama"], dirs, compile=False, enable_prefix_caching=True)
    prompt = PROMPTS[0] * 3  # several blocks
    mix = mix_name(PIRATE_ROBOT)
    assert _admit_and_run(engine, prompt, mix).num_cached_tokens == 0
    assert _admit_and_run(engine, prompt, mix).num_cached_tokens > 0          # the same mix: its own blocks
    reweighted = mix_name((("qv8", 0.7), ("all4", 0.30000000000000004)))
    assert _admit_and_run(engine, prompt, reweighted).num_cached_tokens == 0  # any other weight: other KV
    assert _admit_and_run(engine, prompt, "qv8").num_cached_tokens == 0       # a member alone: other KV
    # A member reloaded with other weights: the mix is composed anew, and finds none of the old mix's blocks.
    retrained = make_peft_adapter(models["llama"], tmp_path / "all4-v2", r=4, lora_alpha=8, seed=99,
                                  target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"))
    engine.adapters.register("all4", str(retrained))
    seq = _admit_and_run(engine, prompt, mix)
    assert seq.num_cached_tokens == 0
    dirs["all4"] = retrained
    assert seq.output_ids == reference_mix(models["llama"], prompt, dirs, PIRATE_ROBOT)[0][:2]


def test_a_member_in_use_by_a_running_mix_is_not_replaced(models, adapters):
    engine = build_engine(models["llama"], adapters["llama"], compile=False)
    seq = Sequence(0, PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True), mix_name(PIRATE_ROBOT))
    assert engine.try_admit(seq)
    with pytest.raises(AdapterInUseError):
        engine.adapters.unregister("all4")
    with pytest.raises(AdapterInUseError):
        engine.adapters.register("qv8", str(adapters["llama"]["qv8"]))
    engine.release(seq)
    engine.adapters.unregister("all4")  # free now; the mix's slot goes with it
    assert mix_name(PIRATE_ROBOT) not in engine.adapters.device_names()


def test_mixes_that_cannot_be_served_are_refused(models, adapters, tmp_path):
    dirs = adapters["llama"]
    engine = build_engine(models["llama"], dirs, compile=False)
    over = AdapterMix((("mlp16rs", 1.0), ("qv8", 1.0)))  # ranks 16 + 8 over max_lora_rank 16
    with pytest.raises(AdapterMixError, match=r"mlp16rs 16 \+ qv8 8 = 24, over this server's --max-lora-rank 16"):
        engine.adapters.check_mix(over)
    with pytest.raises(AdapterMixError, match="--max-lora-rank 16"):
        engine.adapters.acquire(over.name)
    activated = make_peft_adapter(models["llama"], tmp_path / "checker", r=4, alora_invocation_tokens=(7, 8))
    engine.adapters.register("checker", str(activated))
    with pytest.raises(AdapterMixError, match="activated LoRA"):
        engine.adapters.acquire(AdapterMix((("qv8", 0.5), ("checker", 0.5))).name)
    dora = make_peft_adapter(models["llama"], tmp_path / "dora", r=4, use_dora=True)
    engine.adapters.register("dora", str(dora))
    with pytest.raises(AdapterMixError, match="DoRA"):
        engine.adapters.check_mix(AdapterMix((("dora", 0.5), ("qv8", 0.5))))
    assert engine.adapters.num_free_slots == engine.adapters.max_loras  # nothing was pinned by a refusal


def test_mix_names_are_canonical_and_checked():
    assert make_mix([("pirate", 1.0)]).name == "pirate"              # one adapter at weight 1 is that adapter
    assert make_mix([("pirate", 0.0)]) is None                       # nothing left: the base model
    mix = make_mix([("pirate", 0.7), ("robot", 0.0), ("cat.v2", -1.5)])
    assert mix.name == "pirate*0.7+cat.v2*-1.5"
    assert AdapterMix.parse(mix.name) == mix and AdapterMix.parse("pirate") is None
    assert [i for i, _ in mix_problems([("a", 1.0), ("a", 2.0), ("b/c", 1.0), ("d", float("nan"))])] == [1, 2, 3]
    assert mix_problems([(f"a{i}", 1.0) for i in range(9)])[0][1].startswith("at most 8 adapters")


def test_a_failed_member_fails_its_mix_before_it_runs(models, adapters):
    """A member found bad (non-finite at run time) refuses its mixes at once, even one already in a slot."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False)
    mix = mix_name(PIRATE_ROBOT)
    _admit_and_run(engine, PROMPTS[0], mix)
    assert mix in engine.adapters.device_names() and engine.adapters.is_ready(mix)
    engine.adapters.mark_failed("all4", AdapterOutputError("adapter 'all4' produces non-finite values"))
    assert not engine.adapters.is_ready(mix)
    with pytest.raises(AdapterOutputError, match="'all4' produces non-finite"):
        engine.adapters.prefetch(mix)
    with pytest.raises(AdapterOutputError):
        engine.adapters.acquire(mix)


def test_every_form_in_one_step_matches_peft(models, adapters, tmp_path):
    """The base model, a plain adapter, a mix, an activated LoRA and a DoRA adapter, all in the same steps: each
    sequence's greedy tokens and logits are PEFT's for its own form."""
    base = models["llama"]
    dirs = dict(adapters["llama"])
    dirs["checker"] = make_peft_adapter(base, tmp_path / "checker", r=8, lora_alpha=16, seed=31,
                                        alora_invocation_tokens=(77, 78, 79))
    dirs["dora"] = make_peft_adapter(base, tmp_path / "dora", r=8, lora_alpha=16, seed=21, use_dora=True,
                                     target_modules=("q_proj", "v_proj", "o_proj", "down_proj"))
    engine = build_engine(base, dirs, compile=False, max_loras_per_batch=4)
    invoked = PROMPTS[2][:20] + [77, 78, 79] + PROMPTS[2][20:]  # the activated adapter acts from position 20 on
    specs = [None, "qv8", PIRATE_ROBOT, "checker", "dora"]
    names = [s if s is None or isinstance(s, str) else mix_name(s) for s in specs]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], invoked, PROMPTS[0]]
    tokens, logits = run_joining(engine, prompts, adapters=names, join_at=[0, 0, 0, 0, 0])
    for i, spec in enumerate(specs):
        ref_tokens, ref_logits = reference(base, prompts[i], dirs, spec)
        assert len(set(ref_tokens)) > 4, "degenerate reference: the test would prove nothing"
        assert tokens[i] == ref_tokens, f"sequence {i} ({names[i]}) differs from PEFT's"
        torch.testing.assert_close(logits[i], ref_logits, atol=2e-3, rtol=1e-3)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
