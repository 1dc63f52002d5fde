"""The Python examples of docs/tracing.md, run as pasted (only the server address replaced) against a traced
server, so the documentation cannot rot: each runs, and the instrumented one puts the server's spans under
the application's own span, in the application's trace."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.tools.otlp_receiver import GrpcReceiver
from tests.test_tracing import BASE_ENV, Stack

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "tracing.md"
ADDRESS = "localhost:50051"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", DOC.read_text(), flags=re.M | re.S)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s = Stack({**BASE_ENV, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, GrpcReceiver)
    yield s
    s.close()


def run_example(code: str, stack: Stack) -> subprocess.CompletedProcess:
    assert ADDRESS in code
    # The application's exporter sends to the same receiver as the server; no OTEL_* of ours leaks in.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = stack.receiver.endpoint
    return subprocess.run([sys.executable, "-c", code.replace(ADDRESS, stack.served.target)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_doc_has_both_examples():
    blocks = python_blocks()
    assert len(blocks) == 2 and sum("start_as_current_span" in b for b in blocks) == 1


def test_plain_example_runs(stack):
    [code] = [b for b in python_blocks() if "start_as_current_span" not in b]
    proc = run_example(code, stack)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


def test_instrumented_example_continues_the_applications_trace(stack):
    [code] = [b for b in python_blocks() if "start_as_current_span" in b]
    proc = run_example(code, stack)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr

    def joined(spans):
        apps = [s for s in spans if s.name == "answer-question"]
        return apps and any(s.name == "loraserve.v1.Generation/Generate" and s.parent_id == apps[-1].span_id
                            for s in spans)

    spans = stack.collect(joined)
    [app] = [s for s in spans if s.name == "answer-question"]
    [server] = [s for s in spans if s.parent_id == app.span_id]
    assert app.service == "my-app" and app.parent_id == ""  # the application's own root span, exported
    assert server.trace_id == app.trace_id and server.service == "lora-serve-test" and server.kind == "SERVER"
    [request] = [s for s in spans if s.parent_id == server.span_id and s.name.startswith("text_completion")]
    assert request.attributes["gen_ai.request.model"] == "pirate"
    assert request.attributes["gen_ai.usage.output_tokens"] == 32
