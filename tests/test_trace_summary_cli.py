"""`lora-serve trace-summary` on input it cannot use: a file that is not JSON, JSON of the wrong shape, a trace
id with no request in the spans. Each: one line on stderr, a non-zero exit, no traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def trace_summary(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service", "trace-summary", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def one_line_error(proc: subprocess.CompletedProcess, code: int, *fragments: str) -> None:
    assert proc.returncode == code and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, proc.stderr


def span(name: str, span_id: str, parent: str = "") -> dict:
    return {"traceId": TRACE_ID, "spanId": span_id, "parentSpanId": parent, "name": name, "kind": 1,
            "startTimeUnixNano": "1000000", "endTimeUnixNano": "9000000"}


@pytest.fixture
def otlp_file(tmp_path) -> Path:
    """A request trace in OTLP JSON, as `--save` or a collector's file exporter writes it."""
    spans = [span("loraserve.v1.Generation/Generate", "00f067aa0ba902b7"),
             span("text_completion pirate", "00f067aa0ba902b8", "00f067aa0ba902b7")]
    doc = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "x"}}]},
                              "scopeSpans": [{"spans": spans}]}]}
    path = tmp_path / "spans.jsonl"
    path.write_text(json.dumps(doc) + "\n")
    return path


def test_a_good_file_and_its_trace_id(otlp_file):
    proc = trace_summary(str(otlp_file), "--trace-id", TRACE_ID.upper())
    assert proc.returncode == 0 and f"trace {TRACE_ID}" in proc.stdout and "text_completion pirate" in proc.stdout


@pytest.mark.parametrize("content", [b"this is not json\n", b'{"resourceSpans": [\n', b"\x89PNG\r\n\x1a\n\xff\xfe"])
def test_not_json(tmp_path, content):
    path = tmp_path / "spans.json"
    path.write_bytes(content)
    one_line_error(trace_summary(str(path)), 2, str(path), "not OTLP JSON")


@pytest.mark.parametrize("doc, says", [
    ({"traces": []}, "not an object with a resourceSpans list"),
    ([1, 2], "not an object with a resourceSpans list"),
    ({"resourceSpans": "all of them"}, "not an object with a resourceSpans list"),
    ({"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "startTimeUnixNano": "soon"}]}]}]}, "malformed span"),
    ({"resourceSpans": [{"scopeSpans": ["a span"]}]}, "malformed span"),
])
def test_wrong_shape(tmp_path, doc, says):
    path = tmp_path / "spans.json"
    path.write_text(json.dumps(doc))
    one_line_error(trace_summary(str(path)), 2, str(path), "not OTLP JSON", says)


def test_empty_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    path.write_text("")
    one_line_error(trace_summary(str(path)), 2, "the file is empty")


def test_unknown_trace_id(otlp_file):
    other = "0" * 31 + "1"
    one_line_error(trace_summary(str(otlp_file), "--trace-id", other), 1, f"in trace {other}",
                   f"traces with one: {TRACE_ID}")
