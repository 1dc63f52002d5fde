"""The paged KV cache as the service shows it, through a real server on both doors: the KV fields of ModelInfo and
/v1/models, prefix-cache hits in usage (gRPC, completions, chat, streaming) and /metrics, KV-cache usage back to 0
when idle, preemptions counted, the names the endpoint picker is told to read, and the serve flags."""
from __future__ import annotations

import argparse
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from service.cli import byte_size, serve_parser
from service.server import ServerConfig
from tests.http_wire import metric_value, metrics, post
from tests.service_harness import BackgroundStream, ServerThread, build_engine, chat_server, demo_paths, wait_for

PICKER = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "inference-gateway" / "inferencepool.yaml"
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A copy of the demo model with a chat template (the demo model has none), so both HTTP endpoints run."""
    server = chat_server(tmp_path_factory.mktemp("kv-model"), CHAT_TEMPLATE)
    yield server
    server.stop()


def _metrics(server: ServerThread) -> dict[str, list]:
    return metrics(server.server.http_port)


def _prompt_ids(server: ServerThread, seed: int, blocks: int = 6) -> list[int]:
    """Token ids no other test sends (random over the vocabulary), `blocks` KV blocks and 3 tokens long."""
    rng = random.Random(seed)
    vocab = server.server.runner.model_info().vocab_size
    return [rng.randrange(3, vocab) for _ in range(blocks * _block_size(server) + 3)]


def _block_size(server: ServerThread) -> int:
    return server.engine.kv_cache.block_size


def _expected_hit(server: ServerThread, n_prompt: int) -> int:
    """vLLM's rule: the full blocks of the prompt but its last token (at least one token is computed)."""
    bs = _block_size(server)
    return (n_prompt - 1) // bs * bs


# --- what is reported ------------------------------------------------------------------------------------------
def test_model_info_and_models_report_the_kv_cache(served):
    kv, cfg = served.engine.kv_cache, served.engine.config
    with served.client() as c:
        info = c.model_info()
    assert (info.num_kv_blocks, info.block_size) == (kv.num_blocks, kv.block_size) and info.num_kv_blocks > 0
    assert info.kv_cache_tokens == info.num_kv_blocks * info.block_size == kv.num_tokens
    assert info.max_num_seqs == info.max_batch_size == cfg.max_num_seqs
    assert info.prefix_caching is True
    status, body, _ = post(served.server.http_port, "/v1/models", b"", method="GET")
    assert status == 200 and {m["id"] for m in body["data"]} == {served.engine.model_name, "pirate"}
    for entry in body["data"]:
        assert (entry["num_kv_blocks"], entry["block_size"], entry["kv_cache_tokens"]) == (
            info.num_kv_blocks, info.block_size, info.kv_cache_tokens)
        assert entry["max_model_len"] == info.max_seq_len


def test_the_picker_reads_metrics_we_serve(served):
    """Every name deploy/kubernetes tells the endpoint picker to read is on /metrics, and cache_config_info says
    what ModelInfo says (the prefix-cache scorer sizes its index from it)."""
    told = re.findall(r"(?m)^\s+[a-zA-Z]+Spec: (\S+)$", PICKER.read_text())  # the picker's engineConfigs
    assert "lora_serve:kv_cache_usage_perc" in told and "lora_serve:cache_config_info" in told
    samples = _metrics(served)
    for name in told:
        assert name in samples, name
    (config,) = samples["lora_serve:cache_config_info"]
    kv = served.engine.kv_cache
    assert config.value == 1 and config.labels == {
        "block_size": str(kv.block_size), "num_gpu_blocks": str(kv.num_blocks), "enable_prefix_caching": "True",
        "cache_dtype": "auto"}
    for name in ("prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"lora_serve:{name}" in samples, name


# --- prefix-cache hits ----------------------------------------------------------------------------------------
def test_a_repeated_prompt_is_served_from_the_prefix_cache_grpc(served):
    ids = _prompt_ids(served, seed=1)
    before = _metrics(served)
    with served.client() as c:
        first = c.complete(ids, max_new_tokens=4, ignore_eos=True)
        served.wait_idle()
        second = c.complete(ids, max_new_tokens=4, ignore_eos=True)
    after = _metrics(served)  # (before the reference below: engine.generate uses the same cache)
    assert first.usage.cached_tokens == 0 and first.usage.prompt_tokens == len(ids)
    assert second.usage.cached_tokens == _expected_hit(served, len(ids)) > 0
    assert second.token_ids == first.token_ids == served.reference(ids, None, 4, ignore_eos=True)

    def delta(name: str) -> float:
        return metric_value(after, name) - metric_value(before, name)

    assert delta("lora_serve:prefix_cache_queries_total") == 2 * len(ids)
    assert delta("lora_serve:prefix_cache_hits_total") == second.usage.cached_tokens


def test_a_prefix_is_shared_per_adapter(served):
    """The same tokens on an adapter miss what the base model cached: its keys and values differ."""
    ids = _prompt_ids(served, seed=2)
    with served.client() as c:
        assert c.complete(ids, max_new_tokens=2).usage.cached_tokens == 0
        assert c.complete(ids, adapter="pirate", max_new_tokens=2).usage.cached_tokens == 0
        assert c.complete(ids, adapter="pirate", max_new_tokens=2).usage.cached_tokens == _expected_hit(
            served, len(ids))


def test_completions_usage_has_cached_tokens(served, client):
    ids = _prompt_ids(served, seed=3)
    model = served.engine.model_name
    first = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    before = _metrics(served)
    second = client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == _expected_hit(served, len(ids))
    assert second.usage.prompt_tokens == len(ids) and second.choices[0].text == first.choices[0].text
    assert metric_value(_metrics(served), "lora_serve:prefix_cache_hits_total") - metric_value(
        before, "lora_serve:prefix_cache_hits_total") == _expected_hit(served, len(ids))
    # Streamed: the usage chunk carries it too.
    chunks = list(client.completions.create(model=model, prompt=ids, max_tokens=3, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens_details.cached_tokens == _expected_hit(
        served, len(ids))


def test_chat_completions_usage_has_cached_tokens(served, client):
    rng = random.Random(4)
    words = " ".join(rng.choice(["tide", "sail", "anchor", "gull", "rope", "harbour", "mast"]) for _ in range(25))
    messages = [{"role": "user", "content": words}]
    model = served.engine.model_name
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    n = first.usage.prompt_tokens
    assert n > 4 * _block_size(served)  # several blocks: the hit below is more than one block
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == _expected_hit(served, n)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == _expected_hit(served, n)
    # Raw JSON, as a client other than the openai package reads it.
    status, body, _ = post(served.server.http_port, "/v1/chat/completions",
                           {"model": model, "messages": messages, "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["prompt_tokens_details"] == {"cached_tokens": _expected_hit(served, n)}


# --- usage of the pool ----------------------------------------------------------------------------------------
def test_kv_cache_usage_rises_while_running_and_returns_to_zero(served):
    ids = _prompt_ids(served, seed=5)
    max_new = 40
    stream = BackgroundStream(served, ids, max_new_tokens=max_new, ignore_eos=True)  # started: it holds blocks
    # Scrapes are served on the event loop between steps: the first comes a step or two after the first token,
    # long before the last of its 40.
    seen = []
    while not stream.chunks or stream.chunks[-1].finish_reason is None:
        seen.append(metric_value(_metrics(served), "lora_serve:kv_cache_usage_perc"))
    assert len(stream.result()) == max_new
    served.wait_idle()
    assert 0 < max(seen) <= 1
    # Its blocks stay cached for a later prompt, but no request holds them: usage is 0.
    assert metric_value(_metrics(served), "lora_serve:kv_cache_usage_perc") == 0


def test_preemptions_are_counted_and_every_stream_completes(served):
    """A pool of 6 blocks and 3 requests that each grow to 4 (19 prompt + 40 new tokens, 16 tokens a block), queued
    together: some are preempted and recomputed, each still gets all its tokens, equal to its solo run, and
    /metrics counts the preemptions."""
    model, _ = demo_paths()
    per_block = served.engine.kv_cache.size.bytes_per_block  # the same model, dtype and block size
    engine = build_engine(model, {}, max_num_seqs=3, max_seq_len=64,
                          kv_cache_memory=7 * per_block)
    assert engine.kv_cache.num_blocks == 6  # (one more block: the null block)
    server = ServerThread(engine, ServerConfig(port=0, http_port=0))
    try:
        rng = random.Random(6)
        prompts = [[rng.randrange(3, 500) for _ in range(19)] for _ in range(3)]
        entered, release = threading.Event(), threading.Event()

        def hold() -> None:  # no step runs until all three wait: they run together whatever the machine's speed
            entered.set()
            release.wait(120)

        held = server.submit(server.server.runner.run_in_engine_thread(hold))
        assert entered.wait(60)
        with server.client() as c, ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(c.complete, p, max_new_tokens=40, ignore_eos=True) for p in prompts]
            wait_for(lambda: server.server.runner.num_waiting == 3, timeout=60, what="three queued requests")
            release.set()
            held.result(60)
            done = [f.result() for f in futures]
        server.wait_idle()  # (every sequence released: the references below need the pool too)
        assert [d.finish_reason for d in done] == ["length"] * 3
        assert [d.token_ids for d in done] == [server.reference(p, None, 40, ignore_eos=True) for p in prompts]
        samples = metrics(server.server.http_port)
        assert metric_value(samples, "lora_serve:num_preemptions_total") == engine.num_preemptions > 0
        assert metric_value(samples, "lora_serve:kv_cache_usage_perc") == 0
    finally:
        server.stop()


# --- the serve flags ------------------------------------------------------------------------------------------
def test_serve_flags_reach_the_engine_config_fields():
    args = serve_parser().parse_args(["--max-batch-size", "5", "--kv-cache-memory", "1.5GiB", "--block-size", "32",
                                      "--no-prefix-caching", "--kv-growth", "reserve",
                                      "--gpu-memory-utilization", "0.5"])
    assert (args.max_num_seqs, args.kv_cache_memory, args.block_size, args.no_prefix_caching, args.kv_growth,
            args.gpu_memory_utilization) == (5, 3 << 29, 32, True, "reserve", 0.5)
    assert serve_parser().parse_args(["--max-num-seqs", "7"]).max_num_seqs == 7
    defaults = serve_parser().parse_args([])
    assert (defaults.max_num_seqs, defaults.kv_cache_memory, defaults.block_size, defaults.kv_growth) == (
        64, None, 16, "lazy")


@pytest.mark.parametrize(("value", "expected"), [("536870912", 1 << 29), ("512MiB", 1 << 29), ("4GiB", 1 << 32),
                                                 ("1.5GB", 1_500_000_000), ("2 kib", 2048), ("100B", 100)])
def test_sizes(value, expected):
    assert byte_size(value) == expected


@pytest.mark.parametrize(("value", "message"), [("4G", "ambiguous: write 4GiB"), ("0", "more than 0 bytes"),
                                                ("lots", "expected a size in bytes"), ("-1GiB", "expected a size"),
                                                ("3PB", "expected a size")])
def test_bad_sizes_are_refused_with_what_to_write(value, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        byte_size(value)


@pytest.mark.parametrize(("flag", "value", "message"), [
    ("--kv-cache-memory", "4G", "argument --kv-cache-memory: '4G' is ambiguous"),
    ("--gpu-memory-utilization", "1.5", "argument --gpu-memory-utilization: expected a fraction in (0, 1]"),
    ("--kv-growth", "eager", "argument --kv-growth: invalid choice: 'eager'"),
])
def test_bad_flags_are_argparse_errors(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_:
        serve_parser().parse_args([flag, value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
