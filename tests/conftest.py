"""Shared fixtures: tiny checkpoints and PEFT adapters made here, and compiled engines built once per session."""
from __future__ import annotations

import os
from pathlib import Path

# Each pytest-xdist worker (scripts/test.sh runs two) and every process it starts gets its share of the cores: with
# OpenMP's default of one thread per core in each, two workers on 2 cores run 4 spinning threads on 2 cores, and a
# compute-bound test took ~5x its time alone. Set before torch is imported: OpenMP reads it once, at load.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

import pytest  # noqa: E402

from lora_compile import Engine, EngineConfig  # noqa: E402
from tests.checkpoints import make_peft_adapter, make_tiny_model  # noqa: E402

# Kept between runs (and shared by all tests of a run) so compiled graphs are generated once.
INDUCTOR_CACHE = os.environ.get("LORA_SERVE_TEST_INDUCTOR_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "inductor"))

# Three adapters that differ in rank, targets and scaling rule (one rsLoRA).
ADAPTER_SPECS = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), seed=11),
    "all4": dict(r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), seed=12),
    "mlp16rs": dict(r=16, lora_alpha=8, use_rslora=True, target_modules=("o_proj", "gate_proj", "up_proj", "down_proj"), seed=13),
}
# float32: the exact reference for the golden tests ("auto" is bfloat16 on CPUs that compute it natively).
ENGINE_LIMITS = dict(dtype="float32", max_num_seqs=6, max_seq_len=192, max_num_batched_tokens=24, max_loras_per_batch=3, max_lora_rank=16)


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": make_tiny_model(root / "llama", "llama", seed=0),
        "qwen2": make_tiny_model(root / "qwen2", "qwen2", seed=1, tie_word_embeddings=True),
    }


@pytest.fixture(scope="session")
def adapters(models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        arch: {name: make_peft_adapter(base, root / arch / name, **spec) for name, spec in ADAPTER_SPECS.items()}
        for arch, base in models.items()
    }


def build_engine(model_dir: Path, adapter_dirs: dict[str, Path] | None = None, *, compile: bool, **limits) -> Engine:
    engine = Engine(EngineConfig(model=str(model_dir), compile=compile, inductor_cache_dir=INDUCTOR_CACHE,
                                 **(ENGINE_LIMITS | limits)))
    for name, path in (adapter_dirs or {}).items():
        engine.adapters.register(name, str(path))
    engine.warmup()
    return engine


@pytest.fixture(scope="session")
def compiled_engines(models, adapters):
    """One compiled engine per architecture, shared by every test that needs one."""
    cache: dict[str, Engine] = {}

    def get(arch: str) -> Engine:
        if arch not in cache:
            cache[arch] = build_engine(models[arch], adapters[arch], compile=True)
        return cache[arch]

    return get


@pytest.fixture(scope="module")
def client(served):
    """The official OpenAI client for the HTTP door of the module's `served` server (a module that serves
    something else under that name defines its own `client`)."""
    from tests.service_harness import openai_client  # (the engine-only tests need no server harness)

    with openai_client(served) as c:
        yield c


# --- how scripts/test.sh spreads the files over its two workers (pytest-xdist, --dist loadfile) ----------------
# The files whose tests share `compiled_engines` run in one worker, so each tiny model is compiled once a run
# (a cold compile is ~70 s of a 2-core machine; two workers compiling the same graph at once pay it twice).
COMPILED_ENGINE_FILES = ("test_cuda.py", "test_engine_compile.py", "test_engine_golden.py", "test_isolation.py",
                         "test_kv_cache.py", "test_lora.py")
# The longest work units start first (longest-processing-time order), so no worker is left with one long file
# while the other idles at the end. From `scripts/test.sh --durations=0` on 2 cores, longest first; files not
# listed follow in collection order.
LONGEST_FIRST = ("compiled engines", "test_benchmarks_run.py", "test_model_families.py", "test_real_demo.py",
                 "test_soak.py", "test_scaleout.py", "test_fuzz.py", "test_faults.py", "test_service_process.py",
                 "test_service_on_demand.py", "test_service_generate.py", "test_tool_calls.py", "test_connections.py")


def work_unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its file, or the compiled-engine group."""
    name = Path(nodeid.split("::", 1)[0]).name
    return "compiled engines" if name in COMPILED_ENGINE_FILES else name


def pytest_collection_modifyitems(items):
    rank = {unit: i for i, unit in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(work_unit(item.nodeid), len(rank)))  # stable: file order kept within


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a run without xdist ignores it
def pytest_xdist_make_scheduler(config, log):
    """loadfile over work_unit(), units handed out in collection order (LONGEST_FIRST), not by test count."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class WorkUnitScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return WorkUnitScheduling(config, log)
