"""Isolation: what one tenant sends (an adapter with bad numbers, weights that overflow, a huge prompt, a stream
it never reads) costs that tenant alone. Through the real gRPC server, against solo references."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_compile import SamplingParams, Sequence
from service._proto import pb, pb_grpc
from service.client import FailedPreconditionError
from service.limits import RequestLimits
from service.server import ServerConfig
from tests.service_harness import BackgroundStream, ServerThread, demo_paths, shared_engine, wait_for

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def overflowing_adapter(src: Path, dst: Path, scale: float = 1e25) -> Path:
    """A copy of `src` whose A and B are multiplied by `scale`: every weight and the scaled B stay finite (it
    loads), but x·A·B overflows float32, so its sequences' activations, K/V entries and logits are inf/NaN."""
    shutil.copytree(src, dst)
    tensors = {k: v * scale for k, v in load_file(str(src / WEIGHTS)).items()}
    assert all(torch.isfinite(t).all() for t in tensors.values())
    save_file(tensors, str(dst / WEIGHTS))
    return dst


def edited_adapter(src: Path, dst: Path, config_text: str) -> Path:
    shutil.copytree(src, dst)
    (dst / CONFIG).write_text(config_text)
    return dst


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine(), ServerConfig(port=0, grace_period_s=10.0))
    yield server
    server.stop()


def _config_with(src: Path, **changes) -> str:
    raw = json.loads((src / CONFIG).read_text())
    raw.update(changes)
    return json.dumps(raw)  # NaN / Infinity written as Python's json writes (and reads) them


# --- adapter numbers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, field", [
    (dict(lora_alpha=float("nan")), "lora_alpha"),
    (dict(lora_alpha=float("inf")), "lora_alpha"),
    (dict(lora_alpha=0), "lora_alpha"),
    (dict(lora_alpha="16"), "lora_alpha"),
    (dict(r=0), "r"),
    (dict(r=2.5), "r"),
    (dict(r=float("nan")), "r"),
    (dict(alpha_pattern={"q_proj": float("nan")}), "alpha_pattern['q_proj']"),
    (dict(rank_pattern={"q_proj": -1}), "rank_pattern['q_proj']"),
    (dict(use_rslora="yes"), "use_rslora"),
])
def test_adapter_config_numbers_are_checked(served, tmp_path, changes, field):
    src = demo_paths()[1]["pirate"]
    path = edited_adapter(src, tmp_path / "bad", _config_with(src, **changes))
    with served.client() as client, pytest.raises(FailedPreconditionError, match=rf": {re.escape(field)} must"):
        client.load_adapter("bad", str(path))
    with served.client() as client:
        assert "bad" not in {a.name for a in client.list_adapters()}


def test_adapter_numbers_written_as_json_extensions(served, tmp_path):
    """1e309 parses as inf, and a rank that disagrees with the tensors is named; a huge but finite alpha that
    makes the scaled B overflow is refused too."""
    src = demo_paths()[1]["pirate"]
    raw = json.loads((src / CONFIG).read_text())
    text = json.dumps(raw).replace(f'"lora_alpha": {json.dumps(raw["lora_alpha"])}', '"lora_alpha": 1e309')
    cases = {
        "lora_alpha": text,
        "r": _config_with(src, r=raw["r"] + 1),
        "overflows": _config_with(src, lora_alpha=1e40),  # finite as a double; B * 1e40 / r is not in float32
    }
    for name, config in cases.items():
        path = edited_adapter(src, tmp_path / name, config)
        with served.client() as client, pytest.raises(FailedPreconditionError, match=name):
            client.load_adapter(name, str(path))


# --- non-finite activations -------------------------------------------------------------------------------
def test_overflowing_adapter_fails_alone_and_its_kv_slot_is_clean(served, tmp_path):
    """An adapter whose activations overflow ends its own request with FAILED_PRECONDITION naming it (and is refused
    from then on: tests/test_hostile_adapters.py); the requests that share its steps, and the batch that reuses
    its KV slot after it is unloaded, equal their solo runs."""
    engine = served.engine
    poison = overflowing_adapter(demo_paths()[1]["pirate"], tmp_path / "poison")
    tok = engine.tokenizer
    long_prompt = tok.encode("The old lighthouse keeper counted the ships that passed in the night " * 3)
    others = [(tok.encode("Once upon a time"), None), (tok.encode("The river"), "poet"),
              (tok.encode("In the beginning there was"), None)]
    n = 24
    refs = [served.reference(p, a, n, ignore_eos=True) for p, a in others]
    with served.client() as admin:
        admin.load_adapter("poison", str(poison))
    try:
        bad = BackgroundStream(served, long_prompt, wait_started=False, adapter="poison", max_new_tokens=n)
        streams = [BackgroundStream(served, p, wait_started=False, adapter=a, max_new_tokens=n, ignore_eos=True)
                   for p, a in others]
        with pytest.raises(FailedPreconditionError, match="adapter 'poison' produces non-finite values"):
            bad.result()
        assert [s.result() for s in streams] == refs
        served.wait_idle()
    finally:
        with served.client() as admin:
            admin.unload_adapter("poison")
    # Every KV slot is reused, short prompts beside long ones: stale positions are read but must stay inert.
    prompts = [tok.encode(t) for t in ("A", "Once upon a time", "The river", "Hi", "In the beginning there was",
                                        "Stars", "The old lighthouse keeper counted", "Go")]
    refs = [served.reference(p, None, n, ignore_eos=True) for p in prompts]
    streams = [BackgroundStream(served, p, wait_started=False, max_new_tokens=n, ignore_eos=True) for p in prompts]
    assert [s.result() for s in streams] == refs
    served.wait_idle()


def test_compiled_engine_isolates_non_finite_sequences(compiled_engines, adapters, tmp_path):
    """The compiled graphs (decode attention as reductions over the cache) are held to the same: the overflowing
    sequence ends with finish_reason "error", the others equal their solo runs, and so does a full batch that
    reuses every KV slot, short prompts beside long ones."""
    engine = compiled_engines("llama")
    poison = overflowing_adapter(adapters["llama"]["all4"], tmp_path / "poison")
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)

    def solo(prompt, adapter):
        return engine.generate([prompt], params, adapters=[adapter])[0]

    others = [([5, 9, 13, 2], None), ([7, 3, 3, 8, 1, 4], "qv8"), ([11] * 9, "mlp16rs")]
    refs = [solo(p, a) for p, a in others]
    engine.adapters.register("poison", str(poison))
    try:
        seqs = [Sequence(100, list(range(1, 40)), params, "poison")]
        seqs += [Sequence(101 + i, p, params, a) for i, (p, a) in enumerate(others)]
        running = [s for s in seqs if engine.try_admit(s)]
        assert len(running) == len(seqs)
        while running:
            engine.step(running)
            engine.release_finished(running)
        assert seqs[0].finish_reason == "error" and "'poison'" in seqs[0].error and seqs[0].output_ids == []
        assert [s.output_ids for s in seqs[1:]] == refs
    finally:
        engine.adapters.unregister("poison")
    prompts = [[3] * n for n in (1, 2, 30, 3, 5, 38)]
    refs = [solo(p, None) for p in prompts]
    assert engine.generate(prompts, params) == refs
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


# --- slow readers -------------------------------------------------------------------------------------------
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


def _never_read_calls(target: str, n: int, max_new_tokens: int) -> tuple[grpc.Channel, list]:
    """n Generate streams opened on a small receive window and never read."""
    channel = grpc.insecure_channel(target, options=SMALL_WINDOW)
    stub = pb_grpc.GenerationStub(channel)
    calls = []
    for i in range(n):
        req = pb.GenerateRequest(text=f"Story number {i}:")
        req.stopping.max_new_tokens, req.stopping.ignore_eos = max_new_tokens, True
        req.response.top_logprobs = 20  # ~250 bytes a response: the window fills within a few tokens
        calls.append(stub.Generate(req))
    return channel, calls


def test_never_read_streams_do_not_hold_kv_slots():
    """8 streams (the whole batch) that are never read run to the end and free their KV slots while their
    output waits for the client; another client is served meanwhile. After --stall-timeout the unread streams
    are cancelled and no stream, KV slot or adapter pin is left."""
    stall = 3.0
    server = ServerThread(shared_engine(), ServerConfig(port=0, limits=RequestLimits(stall_timeout_s=stall)))
    runner, engine = server.server.runner, server.engine
    batch, n = engine.config.max_batch_size, 48
    try:
        channel, calls = _never_read_calls(server.target, batch, n)
        wait_for(lambda: runner.num_open_streams == batch, what="the unread streams to open")
        # They generate to the end, whatever their readers do, and give their KV slots back.
        wait_for(lambda: runner.num_running == 0 and engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, timeout=120,
                 what="the unread streams to finish generating")
        assert runner.num_open_streams == batch, "the finished output waits for its reader"
        with server.client() as other:
            reply = other.complete("Hello there", max_new_tokens=8, ignore_eos=True)
        assert reply.usage.completion_tokens == 8
        assert runner.num_open_streams == batch, "the other client did not wait for the stall timeout"
        # Never read: cancelled after the stall timeout; their clients see RESOURCE_EXHAUSTED.
        wait_for(lambda: runner.num_open_streams == 0, timeout=stall + 30, what="the unread streams to expire")
        for call in calls:
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "did not read" in info.value.details()
        channel.close()
        server.wait_idle()
    finally:
        server.stop()


def test_slow_reader_gets_every_token_in_order_once(served):
    """A reader that takes nothing until its request has finished gets all of it, merged, equal to the
    reference; the request never waited for it (its KV slot was freed before the first read)."""
    runner, engine = served.server.runner, served.engine
    prompt = engine.tokenizer.encode("The river")
    reference = served.reference(prompt, "poet", 40, ignore_eos=True)
    from service.runner.request import GenerationRequest

    async def add():
        req = GenerationRequest("slow", prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), "poet")
        return runner.add_request(req)

    async def read_all(state):
        tokens, messages = [], 0
        while True:
            out = await state.next_output()
            tokens, messages = tokens + out.token_ids, messages + 1
            if out.finished:
                runner.abort(state)
                return tokens, messages, out.completion_tokens

    state = served.run(add())
    wait_for(lambda: state.done, timeout=60, what="the request to finish unread")
    # (the loop releases a finished request's slot at the start of its next iteration, a step at most later)
    wait_for(lambda: engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks, timeout=60,
             what="its KV slot to be freed before any read")
    tokens, messages, completion = served.run(read_all(state))
    assert tokens == reference and completion == 40 and messages == 1
    served.wait_idle()


# --- huge text prompts --------------------------------------------------------------------------------------
_BURST_CLIENT = """
import sys, time, grpc
from concurrent.futures import ThreadPoolExecutor
from service._proto import pb
raw = pb.GenerateRequest(text="lorem ipsum dolor sit amet " * 37_000).SerializeToString()  # 999,000 characters
channel = grpc.insecure_channel(sys.argv[1])
send = channel.unary_stream("/loraserve.v1.Generation/Generate")
def refuse(_):
    t0 = time.perf_counter()
    try:
        list(send(raw))
        return "0 not refused"
    except grpc.RpcError as e:
        return f"{time.perf_counter() - t0} {e.code().name}: {e.details()}"
with ThreadPoolExecutor(int(sys.argv[2])) as pool:
    print("\\n".join(pool.map(refuse, range(int(sys.argv[2])))))
"""

_GAP_CLIENT = """
import sys, time
from service.client import LoraServeClient
with LoraServeClient(sys.argv[1]) as client:
    times = []
    for _chunk in client.generate("Once upon a time", max_new_tokens=200, ignore_eos=True):
        times.append(time.perf_counter())
        if len(times) == 2:
            print("streaming", flush=True)
    print(max(b - a for a, b in zip(times[1:], times[2:])), flush=True)
"""


@pytest.mark.slow
def test_huge_text_prompts_are_refused_before_tokenizing():
    """12 concurrent ~1 MB texts (under --max-message-bytes) are refused from their length alone, never
    tokenized; a running stream's longest gap between messages stays within 2x its solo value; the server's
    memory returns to within 10 % of its baseline."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_service_process import ServeProcess

    server = ServeProcess()
    status = Path(f"/proc/{server.proc.pid}/status")

    def rss() -> int:
        return int(re.search(r"VmRSS:\s+(\d+)", status.read_text()).group(1)) * 1024

    def longest_gap(started: threading.Event | None = None) -> float:
        """Another tenant, in its own process, streaming 200 tokens: its longest gap between messages."""
        proc = subprocess.Popen([sys.executable, "-c", _GAP_CLIENT, server.target], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "streaming"
        if started is not None:
            started.set()
        gap = float(proc.stdout.readline())
        assert proc.wait(60) == 0
        return gap

    def burst_of_refusals() -> list[tuple[float, str]]:
        """12 concurrent ~1 MB prompts from a process of their own at nice 19: on 2 cores, a sender at the
        server's priority takes CPU from the engine's threads that a sender on another machine would not."""
        proc = subprocess.run([sys.executable, "-c", _BURST_CLIENT, server.target, "12"], capture_output=True,
                              text=True, timeout=120, preexec_fn=lambda: os.nice(19))
        assert proc.returncode == 0, proc.stderr
        return [(float(t), msg) for t, msg in (line.split(" ", 1) for line in proc.stdout.splitlines())]

    try:
        burst_of_refusals()  # grpc's buffers for messages of this size exist once a server has received some
        longest_gap()  # and the engine's kernels (oneDNN JITs one per row count) once it has generated
        baseline, trials, refusals = rss(), [], []
        # Paired trials (solo, then during a burst). Tokenizing these texts would stall the stream by seconds in
        # every trial; one trial's longest of ~200 gaps is a noisy tail on 2 shared cores: up to 5 trials.
        while len(trials) < 5 and not any(burst <= 2 * solo for solo, burst in trials):
            solo, started = longest_gap(), threading.Event()
            with ThreadPoolExecutor(1) as pool:
                stream = pool.submit(longest_gap, started)
                assert started.wait(60)
                refusals += burst_of_refusals()
                trials.append((solo, stream.result()))
        for _seconds, message in refusals:
            assert message.startswith("INVALID_ARGUMENT: ") and ("the text has 999000 characters; a prompt of at "
                                                                  "most 255 tokens holds at most") in message
        # The freed buffers go back to the OS shortly after the burst (service/heap.py).
        wait_for(lambda: rss() <= 1.10 * baseline, timeout=30, what="the server's memory to return")
        after = rss()
        print(f"\nrefusal round trip {min(s for s, _ in refusals) * 1e3:.0f}-{max(s for s, _ in refusals) * 1e3:.0f} "
              f"ms; longest gap solo/during the burst, per trial: "
              f"{', '.join(f'{a * 1e3:.1f}/{b * 1e3:.1f} ms' for a, b in trials)}; "
              f"RSS {baseline / 2**20:.0f} -> {after / 2**20:.0f} MiB")
        assert any(burst <= 2 * solo for solo, burst in trials), trials
        assert after <= 1.10 * baseline
    finally:
        server.proc.terminate()
        server.proc.wait(30)


def test_streams_per_connection_cap_is_the_http2_setting():
    """--max-streams-per-connection caps one connection's concurrent streams (grpc's HTTP/2 setting): with a cap
    of 2, three never-read streams on one connection have at most 2 handlers open; a second connection is served."""
    server = ServerThread(shared_engine(), ServerConfig(port=0, limits=RequestLimits(max_streams_per_connection=2,
                                                                                     stall_timeout_s=3.0)))
    runner = server.server.runner
    try:
        channel = grpc.insecure_channel(server.target, options=SMALL_WINDOW)
        grpc.channel_ready_future(channel).result(30)  # the client has the server's SETTINGS before it opens streams
        stub = pb_grpc.GenerationStub(channel)
        calls = []
        for i in range(3):
            req = pb.GenerateRequest(text=f"Story number {i}:")
            req.stopping.max_new_tokens, req.stopping.ignore_eos, req.response.top_logprobs = 48, True, 20
            calls.append(stub.Generate(req))
        wait_for(lambda: runner.num_open_streams == 2, what="two streams to open")
        with server.client() as other:
            assert other.complete("Hello there", max_new_tokens=4, ignore_eos=True).usage.completion_tokens == 4
        assert runner.num_open_streams <= 2
        for call in calls:
            call.cancel()
        channel.close()
        wait_for(lambda: runner.num_open_streams == 0, timeout=30, what="the streams to close")
        server.wait_idle()
    finally:
        server.stop()
