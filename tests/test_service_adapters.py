"""Adapters at runtime: loading makes an adapter usable by the next request, unloading is refused while
in-flight requests use it, and neither disturbs running streams."""
from __future__ import annotations

import shutil
import threading

import pytest

from service.client import FailedPreconditionError, NotFoundError
from tests.service_harness import ServerThread, demo_paths, shared_engine, wait_for

STREAM = dict(max_new_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine())
    yield server
    server.stop()


class Background:
    """Consume a stream in a thread (so the test can act while it runs); .result() joins."""

    def __init__(self, served, prompt, wait_started: bool = True, **params):
        self.chunks, self.error = [], None
        self.started = threading.Event()
        self._client = served.client()
        self._thread = threading.Thread(target=self._run, args=(prompt, params), daemon=True)
        self._thread.start()
        if wait_started:
            assert self.started.wait(10), "stream did not start"

    def _run(self, prompt, params):
        try:
            for chunk in self._client.generate(prompt, **params):
                self.chunks.append(chunk)
                self.started.set()
        except Exception as e:  # noqa: BLE001 - surfaced by result()
            self.error = e
            self.started.set()

    def result(self):
        self._thread.join(60)
        self._client.close()
        if self.error:
            raise self.error
        return [t for c in self.chunks for t in c.token_ids], self.chunks[-1].finish_reason


def test_load_and_unload_while_streaming(served, tmp_path):
    tok = served.engine.tokenizer
    _, adapters = demo_paths()
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    want_pirate = served.reference(ids, "pirate", STREAM["max_new_tokens"], ignore_eos=True)
    want_base = served.reference(ids, None, STREAM["max_new_tokens"], ignore_eos=True)

    pirate_stream = Background(served, prompt, adapter="pirate", **STREAM)
    base_stream = Background(served, prompt, **STREAM)
    with served.client() as client:
        # Load a copy under a new name while both stream: usable at once, same weights, same tokens.
        copy = tmp_path / "pirate-copy"
        shutil.copytree(adapters["pirate"], copy)
        info = client.load_adapter("pirate2", str(copy))
        assert (info.name, info.rank, info.target_modules) == ("pirate2", 8, ("q_proj", "v_proj"))
        assert client.complete(prompt, adapter="pirate2", max_new_tokens=12, ignore_eos=True).token_ids == \
            want_pirate[:12]

        # Unloading an adapter in use is refused; the stream goes on untouched.
        in_use = {a.name: a.active_requests for a in client.list_adapters()}
        assert in_use["pirate"] >= 1 and in_use["scribe"] == 0
        with pytest.raises(FailedPreconditionError, match="in use"):
            client.unload_adapter("pirate")
        with pytest.raises(FailedPreconditionError, match="in use"):
            client.load_adapter("pirate", str(copy))  # nor replaced under a running stream

        # Unloading an idle one while others stream is fine.
        client.unload_adapter("pirate2")
        with pytest.raises(NotFoundError):
            client.complete(prompt, adapter="pirate2", max_new_tokens=2)

    assert pirate_stream.result() == (want_pirate, "length")
    assert base_stream.result() == (want_base, "length")
    served.wait_idle()

    with served.client() as client:
        client.unload_adapter("pirate")  # no longer in use
        assert "pirate" not in {a.name for a in client.list_adapters()}
        with pytest.raises(NotFoundError):
            client.complete(prompt, adapter="pirate", max_new_tokens=2)
        client.load_adapter("pirate", str(adapters["pirate"]))  # restore the shared engine
        assert client.complete(prompt, adapter="pirate", max_new_tokens=12, ignore_eos=True).token_ids == \
            want_pirate[:12]


def test_waiting_request_counts_as_in_use(served):
    """A request still queued for an adapter slot blocks unloading too (in-flight = waiting + running)."""
    runner = served.server.runner
    # Both device slots pinned by running streams, so a third adapter's request has to wait.
    streams = [Background(served, "The river", adapter=a, **STREAM) for a in ("pirate", "poet")]
    waiting = Background(served, "The river", wait_started=False, adapter="scribe", max_new_tokens=4)
    wait_for(lambda: runner.num_waiting == 1, what="the scribe request to wait for an adapter slot")
    with served.client() as client, pytest.raises(FailedPreconditionError):
        client.unload_adapter("scribe")
    for s in streams:
        assert s.result()[1] == "length"
    assert waiting.result()[1] == "length"
    served.wait_idle()
