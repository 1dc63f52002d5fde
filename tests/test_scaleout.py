"""Scale-out, end to end: 3 real lora-serve replicas (eager) behind a real HAProxy running the shipped
deploy/haproxy/haproxy.cfg, reached over loopback gRPC with the SDK (which sends x-adapter-id).

60 requests over 6 adapters → each adapter served by exactly one replica (its x-replica-id). One replica gets
SIGTERM with streams in flight → they finish (drain), HAProxy's grpc.health.v1 check marks it DOWN, its adapters
move to the others and no other adapter moves. Restarted → it rejoins and gets its adapters back."""
from __future__ import annotations

import re
import threading
import time
from collections import Counter

import pytest

from service.client import LoraServeClient
from tests.replicas import HAProxy, Replica, free_port

pytestmark = pytest.mark.slow
ADAPTERS = tuple(f"tenant-{i}" for i in range(6))
REPLICAS = ("replica-1", "replica-2", "replica-3")
PER_ADAPTER = 10  # 60 requests
MAX_SEQ_LEN = 512
PROMPT = "Once upon a time"
START_TIMEOUT_S = 300  # an upper bound for a start on a busy 2-core machine, never waited for when things work


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
    ports = {name: free_port() for name in REPLICAS}
    replicas = {name: Replica(name, port, model, adapters, "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size",
                              "6", "--max-loras-per-batch", "6", "--grace-period", "120")
                for name, port in ports.items()}
    proxy = None
    try:
        for r in replicas.values():
            r.start()
        for r in replicas.values():
            r.wait_ready(START_TIMEOUT_S)
        proxy = HAProxy(ports, root)
        for name in REPLICAS:
            proxy.wait_state(name, "UP", proxy.up_within())
        yield replicas, proxy
    finally:
        for r in replicas.values():
            r.kill()
        if proxy is not None:
            log = proxy.stop()
            print("\n--- haproxy (last lines) ---\n" + "\n".join(log.splitlines()[-15:]))


def route(client: LoraServeClient, per_adapter: int = PER_ADAPTER) -> dict[str, Counter]:
    """Which replica answered each request, per adapter (requests interleaved across adapters)."""
    seen: dict[str, Counter] = {a: Counter() for a in ADAPTERS}
    for _ in range(per_adapter):
        for adapter in ADAPTERS:
            done = client.complete(PROMPT, adapter=adapter, max_new_tokens=2, timeout=60)
            assert done.usage.completion_tokens == 2
            seen[adapter][done.replica_id] += 1
    return seen


def owners(seen: dict[str, Counter]) -> dict[str, str]:
    """adapter → its one replica; fails if any adapter was served by more than one."""
    spread = {a: dict(c) for a, c in seen.items() if len(c) != 1}
    assert not spread, f"adapters served by more than one replica: {spread}"
    return {a: next(iter(c)) for a, c in seen.items()}


def test_affinity_drain_failover_and_rejoin(cluster):
    replicas, proxy = cluster
    client = LoraServeClient(proxy.target)
    try:
        # 1. Affinity: 60 requests, each adapter on exactly one replica; the 6 adapters spread over replicas.
        before = owners(route(client))
        load = Counter(before.values())
        assert len(load) >= 2, f"all adapters hashed to one replica: {before}"
        victim = load.most_common(1)[0][0]
        moved = sorted(a for a, r in before.items() if r == victim)
        stayed = {a: r for a, r in before.items() if r != victim}

        # 2. Streams in flight on the victim, as long as the context allows; SIGTERM once each has its first token.
        room = MAX_SEQ_LEN - len(client.tokenize(PROMPT)) - 1
        streams = [_Stream(proxy.target, adapter, room) for adapter in moved]
        for s in streams:
            assert s.first.wait(60), "a stream never started"
        assert {s.replica for s in streams} == {victim}
        replicas[victim].terminate()

        # 3. HAProxy's health check takes it out (NOT_SERVING while draining, then nothing listens).
        down_after = proxy.wait_state(victim, "DOWN", proxy.down_within())
        # 4. The in-flight streams finish: every token, finish "length" (the drain), none cancelled.
        for s in streams:
            s.join(600)
            assert s.error is None, s.error
            assert (s.finish_reason, s.tokens) == ("length", room)
        assert replicas[victim].wait(120) == 0, replicas[victim].log()
        log = replicas[victim].log()
        # Every stream was still generating (running or queued) when SIGTERM came, and all were drained.
        in_flight = re.search(r"waiting up to \S+ for (\d+) running and (\d+) waiting", log)
        assert in_flight and int(in_flight[1]) + int(in_flight[2]) == len(streams) and "drained cleanly" in log, log

        # 5. Its adapters now succeed elsewhere, each on one replica; no other adapter moved.
        during = owners(route(client))
        assert all(during[a] != victim for a in moved), during
        assert {a: during[a] for a in stayed} == stayed

        # 6. Restarted under the same name and port, it rejoins and gets the same adapters back.
        t0 = time.monotonic()
        replicas[victim].start().wait_ready(START_TIMEOUT_S)
        proxy.wait_state(victim, "UP", proxy.up_within())
        rejoined_after = time.monotonic() - t0
        after = owners(route(client))
        assert after == before
        print(f"\nowners {before}; {victim} down {down_after:.2f}s after SIGTERM, {len(streams)} streams of "
              f"{room} tokens drained; its adapters moved to {sorted({during[a] for a in moved})}; "
              f"back in rotation {rejoined_after:.1f}s after restart")
    finally:
        client.close()


class _Stream:
    """One long generation through the proxy, read in a thread."""

    def __init__(self, target: str, adapter: str, max_new_tokens: int):
        self.first = threading.Event()
        self.tokens, self.finish_reason, self.replica, self.error = 0, None, None, None
        self._client = LoraServeClient(target)
        self._thread = threading.Thread(target=self._run, args=(adapter, max_new_tokens), daemon=True)
        self._thread.start()

    def _run(self, adapter: str, max_new_tokens: int) -> None:
        try:
            for chunk in self._client.generate(PROMPT, adapter=adapter, max_new_tokens=max_new_tokens,
                                               ignore_eos=True):
                self.tokens += len(chunk.token_ids)
                self.replica, self.finish_reason = chunk.replica_id, chunk.finish_reason
                self.first.set()
        except Exception as e:  # noqa: BLE001 - asserted by the test
            self.error = e
        finally:
            self.first.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)
        self._client.close()
        assert not self._thread.is_alive(), "stream still running"
