"""On-demand adapters through the real gRPC server: adapters read from --adapter-dir on first use, on the loader
threads, while other streams keep stepping; names checked before any file access; one load per cold adapter;
a bad adapter fails only its own requests; the host cache's byte budget; no slot leaked after a storm."""
from __future__ import annotations

import random
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.common import write_lora_adapter
from lora_compile.lora.adapters import load_adapter
from lora_compile.config import ModelConfig
from service.client import FailedPreconditionError, InvalidArgumentError, NotFoundError
from service.server import ServerConfig
from tests.http_wire import metric_value, metrics
from tests.service_harness import (
    BackgroundStream,
    ServerThread,
    build_engine,
    demo_paths,
    wait_for,
)

N_ADAPTERS = 300
MODULES = ("q_proj", "v_proj")


def _name(i: int) -> str:
    return f"tenant-{i:03d}"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """Hundreds of small adapters (rank 8 and 16), one bad one, and two names that lead outside the directory."""
    model, _ = demo_paths()
    root = tmp_path_factory.mktemp("adapters")
    library = root / "dir"
    for i in range(N_ADAPTERS):
        write_lora_adapter(model, library / _name(i), rank=8 if i % 2 else 16, seed=i, modules=MODULES)
    outside = write_lora_adapter(model, root / "outside", rank=8, seed=999, modules=MODULES)
    (library / "escape").symlink_to(outside, target_is_directory=True)
    write_lora_adapter(model, library / "broken", rank=8, seed=5, modules=MODULES)
    weights = library / "broken" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated
    return library


@pytest.fixture(scope="module")
def served(adapter_dir):
    model, demo = demo_paths()
    engine = build_engine(model, {"pirate": demo["pirate"]}, adapter_dirs=(str(adapter_dir),))
    server = ServerThread(engine, ServerConfig(port=0, http_port=0))  # the HTTP door for /metrics
    yield server
    server.stop()


def _loads(server: ServerThread) -> int:
    return server.engine.adapters.loader.num_loads


def _step_time(server: ServerThread, prompt: list[int]) -> float:
    """Seconds per decode step of one stream here, now (waits in tests are multiples of it)."""
    with server.client() as client:
        t0 = time.perf_counter()
        client.complete(prompt, max_new_tokens=1)
        t1 = time.perf_counter()
        client.complete(prompt, max_new_tokens=17, ignore_eos=True)
        return max(1e-3, (time.perf_counter() - t1 - (t1 - t0)) / 16)


def test_prometheus_counts_adapter_loads_and_tiers(served):
    """/metrics: a cold adapter's read and slot copy are counted and timed; the tier gauge holds it."""
    name = _name(251)
    before = metrics(served.server.http_port)
    with served.client() as client:
        client.complete("Hello", adapter=name, max_new_tokens=2)
    after = metrics(served.server.http_port)

    def delta(metric: str, **labels) -> float:
        return metric_value(after, metric, **labels) - metric_value(before, metric, **labels)

    assert delta("lora_serve:lora_adapter_loads_total", result="ok") == 1
    assert delta("lora_serve:lora_adapter_load_seconds_count", phase="disk_read") == 1
    assert delta("lora_serve:lora_adapter_load_seconds_count", phase="device_copy") == 1
    tiers = {s.labels["tier"]: s.value for s in after["lora_serve:lora_adapters"]}
    assert tiers["device"] >= 1 and sum(tiers.values()) == len(served.engine.adapters.list())


def test_on_demand_adapter_matches_registered_one(served, adapter_dir):
    tok = served.engine.tokenizer
    prompt = tok.encode("Once upon a time")
    name = _name(7)
    with served.client() as client:
        info = client.model_info()
        assert info.on_demand_adapters and info.max_loras_per_batch == 2 and info.max_cpu_lora_bytes > 0
        assert name not in {a.name for a in client.list_adapters()}  # not read yet: unknown until first use
        loads = _loads(served)
        tokens = client.complete(prompt, adapter=name, max_new_tokens=8, ignore_eos=True).token_ids
        assert _loads(served) == loads + 1
        listed = {a.name: a for a in client.list_adapters()}[name]
        assert listed.on_demand and listed.tier in ("device", "host") and listed.rank == 8 and listed.host_bytes > 0
        assert listed.path == str(adapter_dir / name)
        client.load_adapter("same-registered", str(adapter_dir / name))
        assert client.complete(prompt, adapter="same-registered", max_new_tokens=8,
                               ignore_eos=True).token_ids == tokens
        assert tokens != client.complete(prompt, max_new_tokens=8, ignore_eos=True).token_ids  # it does something
        client.unload_adapter("same-registered")
        with pytest.raises(NotFoundError):
            client.complete(prompt, adapter="no-such-tenant", max_new_tokens=1)
    served.wait_idle()


class _OpenAudit:
    """Every file opened by this process while on (sys.addaudithook: "open" events, any thread)."""

    def __init__(self):
        self.on, self.opened = False, []
        sys.addaudithook(self._hook)

    def _hook(self, event, args):
        if self.on and event in ("open", "os.listdir", "os.scandir"):
            self.opened.append(str(args[0]))


def test_bad_names_refused_before_any_file_is_opened(served, adapter_dir):
    audit = _OpenAudit()
    prompt = served.engine.tokenizer.encode("Hi")
    bad = {name: "is not allowed: use 1 to 128 letters" for name in
           ("../outside", "a/b", ".hidden", "x" * 129, "a\x00b", "..", "tenant\\000", "pirate\n", "\u202epirate")}
    loads = _loads(served)
    with served.client() as client:
        for name, says in bad.items():
            audit.on = True
            try:
                with pytest.raises(InvalidArgumentError) as info:
                    client.complete(prompt, adapter=name, max_new_tokens=1)
            finally:
                audit.on = False
            assert says in info.value.message, (name, info.value.message)
            touched = [p for p in audit.opened if str(adapter_dir.parent) in p]
            assert touched == [], (name, touched)
        with pytest.raises(InvalidArgumentError) as info:  # a symlink out of the directory: refused, not read
            client.complete(prompt, adapter="escape", max_new_tokens=1)
        assert "outside the adapter directory" in info.value.message
        with pytest.raises(InvalidArgumentError):
            client.load_adapter("../outside")
    assert _loads(served) == loads  # nothing was read


def test_slow_load_keeps_other_streams_stepping(served, monkeypatch):
    """A cold adapter whose read is held until the test lets it go: a running stream keeps gaining tokens while it
    is held, and a request that arrived after the cold one (for a warm adapter) is admitted and finishes before it
    is let go. Order, not time: a warm request queued behind the load could not finish while the read is held."""
    loader = served.engine.adapters.loader
    prompt = served.engine.tokenizer.encode("Once upon a time")
    release = threading.Event()
    read = loader._read

    def held_read(name: str, path: str):
        release.wait(timeout=120)  # bounded: a request wrongly queued behind the load fails the test, not hangs it
        return read(name, path)

    monkeypatch.setattr(loader, "_read", held_read)
    cold = _name(11)
    try:
        running = BackgroundStream(served, prompt, max_new_tokens=200, ignore_eos=True)
        wait_for(lambda: len(running.chunks) >= 3, what="the running stream's first tokens")
        cold_stream = BackgroundStream(served, prompt, wait_started=False, adapter=cold, max_new_tokens=4,
                                       ignore_eos=True)
        wait_for(lambda: loader.loading(cold), what="the cold adapter's load")
        before = sum(len(c.token_ids) for c in running.chunks)
        with served.client() as client:  # arrives after the cold one, needs no load: not blocked behind it
            warm = client.complete(prompt, adapter="pirate", max_new_tokens=4, ignore_eos=True)
        assert len(warm.token_ids) == 4 and loader.loading(cold), "the warm request waited for the cold load"
        wait_for(lambda: sum(len(c.token_ids) for c in running.chunks) - before >= 5,
                 what="the running stream's tokens while the cold read is held")
    finally:
        release.set()
    assert len(cold_stream.result()) == 4
    assert len(running.result()) == 200
    served.wait_idle()


def test_concurrent_requests_for_one_cold_adapter_load_it_once(served):
    loader = served.engine.adapters.loader
    prompt = served.engine.tokenizer.encode("The sea")
    loader.delay_s = 10 * _step_time(served, prompt)
    name = _name(21)
    loads = _loads(served)
    try:
        with ThreadPoolExecutor(6) as pool:
            results = list(pool.map(
                lambda _: _complete(served, prompt, adapter=name, max_new_tokens=6, ignore_eos=True), range(6)))
    finally:
        loader.delay_s = 0.0
    assert _loads(served) == loads + 1
    assert all(r == results[0] for r in results) and len(results[0]) == 6
    served.wait_idle()


def _complete(server: ServerThread, prompt, **params) -> list[int]:
    with server.client() as client:
        return client.complete(prompt, **params).token_ids


def test_corrupt_adapter_fails_only_its_own_requests_and_is_not_retried(served, adapter_dir):
    prompt = served.engine.tokenizer.encode("Once upon a time")
    base_reference = served.reference(prompt, None, 40, ignore_eos=True)
    loads = _loads(served)
    base = BackgroundStream(served, prompt, max_new_tokens=40, ignore_eos=True)
    with ThreadPoolExecutor(4) as pool:
        broken = [pool.submit(_complete, served, prompt, adapter="broken", max_new_tokens=4) for _ in range(3)]
        good = pool.submit(_complete, served, prompt, adapter=_name(31), max_new_tokens=4, ignore_eos=True)
        for f in broken:
            with pytest.raises(FailedPreconditionError) as info:
                f.result()
            assert "adapter 'broken' cannot be loaded" in info.value.message
            assert "not a readable safetensors file" in info.value.message
        assert len(good.result()) == 4
    assert base.result() == base_reference
    assert _loads(served) == loads + 2  # one for "broken" (three requests), one for the good adapter
    with served.client() as client, pytest.raises(FailedPreconditionError):
        client.complete(prompt, adapter="broken", max_new_tokens=4)
    assert _loads(served) == loads + 2  # the failure is remembered: no second read of unchanged files
    served.wait_idle()
    repaired = adapter_dir.parent / "repaired"
    write_lora_adapter(demo_paths()[0], repaired, rank=8, seed=5, modules=MODULES)
    shutil.copy(repaired / "adapter_model.safetensors", adapter_dir / "broken" / "adapter_model.safetensors")
    assert len(_complete(served, prompt, adapter="broken", max_new_tokens=4, ignore_eos=True)) == 4
    assert _loads(served) == loads + 3
    served.wait_idle()


def test_host_byte_budget_evicts_least_recently_used(adapter_dir):
    model, _ = demo_paths()
    size = load_adapter(_name(1), adapter_dir / _name(1), ModelConfig.from_dir(model), 16).nbytes  # odd: rank 8
    engine = build_engine(model, {}, adapter_dirs=(str(adapter_dir),), max_cpu_lora_bytes=3 * size)
    server = ServerThread(engine)
    try:
        with server.client() as client:
            for i in (1, 3, 5):
                client.load_adapter(_name(i))  # prefetch: into host memory
            assert engine.adapters.host_names() == [_name(1), _name(3), _name(5)]
            client.load_adapter(_name(1))  # used again: most recent
            client.load_adapter(_name(7))  # over budget: the least recently used (3) goes
            assert engine.adapters.host_names() == [_name(5), _name(1), _name(7)]
            assert engine.adapters.host_bytes <= 3 * size
            tiers = {a.name: a.tier for a in client.list_adapters()}
            assert tiers[_name(3)] == "disk" and tiers[_name(7)] == "host"
            prompt = engine.tokenizer.encode("Hi")
            client.complete(prompt, adapter=_name(3), max_new_tokens=1)  # read again from disk
            assert engine.adapters.host_names()[-1] == _name(3) and _name(5) not in engine.adapters.host_names()
            assert {a.name: a.tier for a in client.list_adapters()}[_name(3)] == "device"
    finally:
        server.stop()


def test_storm_of_cold_adapters_with_random_cancels_leaks_nothing(served):
    rng = random.Random(0)
    prompt = served.engine.tokenizer.encode("Once")
    names = [_name(i) for i in range(N_ADAPTERS)]
    rng.shuffle(names)
    outcomes = {"ok": 0, "cancelled": 0}
    lock = threading.Lock()

    def one(name: str, cancel_after: int | None) -> None:
        with served.client() as client:
            stream = client.generate(prompt, adapter=name, max_new_tokens=6, ignore_eos=True)
            got = 0
            for chunk in stream:
                got += 1
                if cancel_after is not None and got >= cancel_after:
                    stream.close()  # leaving the stream cancels the call
                    with lock:
                        outcomes["cancelled"] += 1
                    return
            with lock:
                outcomes["ok"] += 1

    with ThreadPoolExecutor(24) as pool:
        futures = [pool.submit(one, n, rng.choice([None, None, 1, 2])) for n in names]
        for f in futures:
            f.result()
    assert outcomes["ok"] + outcomes["cancelled"] == N_ADAPTERS and outcomes["cancelled"] > 0
    served.wait_idle(timeout=30)
    assert served.server.runner.num_open_streams == 0
