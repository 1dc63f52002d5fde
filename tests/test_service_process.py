"""The real process: `python -m service` (demo model, --no-compile) starts, reports ready, and on SIGTERM
refuses new calls, lets the in-flight stream finish, and exits 0. The lora-client CLI talks to it."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from service import allocator
from service.client import LoraServeClient, UnavailableError
from tests.service_harness import demo_paths

# Upper bound on a drain: it ends when the streams do, so a loaded machine is not a failure, a stuck drain is.
DRAIN_BOUND_S = 600

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"lora-serve ready on (\S+):(\d+)")
pytestmark = pytest.mark.slow


class ServeProcess:
    def __init__(self, *args: str, preexec_fn=None, ready_s: float = 90):
        demo_paths()  # written once, before the child reads the same cache
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--demo", "random", "--no-compile", "--port", "0", "--http-port", "0",
             "--max-batch-size", "2",
             "--max-seq-len", "256", "--max-loras-per-batch", "1", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=os.environ | {"PYTHONUNBUFFERED": "1"}, preexec_fn=preexec_fn,
        )
        self._ready = threading.Event()
        self.port: int | None = None
        self.reader = threading.Thread(target=self._read, daemon=True)  # ends with the process's output
        self.reader.start()
        if not self._ready.wait(ready_s):
            self.proc.kill()
            raise AssertionError("server never became ready:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if m := READY.search(line):
                self.port = int(m.group(2))
                self._ready.set()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "service", "client", "--target", self.target, *args],
                              cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_sigterm_drains_in_flight_stream_and_exits_cleanly():
    server = ServeProcess("--grace-period", str(DRAIN_BOUND_S), "--no-prepack-weights", "--dtype", "float32")
    try:
        log = "".join(server.lines)
        assert "float32, plain weights (eager: --no-compile)" in log
        assert "loading model" in log and "warm-up done" in log and "registered adapter 'pirate'" in log
        assert "outside the engine thread" not in log  # the CLI keeps torch in one thread
        assert "moved out of the garbage collector's reach" in log  # gc.freeze() after warm-up
        assert "serving the random demo model" in log
        assert "writing the demo" not in log  # demo_paths() wrote it before: nothing to write
        # TCMalloc where the system has it (service.allocator), in the PID that was started: exec, not a child
        maps = Path(f"/proc/{server.proc.pid}/maps").read_text()
        if allocator.find_tcmalloc() is not None:
            assert "memory allocator: TCMalloc" in log and "libtcmalloc" in maps
        else:
            assert "memory allocator: glibc malloc; TCMalloc not found" in log and "libtcmalloc" not in maps

        # The CLI client against the real process.
        info = server.cli("info")
        assert info.returncode == 0 and "max_batch_size: 2" in info.stdout
        listed = server.cli("adapters", "list")
        assert listed.returncode == 0 and {"pirate", "poet", "scribe"} <= {
            line.split("\t")[0] for line in listed.stdout.splitlines()}
        generated = server.cli("generate", "Once upon a time", "--adapter", "poet", "--max-new-tokens", "8")
        assert generated.returncode == 0 and "[finish: length; prompt" in generated.stderr
        bad = server.cli("generate", "x", "--temperature", "-1")
        assert bad.returncode == 1 and "sampling.temperature" in bad.stderr
        # The sampling options: a +100 bias makes token 100 the first token, and it is a stop token.
        stopped = server.cli("generate", "Once upon a time", "--max-new-tokens", "4", "--logit-bias", "100=100",
                             "--stop-token-id", "100", "--presence-penalty", "0.5", "--frequency-penalty", "0.5",
                             "--min-p", "0.1")
        assert stopped.returncode == 0 and "[finish: stop (token 100); prompt" in stopped.stderr, stopped.stderr
        choices = server.cli("generate", "Once upon a time", "-n", "2", "--max-new-tokens", "3", "--temperature", "1",
                             "--seed", "1")
        assert choices.returncode == 0 and "[choice 0]" in choices.stdout and "[choice 1]" in choices.stdout
        bad = server.cli("generate", "x", "-n", "0", "--logit-bias", "600=1")
        assert bad.returncode == 1 and "sampling.n" in bad.stderr and "sampling.logit_bias" in bad.stderr

        with LoraServeClient(server.target) as client:
            stream = client.generate("Once upon a time", max_new_tokens=240, ignore_eos=True)
            chunks = [next(stream)]
            server.proc.send_signal(signal.SIGTERM)
            with pytest.raises(UnavailableError):  # refused (draining) or, once stopped, no listener
                with LoraServeClient(server.target, timeout=5) as other:
                    other.complete("Hello", max_new_tokens=2)
            chunks += list(stream)
        assert chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 240
        assert server.proc.wait(DRAIN_BOUND_S) == 0
        log = "".join(server.lines)
        assert "draining" in log and "drained cleanly" in log
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_door_of_the_process_serves_openai_clients_and_drains():
    """`--http-port`: the OpenAI client and the gRPC SDK against one process; on SIGTERM the HTTP stream in
    flight finishes, /health says 503, new HTTP requests are refused, and the process exits 0."""
    import openai

    port = _free_port()
    server = ServeProcess("--http-port", str(port), "--grace-period", str(DRAIN_BOUND_S))
    try:
        assert f"and http://127.0.0.1:{port} (OpenAI-compatible HTTP)" in "".join(server.lines)
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(base + "/health", timeout=10) as r:
            assert r.status == 200
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert {m.id for m in client.models.list()} >= {"pirate", "poet", "scribe"}
        http = client.completions.create(model="pirate", prompt="Once upon a time", max_tokens=8, temperature=0)
        with LoraServeClient(server.target) as grpc_client:
            same = grpc_client.complete("Once upon a time", adapter="pirate", max_new_tokens=8, temperature=0)
        assert http.choices[0].text == same.text and http.usage.completion_tokens == 8
        stream = client.completions.create(model="", prompt="Once upon a time", max_tokens=48, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(urllib.error.HTTPError) as health:
            while True:  # until the signal is handled
                urllib.request.urlopen(base + "/health", timeout=10).close()
        assert health.value.code == 503
        with pytest.raises(openai.InternalServerError) as refused:  # 503: draining
            client.completions.create(model="", prompt="Hello", max_tokens=2)
        assert refused.value.status_code == 503 and "draining" in refused.value.message
        chunks += list(stream)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert server.proc.wait(DRAIN_BOUND_S) == 0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait()


def test_bad_model_dir_fails_fast(tmp_path):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "service", "--no-compile", "--model", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "cannot start" in proc.stderr and "config.json" in proc.stderr
    assert time.monotonic() - start < 60
