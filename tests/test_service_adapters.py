"""Adapters at runtime: loading makes an adapter usable by the next request, unloading is refused while
in-flight requests use it, and neither disturbs running streams."""
from __future__ import annotations

import shutil

import pytest

from service.client import FailedPreconditionError, NotFoundError
from tests.service_harness import BackgroundStream, ServerThread, demo_paths, shared_engine, wait_for

STREAM = dict(max_new_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    server = ServerThread(shared_engine())
    yield server
    server.stop()


def test_load_and_unload_while_streaming(served, tmp_path):
    tok = served.engine.tokenizer
    _, adapters = demo_paths()
    prompt = "Once upon a time"
    ids = tok.encode(prompt)
    want_pirate = served.reference(ids, "pirate", STREAM["max_new_tokens"], ignore_eos=True)
    want_base = served.reference(ids, None, STREAM["max_new_tokens"], ignore_eos=True)

    pirate_stream = BackgroundStream(served, prompt, adapter="pirate", **STREAM)
    base_stream = BackgroundStream(served, prompt, **STREAM)
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

    assert (pirate_stream.result(), pirate_stream.finish_reason) == (want_pirate, "length")
    assert (base_stream.result(), base_stream.finish_reason) == (want_base, "length")
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
    streams = [BackgroundStream(served, "The river", adapter=a, **STREAM) for a in ("pirate", "poet")]
    waiting = BackgroundStream(served, "The river", wait_started=False, adapter="scribe", max_new_tokens=4)
    wait_for(lambda: runner.num_waiting == 1, what="the scribe request to wait for an adapter slot")
    with served.client() as client, pytest.raises(FailedPreconditionError):
        client.unload_adapter("scribe")
    for s in streams:
        s.result()
        assert s.finish_reason == "length"
    waiting.result()
    assert waiting.finish_reason == "length"
    served.wait_idle()
