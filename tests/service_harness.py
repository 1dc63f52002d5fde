"""Shared by the service tests: the real engine on the demo model (eager, built once per session) and a
LoraServer running on its own event loop in a background thread, reached over loopback gRPC."""
from __future__ import annotations

import asyncio
import functools
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import openai

import service.runner.engine_thread as engine_thread
from lora_compile import Engine, EngineConfig, SamplingParams
from lora_serve_demo import write_demo_adapters, write_demo_checkpoint
from service._proto import pb
from service.client import LoraServeClient
from service.server import LoraServer, ServerConfig

T = TypeVar("T")
# float32: tokens are compared with float32 references ("auto" is bfloat16 on CPUs with native bf16).
LIMITS = dict(dtype="float32", compile=False, max_num_seqs=8, max_seq_len=256, max_loras_per_batch=2, max_lora_rank=16)
DEMO_ADAPTERS = ("pirate", "poet", "scribe")


@functools.cache
def demo_paths() -> tuple[Path, dict[str, Path]]:
    return write_demo_checkpoint(), write_demo_adapters()


@functools.cache
def shared_engine() -> Engine:
    """One engine for every service test module (eager keeps the suite fast)."""
    model, adapters = demo_paths()
    return build_engine(model, adapters)


def chat_server(root: Path, template: str, config: ServerConfig | None = None) -> ServerThread:
    """The demo model copied under `root` with a chat template (it has none), its pirate adapter, both doors."""
    from tests.checkpoints import write_chat_template

    model, adapters = demo_paths()
    copy = root / "demo-chat"
    shutil.copytree(model, copy)
    write_chat_template(copy, template)
    return ServerThread(build_engine(copy, {"pirate": adapters["pirate"]}), config or ServerConfig(port=0, http_port=0))


def build_engine(model: Path, adapters: dict[str, Path], **limits: Any) -> Engine:
    """An engine with these adapters registered as `lora-serve --adapter` registers them (anywhere, whatever the
    roots), built where a server runs it: in the engine thread."""
    engine = engine_thread.call(Engine, EngineConfig(model=str(model), **(LIMITS | limits)))
    for name, path in adapters.items():
        engine_thread.call(functools.partial(engine.adapters.register, confined=False), name, str(path))
    return engine


class ServerThread:
    """A LoraServer on a private event loop in a daemon thread."""

    def __init__(self, engine: Engine, config: ServerConfig | None = None, warmup: bool = True):
        self.engine = engine
        self.config = config or ServerConfig(port=0, grace_period_s=10.0)
        self.loop = asyncio.new_event_loop()
        self.server: LoraServer | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="grpc-server")
        self._thread.start()
        self.run(self._start(warmup))

    async def _start(self, warmup: bool) -> None:
        self.server = LoraServer(self.engine, self.config)  # grpc.aio binds to the loop it is created in
        await self.server.start()
        if warmup:
            await self.server.warmup()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def client(self, **kwargs) -> LoraServeClient:
        return LoraServeClient(self.target, **kwargs)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Run a coroutine on the server's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, T]):
        """Start a coroutine on the server's loop; returns a concurrent.futures.Future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def in_engine_thread(self, fn: Callable[..., T], *args) -> T:
        """Call the engine between steps (never concurrently with the server's own engine calls)."""
        return self.run(self.server.runner.run_in_engine_thread(fn, *args))

    def reference(self, prompt_ids: list[int], adapter: str | None, max_new_tokens: int, **sampling) -> list[int]:
        """What engine.generate gives this request alone."""
        params = SamplingParams(max_new_tokens=max_new_tokens, **sampling)
        return self.in_engine_thread(lambda: self.engine.generate([prompt_ids], params, adapters=[adapter])[0])

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is waiting or running and every KV slot and adapter pin is back."""
        runner = self.server.runner
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (runner.num_running == 0 and runner.num_waiting == 0
                    and self.engine.kv_cache.num_free_blocks == self.engine.kv_cache.num_blocks
                    and self.engine.adapters.num_free_slots == self.engine.config.max_loras_per_batch):
                return
            time.sleep(0.01)
        raise AssertionError(
            f"server not idle after {timeout}s: running={runner.num_running} waiting={runner.num_waiting} "
            f"free_kv={self.engine.kv_cache.num_free_blocks} free_lora_slots={self.engine.adapters.num_free_slots}")

    def stop(self) -> None:
        if self.server is not None:
            self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def openai_client(server: ServerThread, **kwargs: Any) -> openai.OpenAI:
    """The official client for the server's HTTP door: no retries (a refusal is the test's answer), 60 s timeout."""
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.server.http_port}/v1", api_key="unused",
                         **{"max_retries": 0, "timeout": 60} | kwargs)


def make_request(text: str | None = "Once upon a time", **fields) -> pb.GenerateRequest:
    """A GenerateRequest; fields: "sampling__temperature"=..., lists extend repeated fields; text=None leaves
    the input unset."""
    req = pb.GenerateRequest()
    if text is not None:
        req.text = text
    for path, value in fields.items():
        *parents, leaf = path.split("__")
        msg = req
        for p in parents:
            msg = getattr(msg, p)
        if isinstance(value, list):
            getattr(msg, leaf).extend(value)
        else:
            setattr(msg, leaf, value)
    return req


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class BackgroundStream:
    """One stream consumed in a thread while the test does something else; .result() joins."""

    def __init__(self, server: ServerThread, prompt, wait_started: bool = True, **params):
        self.chunks, self.error = [], None
        self.started = threading.Event()
        self._stop = threading.Event()
        self._client = server.client()
        self._thread = threading.Thread(target=self._run, args=(prompt, params), daemon=True)
        self._thread.start()
        if wait_started:
            assert self.started.wait(30), "stream did not start"

    def _run(self, prompt, params):
        try:
            stream = self._client.generate(prompt, **params)
            for chunk in stream:
                self.chunks.append(chunk)
                self.started.set()
                if self._stop.is_set():
                    stream.close()  # leaving the stream cancels the call
                    break
        except Exception as e:  # noqa: BLE001 - surfaced by result()
            self.error = e
            self.started.set()

    def stop(self) -> list[int]:
        """Leave the stream at its next chunk (as a client that goes away); the tokens received until then."""
        self._stop.set()
        return self.result()

    def result(self) -> list[int]:
        """The stream's tokens, once it has ended; raises what the stream raised."""
        self._thread.join(60)
        self._client.close()
        if self.error is not None:
            raise self.error
        return [t for c in self.chunks for t in c.token_ids]

    @property
    def finish_reason(self) -> str:
        return self.chunks[-1].finish_reason
