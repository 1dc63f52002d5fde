"""Batched multi-LoRA: one batch mixing the base model and three PEFT adapters gives, per sequence, exactly
what peft gives for that adapter alone; constant buffers; one-copy batch init; refusals; device slots."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

from lora_compile import SamplingParams, Sequence
from lora_compile.model import packed_gemm
from lora_compile.errors import AdapterError, AdapterInUseError, AdapterNotFoundError
from lora_compile.model.forward_batch import LoRABatch
from lora_compile.model.layers import LoRALinear
from tests.checkpoints import make_peft_adapter, make_tiny_model, reference_greedy
from tests.conftest import ADAPTER_SPECS, build_engine
from tests.test_engine_golden import NEW_TOKENS, PROMPTS, assert_matches_reference, run_joining

MIXED = [None, "qv8", "all4", "mlp16rs"]  # one sequence per adapter, and one on the base model


def check_mixed_batch(engine, model_dir, adapter_dirs):
    tokens, logits = run_joining(engine, PROMPTS, adapters=MIXED, join_at=[0, 0, 1, 2])
    assert_matches_reference(model_dir, PROMPTS, tokens, logits, [adapter_dirs.get(n) if n else None for n in MIXED])
    # Non-degenerate: the same prompt under each adapter gives a different continuation than under the base.
    prompt = PROMPTS[0]
    base_tokens, _ = reference_greedy(model_dir, prompt, NEW_TOKENS)
    per_adapter = [reference_greedy(model_dir, prompt, NEW_TOKENS, adapter_dirs[n])[0] for n in MIXED[1:]]
    assert len({tuple(base_tokens), *map(tuple, per_adapter)}) == len(MIXED)


@pytest.mark.parametrize("prepack", [True, False], ids=["packed", "plain"])  # plain: the path CUDA takes
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_matches_peft_eager(models, adapters, arch, prepack):
    engine = build_engine(models[arch], adapters[arch], compile=False, prepack_weights=prepack)
    check_mixed_batch(engine, models[arch], adapters[arch])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_matches_peft_compiled(models, adapters, compiled_engines, arch):
    check_mixed_batch(compiled_engines(arch), models[arch], adapters[arch])


def test_output_offsets_are_construction_time_buffers():
    layer = LoRALinear(64, (64, 32, 32), bias=False, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    assert dict(layer.named_buffers())["output_offset"].tolist() == [0, 64, 96, 128]
    assert "output_offset" not in layer.state_dict()
    assert "lora_a" not in layer.state_dict() and "lora_b" not in layer.state_dict()
    offsets = layer.output_offset
    layer.to("meta")  # buffers follow the module
    assert layer.output_offset.device.type == "meta" and offsets.device.type == "cpu"
    gate_up = LoRALinear(64, (128, 128), bias=False, max_loras=2, max_rank=8, dtype=torch.float32, device=torch.device("cpu"))
    assert gate_up.output_offset.tolist() == [0, 128, 256]


def _lora_reference(layer: LoRALinear, x: torch.Tensor, slots: list[int], adapters: dict) -> torch.Tensor:
    """Per token: W x + b + B_s (A_s x) for its own slot s, from the parts loaded into the layer."""
    rows = []
    for t, slot in enumerate(slots):
        y = x[t] @ layer.weight.T + layer.bias
        for i, part in enumerate(adapters.get(slot, [])):
            if part is not None:
                a, b = part
                start, end = layer._slices[i]
                y[start:end] += b @ (a @ x[t])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("b_chunk", [0, 16], ids=["rank-rows", "chunk-major"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_lora_layer_matches_per_token_reference_on_every_path(compiled, b_chunk):
    """Base-only, one slot, and mixed slots, on plain and packed base weights, eager (segments) and compiled
    (indexed), B stored as rank rows and chunk-major (the CPU's bfloat16 layout, here in float32 with several chunks
    a slice): each token gets its own slot's delta; a slot loaded later is used at once; merging gives W + B·A."""
    torch.manual_seed(0)
    layer = LoRALinear(64, (64, 32, 32), bias=True, max_loras=2, max_rank=8, dtype=torch.float32,
                       device=torch.device("cpu"), b_chunk=b_chunk)
    layer.weight.normal_()
    layer.bias.normal_()
    adapters = {2: [(torch.randn(8, 64), torch.randn(64, 8)), None, (torch.randn(4, 64), torch.randn(32, 4))]}
    layer.load_slot(2, adapters[2])
    x = torch.randn(5, 64)
    cases = [[0] * 5, [1, 1, 1, 0, 0], [2, 2, 2, 0, 0], [1, 2, 0, 1, 1]]  # device slot per token (0: base model)
    forward = torch.compile(layer, fullgraph=True, dynamic=True) if compiled else layer

    def run(slots: list[int]) -> torch.Tensor:
        if not any(slots):
            return forward(x, LoRABatch(weight_indices=None), compiled)
        return forward(x, LoRABatch(weight_indices=torch.tensor(slots)), compiled)

    for packed in (False, True):
        if packed:
            layer.prepack()
            assert "weight_packed" in dict(layer.named_buffers()) and "weight_packed" not in layer.state_dict()
        for slots in cases:
            torch.testing.assert_close(run(slots), _lora_reference(layer, x, slots, adapters), atol=1e-4, rtol=1e-4)
        layer.weight_packed = None
    assert not torch.allclose(run(cases[2])[:3], run(cases[0])[:3], atol=1e-2)  # the adapter did change its tokens
    # Loading slot 1 later: its tokens change at once (in-place copy, same tensors).
    adapters[1] = [None, (torch.randn(8, 64), torch.randn(32, 8)), None]
    layer.load_slot(1, adapters[1])
    for slots in cases:
        torch.testing.assert_close(run(slots), _lora_reference(layer, x, slots, adapters), atol=1e-4, rtol=1e-4)
    merged = layer.weight.clone()
    for (start, end), (a, b) in zip(layer._slices[1:2], adapters[1][1:2]):
        merged[start:end] += b @ a
    torch.testing.assert_close(layer.merged_weight(1), merged)
    layer.clear_slot(2)
    del adapters[2]
    torch.testing.assert_close(run(cases[3]), _lora_reference(layer, x, cases[3], adapters), atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="slot"):  # slot 0 would write the base model's zero slot
        layer.load_slot(0, adapters[1])
    torch.testing.assert_close(run(cases[0]), _lora_reference(layer, x, cases[0], {}), atol=1e-4, rtol=1e-4)


def test_packed_linear_is_exact_at_every_row_count_with_few_onednn_sizes():
    """oneDNN keeps one kernel per row count (~0.6 MB each): rows are padded to a bounded set of sizes (the fixed
    ones, then one per 64 rows of a step's token budget)."""
    torch.manual_seed(0)
    weight = torch.randn(48, 32)
    packed = packed_gemm.prepack(weight)
    for rows in (1, 2, 3, 5, 6, 8, 9, 31, 33, 64, 65, 66, 100, 129, 130, 300, 513):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(packed_gemm.packed_linear(x, weight, packed), x @ weight.T, atol=1e-4, rtol=1e-4)
    sizes = {packed_gemm.packed_rows(rows) for rows in range(1, 4098)} - {None}
    assert sizes == set(packed_gemm.PACKED_ROWS) | set(range(193, 4098, 64))
    assert all(rows <= packed_gemm.packed_rows(rows) < rows + 64 for rows in range(6, 4098))


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _batch_init_ops(engine) -> list[str]:
    seqs = [Sequence(i, list(range(1, 4 + 5 * i)), SamplingParams(max_new_tokens=4, ignore_eos=True), name)
            for i, name in enumerate([None, "qv8", "all4", None])]
    for seq in seqs:
        assert engine.try_admit(seq)
    engine.step(seqs)  # prefill, so the counted step mixes decode (1 token) and prefill (chunks)
    seqs[3].num_computed_tokens = 0
    try:
        with _CountOps() as mode:
            engine.batch_init.build(*engine.batch_init.plan(seqs))
        return mode.ops
    finally:
        for seq in seqs:
            engine.release(seq)


def test_batch_init_work_does_not_grow_with_depth(tmp_path, adapters):
    """Batch init does no per-layer work: the same ops for a 2- and a 12-layer model, and none of them copies
    per layer (on CPU the metadata buffer is the device buffer: no copy at all; on CUDA one)."""
    counts = {}
    for layers in (2, 12):
        model_dir = make_tiny_model(tmp_path / f"m{layers}", "llama", seed=0, num_layers=layers)
        engine = build_engine(model_dir, compile=False)
        for name in ("qv8", "all4"):
            make_peft_adapter(model_dir, tmp_path / f"a{layers}{name}", **ADAPTER_SPECS[name])
            engine.adapters.register(name, str(tmp_path / f"a{layers}{name}"))
        counts[layers] = _batch_init_ops(engine)
    assert counts[2] == counts[12]
    copies = [op for op in counts[12] if op in ("aten.copy_", "aten._to_copy", "aten.clone")]
    assert len(copies) <= 1
    assert len(counts[12]) < 40, counts[12]


def test_one_adapters_decode_tokens_run_side_by_side(models, adapters):
    """However the sequences come, a step lays each adapter's decode tokens side by side (its weights then come
    from cache after its first token), and every sequence still gets exactly what it gets alone."""
    engine = build_engine(models["llama"], adapters["llama"], compile=False)
    order = ["all4", None, "qv8", "all4", None, "qv8"]  # interleaved
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [PROMPTS[i % 2] for i in range(len(order))]
    alone = [engine.generate([p], sp, adapters=[n])[0] for p, n in zip(prompts, order)]
    seqs = [Sequence(i, p, sp, n) for i, (p, n) in enumerate(zip(prompts, order))]
    assert all(engine.try_admit(s) for s in seqs)
    while any(s.num_computed_tokens < len(s.prompt_ids) for s in seqs):  # the prompts, chunked by the budget
        engine.step(seqs)
    single, chunks = engine.batch_init.plan(seqs)
    slots = [p.seq.lora_slot for p in single]
    assert not chunks and len(slots) == len(order) and slots == sorted(slots)
    assert [s.lora_slot for s in seqs] != sorted(s.lora_slot for s in seqs)  # the order was the step's doing
    running = list(seqs)
    while running:
        engine.step(running)
        engine.release_finished(running)
    assert [s.output_ids for s in seqs] == alone
    assert len({tuple(t) for t in alone}) > 2  # the adapters (and the base) continue differently


# --- refusals ------------------------------------------------------------------------------------------

def _variant(src, dst, config_edit=None, tensors_edit=None):
    shutil.copytree(src, dst)
    if config_edit:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        config_edit(cfg)
        (dst / "adapter_config.json").write_text(json.dumps(cfg))
    if tensors_edit:
        tensors = load_file(dst / "adapter_model.safetensors")
        tensors_edit(tensors)
        save_file(tensors, dst / "adapter_model.safetensors")
    return dst


def _pickle_only(dst):
    (dst / "adapter_model.safetensors").rename(dst / "adapter_model.bin")


def _corrupt(dst):
    (dst / "adapter_model.safetensors").write_bytes(b"\x00" * 7)


def _truncate(dst):
    data = (dst / "adapter_model.safetensors").read_bytes()
    (dst / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])


def _grow_rank(t):
    for k in list(t):
        t[k] = torch.cat([t[k]] * 5, dim=0 if "lora_A" in k else 1)


def _wrong_shape(t):
    key = next(k for k in t if "lora_A" in k)
    t[key] = t[key][:, :-1].contiguous()


def _misplace_module(t):  # q_proj's weights filed under the MLP, where the model has no q_proj
    for k in [k for k in t if ".self_attn.q_proj." in k]:
        t[k.replace(".self_attn.q_proj.", ".mlp.q_proj.")] = t.pop(k)


REFUSALS = {
    "dora-without-magnitudes": (dict(config_edit=lambda c: c.update(use_dora=True)), "lora_magnitude_vector is missing"),
    "embed-target": (dict(config_edit=lambda c: c.update(target_modules=["q_proj", "embed_tokens"])), "embed_tokens"),
    "lm-head-target": (dict(config_edit=lambda c: c.update(target_modules=["lm_head"])), "lm_head"),
    "modules-to-save": (dict(config_edit=lambda c: c.update(modules_to_save=["lm_head"])), "modules_to_save"),
    "rank-too-large": (dict(tensors_edit=_grow_rank, config_edit=lambda c: c.update(r=20)), "max_lora_rank"),
    "wrong-shape": (dict(tensors_edit=_wrong_shape), "do not fit the base model"),
    "misplaced-module": (dict(tensors_edit=_misplace_module), "'q_proj'.* is not supported"),
    "pickle": (dict(after=_pickle_only), "pickle"),
    "corrupt": (dict(after=_corrupt), "safetensors"),
    "truncated": (dict(after=_truncate), "safetensors"),
    "missing-config": (dict(after=lambda d: (d / "adapter_config.json").unlink()), "adapter_config.json"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_adapters_are_refused_and_leave_engine_untouched(models, adapters, tmp_path, case):
    engine = build_engine(models["llama"], {"qv8": adapters["llama"]["qv8"]}, compile=False)
    before_out = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True), adapters=["qv8"])
    before_list = engine.adapters.list()
    kwargs, expected = REFUSALS[case]
    after = kwargs.pop("after", None)
    bad = _variant(adapters["llama"]["all4"], tmp_path / case, **kwargs)
    if after:
        after(bad)
    with pytest.raises(AdapterError, match=expected):
        engine.adapters.register("bad", str(bad))
    assert "bad" not in engine.adapters
    assert engine.adapters.list() == before_list
    assert engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=8, ignore_eos=True), adapters=["qv8"]) == before_out


def test_regex_target_modules_are_matched_where_the_modules_live(models, adapters, tmp_path):
    """A PEFT regex is matched against each module's path in the model (model.PROJECTIONS): one naming only the
    attention modules selects no embedding or head, so the adapter is accepted."""
    engine = build_engine(models["llama"], compile=False)
    qv = _variant(adapters["llama"]["qv8"], tmp_path / "regex", config_edit=lambda c: c.update(target_modules=".*self_attn.*"))
    assert engine.adapters.register("regex", str(qv)).target_modules == ("q_proj", "v_proj")


def test_adapter_roots_confine_paths(models, adapters, tmp_path):
    engine = build_engine(models["llama"], compile=False, adapter_roots=(str(adapters["llama"]["qv8"].parent),))
    engine.adapters.register("ok", str(adapters["llama"]["qv8"]))
    outside = shutil.copytree(adapters["llama"]["qv8"], tmp_path / "outside")
    with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
        engine.adapters.register("escape", str(outside))
    link = adapters["llama"]["qv8"].parent / "link-out"
    link.symlink_to(outside)
    try:
        with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
            engine.adapters.register("symlink", str(link))
        with pytest.raises(AdapterError, match="outside the allowed adapter roots"):
            engine.adapters.register("dotdot", str(adapters["llama"]["qv8"] / ".." / ".." / ".." / outside.name))
    finally:
        link.unlink()


# --- device slots --------------------------------------------------------------------------------------

def test_slots_pin_running_adapters_and_evict_lru(models, adapters):
    engine = build_engine(models["llama"], adapters["llama"], compile=False, max_loras_per_batch=2)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = {n: engine.generate([PROMPTS[1]], sp, adapters=[n])[0] for n in ADAPTER_SPECS}
    a, b, c = (Sequence(i, PROMPTS[1], sp, n) for i, n in enumerate(ADAPTER_SPECS))
    assert engine.try_admit(a) and engine.try_admit(b)
    assert not engine.try_admit(c), "both slots are pinned by running sequences: the third adapter must wait"
    assert not c.is_admitted and engine.num_running == 2
    with pytest.raises(AdapterInUseError):
        engine.adapters.unregister(a.adapter)
    engine.step([a, b])
    engine.release(a)
    assert engine.try_admit(c)  # evicts a's adapter (unpinned, least recently used)
    slots = {i.name: i.device_slot for i in engine.adapters.list()}
    assert slots[a.adapter] is None and slots[c.adapter] is not None
    running = [b, c]
    while running:
        engine.step(running)
        engine.release_finished(running)
    assert b.output_ids == alone[b.adapter] and c.output_ids == alone[c.adapter]
    # a's adapter comes back from the host cache and still gives its own tokens
    assert engine.generate([PROMPTS[1]], sp, adapters=[a.adapter])[0] == alone[a.adapter]
    with pytest.raises(AdapterNotFoundError):
        engine.try_admit(Sequence(9, PROMPTS[1], sp, "nope"))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks and engine.adapters.num_free_slots == 2
