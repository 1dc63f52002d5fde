"""Scale-out, end to end: 3 real lora-serve replicas (eager) behind a real HAProxy running the shipped
deploy/haproxy/haproxy.cfg, through both doors: gRPC with the SDK (which sends x-adapter-id) and the
OpenAI-compatible HTTP API (the client sends x-adapter-id beside `model`), over loopback.

60 requests over 6 adapters → each adapter served by exactly one replica (its x-replica-id), the same replica
through either door. One replica gets SIGTERM with streams in flight → they finish (drain), HAProxy's health check
marks it DOWN, its adapters move to the others and no other adapter moves. Restarted → it rejoins and gets its
adapters back."""
from __future__ import annotations

import http.client
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from service.affinity import ADAPTER_ID_HEADER, REPLICA_ID_HEADER
from service.client import LoraServeClient
from tests.replicas import HAProxy, Replica, free_port

pytestmark = pytest.mark.slow
ADAPTERS = tuple(f"tenant-{i}" for i in range(6))
REPLICAS = ("replica-1", "replica-2", "replica-3")
BACKENDS = ("replicas", "openai")  # HAProxy's gRPC and HTTP backends
PER_ADAPTER = 10  # 60 requests
MAX_SEQ_LEN = 512
PROMPT = "Once upon a time"
START_TIMEOUT_S = 300  # an upper bound for a start on a busy 2-core machine, never waited for when things work
GRACE_S = 3600  # --grace-period: never reached; how long the drain may take is measured (the streams' token rate)
OWNERS: dict[str, dict[str, str]] = {}  # door → adapter → replica, from each door's first round


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tests.checkpoints import make_peft_adapter, make_tiny_model

    root = tmp_path_factory.mktemp("scaleout")
    model = make_tiny_model(root / "model")
    adapters = {name: make_peft_adapter(model, root / name, seed=i + 1) for i, name in enumerate(ADAPTERS)}
    return root, model, adapters


@pytest.fixture(scope="module")
def cluster(checkpoint):
    root, model, adapters = checkpoint
    ports = {name: (free_port(), free_port()) for name in REPLICAS}
    replicas = {name: Replica(name, p, model, adapters, "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", "6",
                              "--max-loras-per-batch", "6", "--grace-period", str(GRACE_S))
                for name, p in ports.items()}
    proxy = None
    try:
        for r in replicas.values():
            r.start()
        for r in replicas.values():
            r.wait_ready(START_TIMEOUT_S)
        proxy = HAProxy(ports, root)
        yield replicas, proxy
    finally:
        for r in replicas.values():
            r.kill()
        if proxy is not None:
            log = proxy.stop()
            print("\n--- haproxy (last lines) ---\n" + "\n".join(log.splitlines()[-10:]))


# --- the two doors: one short request, and one long stream read in a thread -------------------------------
class Stream:
    """One long generation through the proxy, read in a thread: tokens, finish reason, replica."""

    def __init__(self, run: Callable[[Stream], None]):
        self.first = threading.Event()
        self.tokens, self.finish_reason, self.replica, self.error = 0, None, None, None
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(run,), daemon=True)
        self._thread.start()

    def _run(self, run: Callable[[Stream], None]) -> None:
        try:
            run(self)
        except Exception as e:  # noqa: BLE001 - asserted by the test
            self.error = e
        finally:
            self.first.set()

    def seconds_left(self, total: int) -> float:
        """How long the rest of `total` tokens takes at the rate this stream has had so far."""
        rate = max(self.tokens, 1) / (time.monotonic() - self.started)
        return (total - self.tokens) / rate

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"stream still running after {timeout:.0f}s"


class GrpcDoor:
    backend = "replicas"

    def __init__(self, proxy: HAProxy):
        self.target = proxy.target
        self.client = LoraServeClient(self.target)

    def complete(self, adapter: str, max_tokens: int = 2) -> tuple[str, int]:
        done = self.client.complete(PROMPT, adapter=adapter, max_new_tokens=max_tokens, ignore_eos=True, timeout=60)
        return done.replica_id, done.usage.completion_tokens

    def stream(self, adapter: str, max_tokens: int) -> Stream:
        def run(s: Stream) -> None:
            with LoraServeClient(self.target) as client:
                for chunk in client.generate(PROMPT, adapter=adapter, max_new_tokens=max_tokens, ignore_eos=True):
                    s.tokens += len(chunk.token_ids)
                    s.replica, s.finish_reason = chunk.replica_id, chunk.finish_reason
                    s.first.set()
        return Stream(run)

    def close(self) -> None:
        self.client.close()


class HttpDoor:
    """/v1/completions with the adapter in `model` and in x-adapter-id (what the docs tell HTTP clients)."""

    backend = "openai"

    def __init__(self, proxy: HAProxy):
        self.port = proxy.http_port

    def _post(self, body: dict, adapter: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"content-type": "application/json", ADAPTER_ID_HEADER: adapter})
        return conn.getresponse()

    def complete(self, adapter: str, max_tokens: int = 2) -> tuple[str, int]:
        resp = self._post({"model": adapter, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}, adapter)
        body = json.loads(resp.read())
        assert resp.status == 200, body
        return resp.getheader(REPLICA_ID_HEADER) or "", body["usage"]["completion_tokens"]

    def stream(self, adapter: str, max_tokens: int) -> Stream:
        def run(s: Stream) -> None:
            resp = self._post({"model": adapter, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                               "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True},
                              adapter)
            assert resp.status == 200, resp.read()
            s.replica = resp.getheader(REPLICA_ID_HEADER)
            for data in _sse(resp):
                if data["choices"]:
                    s.tokens += len(data["choices"][0].get("token_ids") or [])
                    s.finish_reason = data["choices"][0].get("finish_reason") or s.finish_reason
                if data.get("usage"):
                    assert data["usage"]["completion_tokens"] == s.tokens
                s.first.set()
        return Stream(run)

    def close(self) -> None:
        pass


def _sse(resp: http.client.HTTPResponse) -> Iterator[dict]:
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def route(door, per_adapter: int = PER_ADAPTER) -> dict[str, Counter]:
    """Which replica answered each request, per adapter (requests interleaved across adapters)."""
    seen: dict[str, Counter] = {a: Counter() for a in ADAPTERS}
    for _ in range(per_adapter):
        for adapter in ADAPTERS:
            replica, tokens = door.complete(adapter)
            assert tokens == 2
            seen[adapter][replica] += 1
    return seen


def owners(seen: dict[str, Counter]) -> dict[str, str]:
    """adapter → its one replica; fails if any adapter was served by more than one."""
    spread = {a: dict(c) for a, c in seen.items() if len(c) != 1}
    assert not spread, f"adapters served by more than one replica: {spread}"
    return {a: next(iter(c)) for a, c in seen.items()}


@pytest.mark.parametrize("door_type", [GrpcDoor, HttpDoor], ids=["grpc", "openai"])
def test_affinity_drain_failover_and_rejoin(cluster, door_type):
    replicas, proxy = cluster
    for backend in BACKENDS:
        for name in REPLICAS:
            proxy.wait_state(name, "UP", proxy.up_within(), backend)
    door = door_type(proxy)
    try:
        # 1. Affinity: 60 requests, each adapter on exactly one replica; the 6 adapters spread over replicas;
        # the same replica through either door (both backends hash the same servers).
        before = owners(route(door))
        OWNERS[door.backend] = before
        assert len(OWNERS) == 1 or OWNERS["replicas"] == OWNERS["openai"], OWNERS
        load = Counter(before.values())
        assert len(load) >= 2, f"all adapters hashed to one replica: {before}"
        victim = load.most_common(1)[0][0]
        moved = sorted(a for a, r in before.items() if r == victim)
        stayed = {a: r for a, r in before.items() if r != victim}

        # 2. Streams in flight on the victim, as long as the context allows; SIGTERM once each has its first token.
        with LoraServeClient(proxy.target) as client:
            room = MAX_SEQ_LEN - len(client.tokenize(PROMPT)) - 1
        streams = [door.stream(adapter, room) for adapter in moved]
        for s in streams:
            assert s.first.wait(60) and s.error is None, s.error
        assert {s.replica for s in streams} == {victim}
        replicas[victim].terminate()
        # The drain needs what the slowest stream has left at its own rate so far; 10x that, for a busy machine.
        drain_s = 10 * max(s.seconds_left(room) for s in streams) + 10

        # 3. HAProxy's health checks take it out of both backends (NOT_SERVING / 503 while draining, then nothing
        # listens).
        down_after = max(proxy.wait_state(victim, "DOWN", proxy.down_within(), b) for b in BACKENDS)
        # 4. The in-flight streams finish: every token, finish "length" (the drain), none cancelled.
        for s in streams:
            s.join(drain_s)
            assert s.error is None, s.error
            assert (s.finish_reason, s.tokens) == ("length", room)
        assert replicas[victim].wait(drain_s) == 0, replicas[victim].log()
        log = replicas[victim].log(tail=None)  # a long drain logs a health check each second after its first line
        # Every stream was still generating (running or queued) when SIGTERM came, and all were drained.
        in_flight = re.search(r"waiting up to \S+ for (\d+) running and (\d+) waiting", log)
        assert in_flight and int(in_flight[1]) + int(in_flight[2]) == len(streams) and "drained cleanly" in log, log

        # 5. Its adapters now succeed elsewhere, each on one replica; no other adapter moved.
        during = owners(route(door))
        assert all(during[a] != victim for a in moved), during
        assert {a: during[a] for a in stayed} == stayed

        # 6. Restarted under the same name and ports, it rejoins and gets the same adapters back.
        t0 = time.monotonic()
        replicas[victim].start().wait_ready(START_TIMEOUT_S)
        for backend in BACKENDS:
            proxy.wait_state(victim, "UP", proxy.up_within(), backend)
        rejoined_after = time.monotonic() - t0
        assert owners(route(door)) == before
        print(f"\n{door.backend}: owners {before}; {victim} down {down_after:.2f}s after SIGTERM, {len(streams)} "
              f"streams of {room} tokens drained; its adapters moved to {sorted({during[a] for a in moved})}; "
              f"back in rotation {rejoined_after:.1f}s after restart")
    finally:
        door.close()
