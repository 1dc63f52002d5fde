"""A batch on one adapter alone runs on that adapter merged into the packed weights (lora_merge): the same tokens
as peft, back to per-token LoRA as soon as the batch mixes, and never a stale merge after its slot is reloaded."""
from __future__ import annotations

import pytest

from lora_compile import EngineConfig, host_memory
from lora_compile.lora import merge as lora_merge
from lora_compile.model import packed_gemm
from tests.checkpoints import reference_greedy
from tests.conftest import build_engine
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, assert_matches_reference, run_joining
from tests.test_lora import check_mixed_batch


def recording_steps(engine) -> list:
    """Make engine.step record its StepOutputs."""
    outputs, step = [], engine.step

    def record(*args, **kwargs):
        out = step(*args, **kwargs)
        outputs.append(out)
        return out

    engine.step = record
    return outputs


# Six sequences, so that decode steps have 7 rows (GEMMs on packed weights) until the first ones finish.
LONE_PROMPTS = PROMPTS + [PROMPTS[0][:5], PROMPTS[2][:12]]
LONE_JOIN_AT = [0, 0, 3, 7, 0, 1]


def device_slot(engine, name: str) -> int | None:
    return next(a.device_slot for a in engine.adapters.list() if a.name == name)


def run_lone(engine, model_dir, adapter_name, adapter_dir, outputs):
    outputs.clear()
    tokens, logits = run_joining(engine, LONE_PROMPTS, adapters=[adapter_name] * len(LONE_PROMPTS), join_at=LONE_JOIN_AT)
    assert_matches_reference(model_dir, LONE_PROMPTS, tokens, logits, [adapter_dir] * len(LONE_PROMPTS))
    return [out.merged for out in outputs]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lone_adapter_runs_merged_matches_peft_and_unmerges_for_mixed_batches(models, adapters, compiled):
    model_dir, dirs = models["llama"], adapters["llama"]
    engine = build_engine(model_dir, dirs, compile=compiled, merge_lone_adapter="on", merge_after_steps=3)
    outputs = recording_steps(engine)

    merged = run_lone(engine, model_dir, "all4", dirs["all4"], outputs)
    # The first steps use per-token LoRA. From the third on, each step whose GEMMs all run on packed weights (2-5
    # rows run on the unpacked ones: per-token LoRA there) merges one more layer's projections; once every layer
    # is merged, such steps run merged.
    packed = [packed_gemm.packed_rows(out.num_tokens + 1) is not None for out in outputs]
    assert sum(packed[2:]) > 10 and not all(packed), f"the run should cover both kinds of step: {packed}"
    n_layers, progress, expected, merging = len(engine.model.layers), 0, [], []
    for i, p in enumerate(packed):
        merging.append(p and i >= 2 and progress < n_layers)
        progress += merging[-1]
        expected.append(p and progress == n_layers)
    assert n_layers > 1 and sum(merging) == n_layers
    assert merged == expected, merged
    assert [out.merge_s > 0 for out in outputs] == merging
    assert engine._merger.merges == 1

    # A batch mixing adapters and the base model is back on the base weights, per-token LoRA.
    outputs.clear()
    check_mixed_batch(engine, model_dir, dirs)
    assert not any(out.merged for out in outputs)

    # The same adapter alone again: its merged weights are still valid, nothing is merged twice.
    assert any(run_lone(engine, model_dir, "all4", dirs["all4"], outputs))
    assert engine._merger.merges == 1

    # Its slot reloaded with another adapter: that one is merged afresh, never the stale weights.
    slot = device_slot(engine, "all4")
    engine.adapters.unregister("all4")
    engine.adapters.register("other", str(dirs["mlp16rs"]))
    engine.adapters.acquire("other")
    assert device_slot(engine, "other") == slot
    engine.adapters.release(slot)
    assert any(run_lone(engine, model_dir, "other", dirs["mlp16rs"], outputs))
    assert engine._merger.merges == 2


def test_merging_is_on_by_default_where_the_copy_fits_and_needs_packed_weights(models, adapters):
    model_dir, dirs = models["llama"], adapters["llama"]
    # auto (the default): a tiny model's merged copy fits in any machine that runs these tests
    assert build_engine(model_dir, dirs, compile=False)._merger is not None
    assert build_engine(model_dir, dirs, compile=False, merge_lone_adapter="off")._merger is None
    assert build_engine(model_dir, dirs, compile=False, prepack_weights=False, merge_lone_adapter="on")._merger is None
    # Reference for the lone-adapter runs above: the adapter changes the output, so a merge that dropped it would fail.
    assert reference_greedy(model_dir, PROMPTS[0], NEW_TOKENS, dirs["all4"])[0] != \
        reference_greedy(model_dir, PROMPTS[0], NEW_TOKENS)[0]


@pytest.mark.parametrize("mode, packed, copy_gb, available_gb, expected", [
    ("auto", True, 1.0, 8.0, True),
    ("auto", True, 5.0, 8.0, False),    # more than half of what is available
    ("auto", True, 1.0, None, False),   # unknown: do not risk it
    ("auto", False, 1.0, 8.0, False),   # nothing to merge into without packed weights
    ("on", True, 5.0, 8.0, True),
    ("on", False, 1.0, 8.0, False),
    ("off", True, 1.0, 8.0, False),
])
def test_merge_policy(mode, packed, copy_gb, available_gb, expected):
    available = None if available_gb is None else int(available_gb * 1e9)
    assert lora_merge.should_merge(mode, packed, int(copy_gb * 1e9), available) is expected


def test_available_memory_is_read_on_linux():
    available = host_memory.available_memory_bytes()
    assert available is not None and 0 < available < 1 << 50


def test_merge_mode_is_validated(models):
    with pytest.raises(ValueError, match="merge_lone_adapter must be one of auto, on, off"):
        EngineConfig(model=str(models["llama"]), merge_lone_adapter="yes")


def test_merge_flag_of_the_serve_command():
    from service.cli import serve_parser
    parse = serve_parser().parse_args
    assert parse([]).merge_lone_adapter == "auto"
    assert parse(["--merge-lone-adapter"]).merge_lone_adapter == "on"  # the bare flag, as before
    assert parse(["--merge-lone-adapter", "off", "--port", "0"]).merge_lone_adapter == "off"


PACKED, UNPACKED = 9, 3  # rows of a step whose GEMMs run on packed weights, and of one whose GEMMs do not


def test_merger_state_across_adapters_mixed_steps_and_reloads(models, adapters):
    """The merger alone, driven step by step: which packs the layers hold after each choice."""
    model_dir, dirs = models["llama"], adapters["llama"]
    engine = build_engine(model_dir, dirs, compile=False, merge_lone_adapter="on", merge_after_steps=2)
    merger, generation = engine._merger, engine.adapters.slot_generation
    modules, layers = merger._modules, len(engine.model.layers)
    base = [m.weight_packed for m in modules]

    def step(slot, rows=PACKED):
        merged, spent = merger.select(slot, rows)
        held = [m.weight_packed for m in modules]
        # The layers hold the base packs or one complete merged copy, never a mix; at most one merged copy exists.
        on_base = all(h is b for h, b in zip(held, base))
        on_merged = len(merger._merged) == len(modules) and all(h is m for h, m in zip(held, merger._merged))
        assert on_base != merged and (on_base or on_merged)
        assert len(merger._merged) <= len(modules)
        return merged, spent > 0

    assert step(1) == (False, False)                     # streak 1 < 2: nothing yet
    assert step(1, UNPACKED) == (False, False)           # streak 2, but this step's GEMMs are not on the packs
    assert [step(1)[1] for _ in range(layers - 1)] == [True] * (layers - 1)  # a layer per step, not done yet
    assert len(merger._merged) == (layers - 1) * len(modules) // layers
    assert step(None) == (False, False)                  # a mixed step keeps the progress...
    assert step(1) == (False, False) and step(1) == (True, True)  # ...and the streak restarts: 2 steps, then the last layer
    assert step(1) == (True, False) and merger.merges == 1

    # Another adapter alone: the layers go back to base, the first copy is dropped when the second merge starts.
    assert step(2) == (False, False) and merger._merged_key == (1, generation[1])
    assert step(2) == (False, True) and merger._merged_key is None and merger._pending_key == (2, generation[2])

    # Its slot reloaded mid-merge: the partial merge is dropped, and the streak starts over for the new contents.
    generation[2] += 1
    assert step(2) == (False, False) and merger._pending_key is None and merger._merged == []
    for _ in range(layers):
        step(2)
    assert step(2) == (True, False) and merger.merges == 2

    # Reloaded once merged: dropped at the next step, whatever it runs.
    generation[2] += 1
    assert step(None) == (False, False) and merger._merged_key is None and merger._merged == []

    # From a fresh start, an adapter alone on packed steps runs merged exactly at its steps_to_merge-th step.
    assert [step(1)[0] for _ in range(merger.steps_to_merge)] == [False] * (merger.steps_to_merge - 1) + [True]


def test_kv_written_by_merged_steps_is_reused_by_unmerged_steps_token_for_token(models, adapters):
    """The prefix cache does not tell merged from per-token LoRA: a follow-up turn whose prefix holds blocks that
    merged steps wrote runs in a mixed (unmerged) batch and still matches PEFT."""
    from lora_compile import SamplingParams, Sequence

    model_dir, dirs = models["llama"], adapters["llama"]
    engine = build_engine(model_dir, dirs, compile=False, merge_lone_adapter="on", merge_after_steps=1, block_size=4)
    outputs = recording_steps(engine)
    first = engine.generate(LONE_PROMPTS, SamplingParams(max_new_tokens=20, ignore_eos=True),
                            adapters=["all4"] * len(LONE_PROMPTS))
    assert sum(out.merged for out in outputs) > 5, "the lone run was meant to write blocks from merged steps"
    follow = LONE_PROMPTS[0] + first[0]
    outputs.clear()
    seq = Sequence(1, follow, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), "all4")
    other = Sequence(2, PROMPTS[1], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True), None)
    assert engine.try_admit(seq) and engine.try_admit(other)
    assert seq.num_cached_tokens >= len(LONE_PROMPTS[0]) + 8, "the follow-up should hit merged-written blocks"
    running = [seq, other]
    while running:
        engine.step(running)
        engine.release_finished(running)
    assert not any(out.merged for out in outputs)
    assert seq.output_ids == reference_greedy(model_dir, follow, NEW_TOKENS, dirs["all4"])[0]
