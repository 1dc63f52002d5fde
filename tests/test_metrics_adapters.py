"""Per-adapter series on /metrics are bounded by memory, not by history: after requests naming hundreds of
on-demand adapters, lora_serve:lora_adapter_resident lists exactly the adapters in a device slot or in the host
cache at the time of the scrape, never more than the slots and --max-cpu-lora-bytes hold, and an adapter that leaves
memory leaves the next scrape. The suite names N_ADAPTERS of them (prefetched, and a share through real Generate
calls); `python -m benchmarks.metric_series` sends the 2,000 of issue #31 to a server process."""
from __future__ import annotations

import pytest

from benchmarks.common import write_lora_adapter
from lora_compile.lora.adapters import load_adapter
from lora_compile.config import ModelConfig
from service.server import ServerConfig
from tests.http_wire import metric_value, metrics
from tests.service_harness import ServerThread, build_engine, demo_paths

N_ADAPTERS = 200
HOST_ADAPTERS = 6   # what the host cache's byte budget holds
GENERATE_EVERY = 50  # one adapter in this many is first named by a Generate call, the others by a prefetch
SCRAPE_EVERY = 25


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """N_ADAPTERS names for one small adapter's files (links inside the directory: cheap to make and to read)."""
    model, _ = demo_paths()
    root = tmp_path_factory.mktemp("series") / "adapters"
    write_lora_adapter(model, root / "base", rank=8, seed=3, modules=("q_proj", "v_proj"))
    for i in range(N_ADAPTERS):
        (root / _name(i)).symlink_to("base", target_is_directory=True)
    return root


def _name(i: int) -> str:
    return f"tenant-{i:04d}"


def _resident_series(samples: dict) -> set[tuple[str, str]]:
    return {(s.labels["adapter"], s.labels["tier"]) for s in samples.get("lora_serve:lora_adapter_resident", [])}


def test_resident_series_are_the_adapters_in_memory_now(adapter_dir):
    model, _ = demo_paths()
    size = load_adapter("base", adapter_dir / "base", ModelConfig.from_dir(model), 16).nbytes
    engine = build_engine(model, {}, adapter_dirs=(str(adapter_dir),), max_cpu_lora_bytes=HOST_ADAPTERS * size)
    server = ServerThread(engine, ServerConfig(port=0, http_port=0))
    bound = HOST_ADAPTERS + engine.config.max_loras_per_batch
    prompt = engine.tokenizer.encode("Hi")
    scraped = []
    try:
        with server.client() as client:
            for i in range(N_ADAPTERS):
                if i % GENERATE_EVERY == GENERATE_EVERY - 1:  # (the last one too: its steps report the loads)
                    client.complete(prompt, adapter=_name(i), max_new_tokens=1)
                else:
                    client.load_adapter(_name(i))  # a prefetch: read into host memory
                if i % SCRAPE_EVERY == SCRAPE_EVERY - 1:
                    server.wait_idle()
                    samples = metrics(server.server.http_port)
                    device, host = engine.adapters.residency()
                    series = _resident_series(samples)
                    assert series == {(n, "device") for n in device} | {(n, "host") for n in host}
                    assert 0 < len(series) <= bound
                    scraped.append(series)
        # Every adapter was in memory once; the early ones have left it, and the scrape.
        assert _name(0) not in {name for name, _ in scraped[-1]}
        assert {name for series in scraped for name, _ in series} >= {_name(SCRAPE_EVERY * k - 1)
                                                                     for k in range(1, len(scraped) + 1)}
        assert len({name for series in scraped for name, _ in series}) > bound
        assert metric_value(samples, "lora_serve:lora_adapter_evictions_total", tier="host") >= (
            N_ADAPTERS - HOST_ADAPTERS)
        # The tier gauge counts every known adapter in three series, whatever their number.
        tiers = {s.labels["tier"]: s.value for s in samples["lora_serve:lora_adapters"]}
        assert len(tiers) == 3 and sum(tiers.values()) == len(engine.adapters.list()) >= N_ADAPTERS
    finally:
        server.stop()


def test_resident_series_are_capped_by_count(adapter_dir):
    """With room in host memory for many adapters, --max-adapter-metric-series bounds the series all the same: the
    adapters in a device slot first, then host ones, the rest counted in one adapter="other" series per tier."""
    model, _ = demo_paths()
    engine = build_engine(model, {}, adapter_dirs=(str(adapter_dir),))
    cap = 5
    server = ServerThread(engine, ServerConfig(port=0, http_port=0, max_adapter_metric_series=cap))
    prompt = engine.tokenizer.encode("Hi")
    try:
        with server.client() as client:
            client.complete(prompt, adapter=_name(0), max_new_tokens=1)  # one in a device slot
            for i in range(1, 40):
                client.load_adapter(_name(i))
            server.wait_idle()
            device, host = engine.adapters.residency()
            assert len(device) + len(host) >= 40
            samples = metrics(server.server.http_port)
        series = samples["lora_serve:lora_adapter_resident"]
        named = [s for s in series if s.labels["adapter"] != "other"]
        assert len(named) == cap and {s.labels["adapter"] for s in named} >= set(device)
        other = {s.labels["tier"]: s.value for s in series if s.labels["adapter"] == "other"}
        assert sum(other.values()) == len(device) + len(host) - cap
    finally:
        server.stop()
