"""Hostile adapter files through the real server, both doors (gRPC SDK, openai SDK on the HTTP door), adapters
served on demand from an adapter directory: regexes that backtrack or do not parse, configs nested deep or too
big, safetensors headers out of bounds, weights that overflow at run time. Each gets a precise status
(FAILED_PRECONDITION / 400) naming what to fix, is read once, and costs the other tenants nothing; LoadAdapter
stays inside the adapter directories."""
from __future__ import annotations

import json
import shutil
import struct
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from peft.utils.other import get_pattern_key
from safetensors.torch import load_file, save_file

import service.runner.engine_thread as engine_thread
from lora_compile.lora.adapter_config import MAX_CONFIG_BYTES, MAX_CONFIG_DEPTH, PatternTable
from lora_compile.lora.adapters import MAX_HEADER_BYTES
from lora_compile.config import ModelConfig
from lora_compile.model.causal_lm import LORA_TARGETS
from service.client import FailedPreconditionError, InvalidArgumentError
from service.server import ServerConfig
from tests.http_wire import post
from tests.service_harness import BackgroundStream, ServerThread, build_engine, demo_paths, openai_client, wait_for
from tests.test_isolation import CONFIG, WEIGHTS, edited_adapter, overflowing_adapter

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hostile") / "adapters"


@pytest.fixture(scope="module")
def served(library):
    """On-demand adapters from `library` only (no --adapter-root), "pirate" registered from elsewhere (as
    --adapter registers it), and a host cache that keeps only the newest adapter."""
    library.mkdir()
    model, demo = demo_paths()
    engine = build_engine(model, {"pirate": demo["pirate"]}, adapter_dirs=(str(library),), max_cpu_lora_bytes=1)
    server = ServerThread(engine, ServerConfig(port=0, http_port=0))
    yield server
    server.stop()


def _config(**changes) -> str:
    raw = json.loads((demo_paths()[1]["pirate"] / CONFIG).read_text())
    return json.dumps(raw | changes)


def _with_config(library: Path, name: str, text: str) -> str:
    edited_adapter(demo_paths()[1]["pirate"], library / name, text)
    return name


def _loads(server: ServerThread) -> int:
    return server.engine.adapters.loader.num_loads


def _tokens(stream: BackgroundStream) -> int:
    return sum(len(c.token_ids) for c in stream.chunks)


def _refused_on_both_doors(server: ServerThread, name: str, *says: str, streaming: bool = False) -> None:
    """gRPC: FAILED_PRECONDITION; HTTP: 400 failed_precondition (streaming too: before the stream starts); the
    message says `says`."""
    with server.client() as client, pytest.raises(FailedPreconditionError) as info:
        client.complete(PROMPT, adapter=name, max_new_tokens=2)
    assert all(s in info.value.message for s in says), info.value.message
    with openai_client(server) as http:
        for stream in (False, True) if streaming else (False,):
            with pytest.raises(openai.BadRequestError) as error:
                http.completions.create(model=name, prompt=PROMPT, max_tokens=2, stream=stream)
            body = error.value.body  # OpenAI's error object
            assert error.value.status_code == 400 and body["code"] == "failed_precondition", body
            assert all(s in body["message"] for s in says), body


def _health(server: ServerThread) -> None:
    with server.client() as client:
        assert client.health() == "SERVING"
    status, body, _ = post(server.server.http_port, "/health", b"", method="GET")
    assert status == 200, body


def test_target_modules_patterns_are_matched_in_linear_time(served, library):
    """"(.+)+X" (exponential for a backtracking engine on every module path, and matching none) and "(" (not a
    regex) are refused naming target_modules; "(.+)+(q|v)_proj" (as slow for backtracking on the paths it does
    not match) is a valid config. A concurrent stream gains tokens across the three requests, and each is answered
    while it still runs; both health endpoints answer."""
    cases = {"unbalanced": ("(", "is not a valid regular expression (missing ): ("),
             "valid-but-slow-to-backtrack": ("(.+)+(q|v)_proj", None),
             "backtracks": ("(.+)+X", "matches no module of the model")}
    for name, (pattern, _) in cases.items():
        _with_config(library, name, _config(target_modules=pattern))
    other, n = _other_tenant(served)
    before = _tokens(other)
    for name, (pattern, says) in cases.items():
        if says is None:
            with served.client() as client:
                assert len(client.complete(PROMPT, adapter=name, max_new_tokens=4, ignore_eos=True).token_ids) == 4
        else:
            _refused_on_both_doors(served, name, "target_modules", repr(pattern), says)
        _health(served)
    during = _tokens(other)
    assert before < during < n, (before, during)  # it kept stepping, and was still running when all were answered
    other.stop()
    served.wait_idle()


def _other_tenant(served: ServerThread) -> tuple[BackgroundStream, int]:
    """Another tenant's stream (the base model), long enough to outlast what the test does beside it."""
    prompt = served.engine.tokenizer.encode(PROMPT)
    n = served.engine.config.max_seq_len - len(prompt)
    other = BackgroundStream(served, prompt, max_new_tokens=n, ignore_eos=True)
    wait_for(lambda: _tokens(other) >= 2, what="the other tenant's first tokens")
    return other, n


def _check_unaffected(served: ServerThread, other: BackgroundStream) -> None:
    """The other tenant, stopped now, got what it gets alone (as far as it went)."""
    tokens = other.stop()
    prompt = served.engine.tokenizer.encode(PROMPT)
    assert tokens == served.reference(prompt, None, len(tokens), ignore_eos=True)
    served.wait_idle()


@pytest.mark.parametrize("case", ["nested", "oversize"])
def test_nested_or_oversize_config_is_refused_and_read_once(served, library, case):
    if case == "nested":  # 100 000 levels: Python's json raises RecursionError near 1000
        text = _config(target_modules="@")[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}"
        says = f"nests JSON arrays / objects more than {MAX_CONFIG_DEPTH} levels deep"
    else:  # otherwise a valid config
        text = _config(padding="x" * MAX_CONFIG_BYTES)
        says = f"may be at most {MAX_CONFIG_BYTES} bytes"
    name = _with_config(library, case, text)
    loads = _loads(served)
    _refused_on_both_doors(served, name, f"adapter {name!r}", CONFIG, says, streaming=True)
    assert _loads(served) == loads + 1  # the failure is remembered: three more requests, no second read
    _health(served)
    served.wait_idle()


def _model_config() -> ModelConfig:
    return ModelConfig.from_dir(demo_paths()[0])


_MAX_TENSORS = 3 * len(LORA_TARGETS) * _model_config().num_hidden_layers  # lora_A, lora_B, DoRA magnitude


@pytest.mark.parametrize("case, says", [
    ("too-many-tensors", f"holds {_MAX_TENSORS + 8} tensors; a LoRA adapter of this model holds at most "
                         f"{_MAX_TENSORS}"),
    ("long-name", "is not a supported LoRA weight"),
    ("huge-header", f"its header is {MAX_HEADER_BYTES + 1} bytes; at most {MAX_HEADER_BYTES}"),
    ("huge-file", "an adapter of this model with rank at most 16 (max_lora_rank) takes at most"),
])
def test_safetensors_header_is_bounded(served, library, case, says):
    src, dst = demo_paths()[1]["pirate"], library / case
    shutil.copytree(src, dst)
    weights = dst / WEIGHTS
    tensors = load_file(str(weights))
    first = next(iter(tensors.values()))
    if case == "too-many-tensors":  # (any name: the count is checked first)
        tensors |= {f"extra.{i}": first.clone() for i in range(_MAX_TENSORS + 8 - len(tensors))}
    elif case == "long-name":  # (a backtracking matcher would accept it: a second lora_A of that module)
        tensors["model.layers.0.self_attn.q_proj.lora_A." + "n" * 5000 + ".weight"] = first.clone()
    if case in ("too-many-tensors", "long-name"):
        save_file(tensors, str(weights))
    elif case == "huge-header":  # a length prefix over the limit, then as many bytes (the file is not truncated)
        weights.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b" " * (MAX_HEADER_BYTES + 1))
    else:
        with weights.open("ab") as f:
            f.truncate(64 << 20)  # sparse: larger than any rank-16 adapter of the demo model
    loads = _loads(served)
    _refused_on_both_doors(served, case, f"adapter {case!r}", WEIGHTS, says)
    assert _loads(served) == loads + 1
    served.wait_idle()


def test_overflowing_weights_mark_the_adapter_bad_at_its_first_failure(served, library, monkeypatch):
    """Weights that pass validation (finite, finite once scaled) but overflow at run time: the requests in flight
    for it get FAILED_PRECONDITION saying so, later ones (both doors) are refused before they run, the files are
    not read again, and the other tenant's stream is unaffected."""
    engine = served.engine
    overflowing_adapter(demo_paths()[1]["pirate"], library / "overflow", scale=1e25)
    stepped: list[set] = []
    real_step = engine.step

    def recording_step(plan, *args, **kwargs):  # the scheduler's SchedulerOutput, or a reference run's list
        stepped.append({s.adapter for s in getattr(plan, "scheduled", plan)})
        return real_step(plan, *args, **kwargs)

    monkeypatch.setattr(engine, "step", recording_step)
    other, _ = _other_tenant(served)

    def bad_request():
        with served.client() as client, pytest.raises(FailedPreconditionError) as info:
            client.complete(PROMPT, adapter="overflow", max_new_tokens=8)
        return info.value.message

    with ThreadPoolExecutor(3) as pool:  # in flight together: the one that overflows first and the others
        messages = list(pool.map(lambda _: bad_request(), range(3)))
    says = ("adapter 'overflow' produces non-finite values (NaN or infinity)", "fixed or replaced")
    assert all(s in m for m in messages for s in says), messages
    ran, loads = sum("overflow" in s for s in stepped), _loads(served)
    assert ran >= 1
    _refused_on_both_doors(served, "overflow", *says, streaming=True)
    assert sum("overflow" in s for s in stepped) == ran  # refused before running
    assert _loads(served) == loads  # and not read again
    _check_unaffected(served, other)
    # New files: read again, and served.
    shutil.rmtree(library / "overflow")
    shutil.copytree(demo_paths()[1]["pirate"], library / "overflow")
    with served.client() as client:
        assert len(client.complete(PROMPT, adapter="overflow", max_new_tokens=3, ignore_eos=True).token_ids) == 3
    served.wait_idle()


def test_load_adapter_stays_inside_the_adapter_directories(served, library, tmp_path):
    """With only --adapter-dir set, LoadAdapter accepts nothing outside it; inside, it loads. "pirate", registered
    from outside it as --adapter registers adapters, still works once evicted from host memory and its device
    slot: its next request reads it again from where it is."""
    poet = demo_paths()[1]["poet"]
    outside = shutil.copytree(poet, tmp_path / "poet")
    with served.client() as client:
        with pytest.raises(InvalidArgumentError) as info:
            client.load_adapter("escapee", str(outside))
        assert [v.field for v in info.value.field_violations] == ["path"]
        assert "outside the adapter roots" in info.value.message and str(library) in info.value.message
        assert "escapee" not in {a.name for a in client.list_adapters()}
        shutil.copytree(poet, library / "poet-copy")
        assert client.load_adapter("poet2", str(library / "poet-copy")).name == "poet2"
        client.unload_adapter("poet2")

    engine = served.engine
    prompt = engine.tokenizer.encode(PROMPT)
    reference = served.reference(prompt, "pirate", 4, ignore_eos=True)
    for i in range(2):  # two device slots, and a host cache that keeps the newest adapter only
        shutil.copytree(poet, library / f"evictor-{i}")
    with served.client() as client:
        for i in range(2):
            client.complete(prompt, adapter=f"evictor-{i}", max_new_tokens=1)
        assert "pirate" not in engine.adapters.host_names() + engine.adapters.device_names()
        loads = _loads(served)
        assert client.complete(prompt, adapter="pirate", max_new_tokens=4, ignore_eos=True).token_ids == reference
        assert _loads(served) == loads + 1
    served.wait_idle()


def test_adapter_files_are_read_on_the_loader_threads_only(served, library, monkeypatch):
    """Every read of adapter files runs on the loader's threads, even for an adapter that leaves host memory
    between admission's check and its copy into a device slot (made to happen: right after the check, another
    adapter is read into the host cache, which keeps the newest only)."""
    manager = served.engine.adapters
    for name in ("raced", "evictor"):
        shutil.copytree(demo_paths()[1]["poet"], library / name)
    readers, evicted, real_read, real_ready = [], [], manager.read, manager.is_ready

    def recording_read(*args, **kwargs):
        readers.append(threading.current_thread().name)
        return real_read(*args, **kwargs)

    def evicted_after_check(name):
        ready = real_ready(name)
        if name == "raced" and ready and not evicted and threading.get_ident() == engine_thread.ident():
            evicted.append(manager.prefetch("evictor").result())  # admission's check passed; now it is gone
        return ready

    monkeypatch.setattr(manager, "read", recording_read)
    monkeypatch.setattr(manager, "is_ready", evicted_after_check)
    with served.client() as client:
        assert len(client.complete(PROMPT, adapter="raced", max_new_tokens=2, ignore_eos=True).token_ids) == 2
    assert evicted and readers and all(name.startswith("adapter-loader") for name in readers), readers
    served.wait_idle()


PATTERN_KEYS = ["q_proj", "v_proj", "self_attn.q_proj", "layers.1.self_attn.q_proj", "model.layers.0.mlp.up_proj",
                r"layers\.\d+\.mlp\..*", "q_proj|down_proj", "layers.1.*", ".*_proj", "up", "1.mlp.up_proj",
                "layers.0", "mlp", "o_proj|gate"]


def test_rank_and_alpha_patterns_match_as_peft_does():
    """rank_pattern / alpha_pattern keys pick the same entry as PEFT's get_pattern_key for every module path: the
    first key, in order, that matches the end of the path as a regex (an alternation as a whole)."""
    for keys in (PATTERN_KEYS, PATTERN_KEYS[::-1], *([k] for k in PATTERN_KEYS)):
        table = PatternTable({k: i for i, k in enumerate(keys)}, "test", "rank_pattern")
        for layer in range(3):
            for path in LORA_TARGETS.values():
                module_path = f"model.layers.{layer}.{path}"
                peft_key = get_pattern_key(keys, module_path)
                expected = keys.index(peft_key) if peft_key in keys else None
                assert table.get(module_path, None) == expected, (keys, module_path)
