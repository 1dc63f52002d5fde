"""`lora-serve trace-summary`: engine-step batch init against forward, and the span tree of one request.

    # receive OTLP for 60 s (point the server at it: OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317)
    lora-serve trace-summary --listen 4317 --seconds 60 [--http-port 4318] [--save spans.jsonl]
    # or read OTLP JSON: --save output, the OpenTelemetry Collector's file exporter, Jaeger's /api/v3/traces
    lora-serve trace-summary spans.jsonl [more.json ...] [--trace-id HEX] [--batch-size 32]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.tools.otlp_receiver import GrpcReceiver, HttpReceiver, OtlpSink, SpanRecord, read_json_spans, to_otlp_json

PHASES = ("lora.batch_init", "model.forward", "sample")


# --- step statistics -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepTimes:
    kind: str
    batch_size: int
    phases: dict[str, float]  # phase name -> seconds
    total: float              # the engine.step span, seconds


def step_times(spans: Sequence[SpanRecord], batch_size: int | None = None) -> list[StepTimes]:
    """Every engine.step span with its three children (optionally only those of one batch size)."""
    children: dict[str, dict[str, float]] = defaultdict(dict)
    for s in spans:
        if s.name in PHASES:
            children[s.parent_id][s.name] = s.duration_ns / 1e9
    out = []
    for s in spans:
        if s.name != "engine.step":
            continue
        size = int(s.attributes.get("lora_serve.step.batch_size", 0))
        if batch_size is not None and size != batch_size:
            continue
        phases = children.get(s.span_id, {})
        out.append(StepTimes(str(s.attributes.get("lora_serve.step.kind", "?")), size,
                             {p: phases.get(p, 0.0) for p in PHASES}, s.duration_ns / 1e9))
    return out


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))] if ordered else 0.0


def batch_init_share(steps: Sequence[StepTimes]) -> float:
    total = sum(s.total for s in steps)
    return sum(s.phases["lora.batch_init"] for s in steps) / total if total else 0.0


def format_step_stats(steps: Sequence[StepTimes]) -> str:
    if not steps:
        return "no engine.step spans"
    kinds = Counter(s.kind for s in steps)
    sizes = [s.batch_size for s in steps]
    lines = [f"engine.step spans: {len(steps)} ({', '.join(f'{k} {n}' for k, n in kinds.most_common())}); "
             f"batch size mean {sum(sizes) / len(sizes):.1f}, max {max(sizes)}",
             f"{'':<16}{'count':>7}{'mean ms':>10}{'p50 ms':>10}{'p95 ms':>10}{'share':>8}"]
    total = sum(s.total for s in steps)
    rows = [(p, [s.phases[p] for s in steps]) for p in PHASES] + [("engine.step", [s.total for s in steps])]
    for name, values in rows:
        share = f"{100 * sum(values) / total:.1f}%" if total else "-"
        lines.append(f"{name:<16}{len(values):>7}{1e3 * sum(values) / len(values):>10.3f}"
                     f"{1e3 * percentile(values, 0.5):>10.3f}{1e3 * percentile(values, 0.95):>10.3f}{share:>8}")
    by_kind = ", ".join(f"{k} {100 * batch_init_share([s for s in steps if s.kind == k]):.1f}%"
                        for k, _ in kinds.most_common())
    forward = sum(s.phases["model.forward"] for s in steps)
    ratio = sum(s.phases["lora.batch_init"] for s in steps) / forward if forward else 0.0
    lines.append(f"batch-init share of step time: {100 * batch_init_share(steps):.1f}% ({by_kind}); "
                 f"batch init / forward = {ratio:.3f}")
    return "\n".join(lines)


# --- the span tree of one request ------------------------------------------------------------------------
def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ",".join(_fmt(v) for v in value)
    return str(value)


def _label(s: SpanRecord, t0: int) -> str:
    text = f"{s.name}  {(s.start_ns - t0) / 1e6:.2f} → {(s.end_ns - t0) / 1e6:.2f} ms ({s.duration_ns / 1e6:.2f} ms)"
    if s.kind not in ("INTERNAL", "UNSPECIFIED"):
        text += f"  [{s.kind}]"
    if s.status == "ERROR":
        text += f"  ERROR: {s.status_message}"
    return text


def _details(s: SpanRecord, t0: int) -> list[str]:
    lines = []
    if s.attributes:
        lines.append(" ".join(f"{k}={_fmt(v)}" for k, v in sorted(s.attributes.items())))
    lines += [f"• {e.name} @ {(e.time_ns - t0) / 1e6:.2f} ms"
              + "".join(f" {k}={_fmt(v)}" for k, v in sorted(e.attributes.items())) for e in s.events]
    return lines


def _walk(s: SpanRecord, kids: dict[str, list[SpanRecord]], t0: int, prefix: str, last: bool,
          out: list[str], top: bool = False, details: bool = True) -> None:
    branch, cont = ("", "") if top else (("└─ ", "   ") if last else ("├─ ", "│  "))
    out.append(prefix + branch + _label(s, t0))
    below = kids.get(s.span_id, [])
    for line in _details(s, t0) if details else []:
        out.append(prefix + cont + ("│  " if below else "   ") + line)
    for i, child in enumerate(below):
        _walk(child, kids, t0, prefix + cont, i == len(below) - 1, out, details=details)


def render_request(spans: Sequence[SpanRecord], trace_id: str | None = None, steps_shown: int = 3) -> str:
    """The trace of one request (the latest, or the one of `trace_id`) and the engine steps linked to it."""
    requests = [s for s in spans if s.name.startswith("text_completion") and trace_id in (None, s.trace_id)]
    if not requests:
        return "no request span (text_completion ...)" + (f" in trace {trace_id}" if trace_id else "")
    request = max(requests, key=lambda s: s.end_ns)
    in_trace = sorted((s for s in spans if s.trace_id == request.trace_id), key=lambda s: s.start_ns)
    ids = {s.span_id for s in in_trace}
    kids: dict[str, list[SpanRecord]] = defaultdict(list)
    for s in spans:
        if s.parent_id:
            kids[s.parent_id].append(s)
    for children in kids.values():
        children.sort(key=lambda s: s.start_ns)
    t0 = in_trace[0].start_ns
    out = [f"trace {request.trace_id} (times from the first span's start)"]
    for root in (s for s in in_trace if s.parent_id not in ids):
        _walk(root, kids, t0, "", True, out, top=True)
    linked = sorted((s for s in spans if s.name == "engine.step" and (request.trace_id, request.span_id) in s.links),
                    key=lambda s: s.start_ns)
    if linked:
        kinds = Counter(str(s.attributes.get("lora_serve.step.kind")) for s in linked)
        out.append(f"engine.step spans linked to {request.name}: {len(linked)} "
                   f"({', '.join(f'{k} {n}' for k, n in kinds.most_common())})")
        shown = linked if len(linked) <= steps_shown + 1 else [*linked[:steps_shown], linked[-1]]
        for i, step in enumerate(shown):
            if step is linked[-1] and len(linked) > len(shown):
                out.append(f"├─ … {len(linked) - len(shown)} more")
            a = step.attributes
            out.append(("└─ " if i == len(shown) - 1 else "├─ ") + _label(step, t0) + "  "
                       + " ".join(f"{k.removeprefix('lora_serve.step.')}={_fmt(a[k])}" for k in sorted(a)))
            children = kids.get(step.span_id, [])
            for j, child in enumerate(children):
                lead = "   " if i == len(shown) - 1 else "│  "
                out.append(lead + ("└─ " if j == len(children) - 1 else "├─ ") + _label(child, t0))
    return "\n".join(out)


def summary(spans: Sequence[SpanRecord], trace_id: str | None = None, batch_size: int | None = None,
            steps_shown: int = 3) -> str:
    return "\n\n".join([format_step_stats(step_times(spans, batch_size)),
                        render_request(spans, trace_id, steps_shown)])


# --- the command -----------------------------------------------------------------------------------------
def _host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    return (host if sep else "127.0.0.1") or "127.0.0.1", int(port)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lora-serve trace-summary",
        description="Per-step batch init vs forward (count, mean, p50, p95, share) and one request's span tree, "
                    "from OTLP spans: received here for a while (--listen) or read from OTLP JSON files.")
    p.add_argument("files", nargs="*", help="OTLP JSON files (one document, or JSON lines)")
    p.add_argument("--listen", metavar="[HOST:]PORT", help="run an OTLP/gRPC receiver here (e.g. 4317)")
    p.add_argument("--http-port", type=int, help="also receive OTLP/HTTP (protobuf) on this port")
    p.add_argument("--seconds", type=float, default=30.0, help="how long to receive (default: %(default)s; Ctrl-C ends early)")
    p.add_argument("--save", metavar="FILE", help="write what was received as OTLP JSON lines")
    p.add_argument("--trace-id", help="the request trace to draw (default: the latest request)")
    p.add_argument("--batch-size", type=int, help="step statistics of this batch size only")
    p.add_argument("--steps-shown", type=int, default=3, help="linked engine steps drawn (default: %(default)s)")
    return p


def _receive(args: argparse.Namespace) -> list[SpanRecord]:
    sink = OtlpSink()
    host, port = _host_port(args.listen)
    receivers: list[GrpcReceiver | HttpReceiver] = [GrpcReceiver(sink, host, port)]
    if args.http_port is not None:
        receivers.append(HttpReceiver(sink, host, args.http_port))
    print(f"receiving OTLP for {args.seconds:g}s on " + ", ".join(r.endpoint for r in receivers)
          + f" (start the server with OTEL_EXPORTER_OTLP_ENDPOINT={receivers[0].endpoint} lora-serve --tracing)",
          file=sys.stderr)
    try:
        time.sleep(args.seconds)
    except KeyboardInterrupt:
        pass
    for r in receivers:
        r.stop()
    if args.save:
        with open(args.save, "w") as f:
            for request in sink.trace_requests():
                f.write(json.dumps(to_otlp_json(request)) + "\n")
    return sink.spans()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.files and not args.listen:
        parser().error("give OTLP JSON files, or --listen PORT")
    spans: list[SpanRecord] = []
    for path in args.files:
        if not Path(path).is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
        try:
            spans += read_json_spans(path)
        except (OSError, ValueError) as e:  # one line, not a traceback
            print(f"error: {path}: {e.strerror if isinstance(e, OSError) else e}", file=sys.stderr)
            return 2
    if args.listen:
        spans += _receive(args)
    if args.trace_id is not None:
        args.trace_id = args.trace_id.lower()
        requests = {s.trace_id for s in spans if s.name.startswith("text_completion")}
        if args.trace_id not in requests:
            known = ", ".join(sorted(requests)[:5]) + (", ..." if len(requests) > 5 else "") or "none"
            print(f"error: no request (text_completion span) in trace {args.trace_id}; traces with one: {known}",
                  file=sys.stderr)
            return 1
    print(summary(spans, args.trace_id, args.batch_size, args.steps_shown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
