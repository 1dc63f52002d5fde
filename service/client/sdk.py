"""Python SDK for lora-serve: `LoraServeClient` (blocking) and `AsyncLoraServeClient` (asyncio).

    from service.client import LoraServeClient
    with LoraServeClient("localhost:50051") as client:
        for chunk in client.generate("Once upon a time", adapter="pirate", max_new_tokens=64):
            print(chunk.text, end="", flush=True)

Every RPC error is raised as a `LoraServeError` subclass (see errors.py beside this file).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service._proto import pb, pb_grpc
from service.affinity import REPLICA_ID_HEADER
from service.client.channel import ClientTLS, bearer, open_channel, with_trace_context
from service.client.errors import from_rpc_error
from service.client.requests import build_generate_request, generate_metadata

_FINISH_REASONS = {pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_STOP: "stop",
                   pb.FINISH_REASON_EOS: "eos", pb.FINISH_REASON_CANCELLED: "cancelled",
                   pb.FINISH_REASON_GRAMMAR: "grammar"}


# --- results ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the server's prefix cache (included in prompt_tokens)


@dataclass(frozen=True)
class GenerateChunk:
    """One streamed message. finish_reason ("length", "stop", "eos", "grammar", "cancelled") is set on the last."""

    text: str
    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop: str | None = None           # the stop string that ended generation
    stop_token_id: int | None = None  # the stop token that ended generation
    usage: Usage | None = None
    request_id: str = ""
    replica_id: str = ""  # the server replica that answered (its x-replica-id), "" if it sent none
    index: int = 0        # which choice (0 .. n - 1) it belongs to
    # With prompt_logprobs, in the first chunk: per prompt token after the first, its log-probability and the top k.
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class Completion:
    """A whole generation (`complete()`): the chunks joined."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[float] = field(default_factory=list)
    stop: str | None = None
    stop_token_id: int | None = None
    request_id: str = ""
    replica_id: str = ""
    index: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    path: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    device_slot: int | None
    active_requests: int
    tier: str = "disk"        # where its weights are: "device" (a slot), "host" (memory) or "disk"
    on_demand: bool = False   # served from an adapter directory (not registered)
    host_bytes: int = 0


@dataclass(frozen=True)
class ModelInfo:
    model: str
    architecture: str
    vocab_size: int
    max_seq_len: int
    max_batch_size: int       # the old name of max_num_seqs (same value)
    max_loras_per_batch: int
    max_lora_rank: int
    dtype: str
    device: str
    compiled: bool
    eos_token_ids: tuple[int, ...]
    max_queue: int
    max_cpu_lora_bytes: int = 0
    on_demand_adapters: bool = False
    max_num_seqs: int = 0     # sequences running at once
    num_kv_blocks: int = 0    # the paged KV cache: num_kv_blocks x block_size = kv_cache_tokens
    block_size: int = 0
    kv_cache_tokens: int = 0
    prefix_caching: bool = False


# --- proto conversions (shared by both clients; requests: requests.py) ------------------------------
def replica_of(initial_metadata) -> str:
    return next((v for k, v in initial_metadata or () if k == REPLICA_ID_HEADER), "")


def chunk_from_proto(msg: pb.GenerateResponse, replica_id: str = "") -> GenerateChunk:
    finished = msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED
    return GenerateChunk(
        text=msg.text, token_ids=list(msg.token_ids), logprobs=list(msg.logprobs),
        top_logprobs=[list(zip(t.token_ids, t.logprobs, strict=True)) for t in msg.top_logprobs],
        finish_reason=_FINISH_REASONS.get(msg.finish_reason) if finished else None,
        stop=msg.stop if msg.HasField("stop") else None,
        stop_token_id=msg.stop_token_id if msg.HasField("stop_token_id") else None,
        usage=Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens)
        if finished else None,
        request_id=msg.request_id, replica_id=replica_id, index=msg.index,
        prompt_logprobs=list(msg.prompt_logprobs),
        prompt_top_logprobs=[list(zip(t.token_ids, t.logprobs, strict=True)) for t in msg.prompt_top_logprobs],
    )


def join_chunks(chunks: list[GenerateChunk]) -> Completion:
    """The chunks of one choice, joined."""
    last = chunks[-1]
    return Completion(
        text="".join(c.text for c in chunks), token_ids=[t for c in chunks for t in c.token_ids],
        finish_reason=last.finish_reason or "", usage=last.usage or Usage(0, 0),
        logprobs=[p for c in chunks for p in c.logprobs], stop=last.stop, stop_token_id=last.stop_token_id,
        request_id=last.request_id, replica_id=last.replica_id, index=last.index,
        prompt_logprobs=[p for c in chunks for p in c.prompt_logprobs],
        prompt_top_logprobs=[t for c in chunks for t in c.prompt_top_logprobs],
    )


def join_choices(chunks: list[GenerateChunk]) -> list[Completion]:
    """A stream of n choices (interleaved): one Completion per choice, by index."""
    by_index: dict[int, list[GenerateChunk]] = {}
    for chunk in chunks:
        by_index.setdefault(chunk.index, []).append(chunk)
    return [join_chunks(by_index[i]) for i in sorted(by_index)]


def _one_choice(params: dict) -> None:
    if (params.get("n") or 1) > 1:
        raise ValueError("n > 1 gives several completions: use complete_choices()")


def _adapter_info(msg: pb.AdapterInfo) -> AdapterInfo:
    return AdapterInfo(msg.name, msg.path, msg.rank, msg.alpha, tuple(msg.target_modules),
                       msg.device_slot if msg.HasField("device_slot") else None, msg.active_requests,
                       _TIER_NAMES.get(msg.tier, "disk"), msg.on_demand, msg.host_bytes)


def _model_info(msg: pb.ModelInfoResponse) -> ModelInfo:
    return ModelInfo(msg.model, msg.architecture, msg.vocab_size, msg.max_seq_len, msg.max_batch_size,
                     msg.max_loras_per_batch, msg.max_lora_rank, msg.dtype, msg.device, msg.compiled,
                     tuple(msg.eos_token_ids), msg.max_queue, msg.max_cpu_lora_bytes, msg.on_demand_adapters,
                     msg.max_num_seqs, msg.num_kv_blocks, msg.block_size, msg.kv_cache_tokens, msg.prefix_caching)


_TIER_NAMES = {pb.ADAPTER_TIER_DISK: "disk", pb.ADAPTER_TIER_HOST: "host", pb.ADAPTER_TIER_DEVICE: "device"}


_HEALTH_NAMES = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}


# --- blocking client --------------------------------------------------------------------------------
class LoraServeClient:
    def __init__(self, target: str = "localhost:50051", *, timeout: float | None = None,
                 channel: grpc.Channel | None = None, options: Sequence[tuple] = (),
                 token: str | None = None, admin_token: str | None = None, tls: ClientTLS | None = None):
        """`timeout`: default per-call deadline in seconds (None: none). `token`: bearer token for every
        call; `admin_token`: for LoadAdapter / UnloadAdapter (default: `token`). `tls`: see ClientTLS."""
        self._channel = channel or open_channel(target, tls, options)
        self._metadata, self._admin_metadata = bearer(token), bearer(admin_token or token)
        self._generation = pb_grpc.GenerationStub(self._channel)
        self._adapters = pb_grpc.AdaptersStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout = timeout

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                 **params) -> Iterator[GenerateChunk]:
        """Stream chunks as the server produces them. Leaving the loop early cancels the request.
        `params`: see build_generate_request (adapter, max_new_tokens, temperature, stop, ...)."""
        call = self._generation.Generate(build_generate_request(prompt, **params), timeout=self._timeout(timeout),
                                         metadata=with_trace_context(generate_metadata(self._metadata, params)))
        try:
            replica = None
            for msg in call:
                if replica is None:
                    replica = replica_of(call.initial_metadata())
                yield chunk_from_proto(msg, replica)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()  # no-op when the stream is done

    def complete(self, prompt: str | Sequence[int], **params) -> Completion:
        _one_choice(params)
        return join_chunks(list(self.generate(prompt, **params)))

    def complete_choices(self, prompt: str | Sequence[int], **params) -> list[Completion]:
        """With `n`: every choice, joined (index order)."""
        return join_choices(list(self.generate(prompt, **params)))

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list(self._unary(self._generation.Tokenize, req).token_ids)

    def model_info(self) -> ModelInfo:
        return _model_info(self._unary(self._generation.ModelInfo, pb.ModelInfoRequest()))

    def list_adapters(self) -> list[AdapterInfo]:
        return [_adapter_info(a) for a in self._unary(self._adapters.ListAdapters, pb.ListAdaptersRequest()).adapters]

    def load_adapter(self, name: str, path: str = "") -> AdapterInfo:
        """Register `name` from directory `path` on the server; with no path, read adapter `name` from the
        server's adapter directories into its host memory (a prefetch)."""
        resp = self._unary(self._adapters.LoadAdapter, pb.LoadAdapterRequest(name=name, path=str(path)),
                           metadata=with_trace_context(self._admin_metadata))
        return _adapter_info(resp.adapter)

    def unload_adapter(self, name: str) -> None:
        self._unary(self._adapters.UnloadAdapter, pb.UnloadAdapterRequest(name=name), metadata=with_trace_context(self._admin_metadata))

    def health(self, service: str = "") -> str:
        """"SERVING", "NOT_SERVING", ... (grpc.health.v1) for the server or one service."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return _HEALTH_NAMES[resp.status]

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> LoraServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _unary(self, method, request, timeout: float | None = None, metadata=None):
        try:
            return method(request, timeout=self._timeout(timeout), metadata=with_trace_context(metadata or self._metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None


# --- asyncio client ---------------------------------------------------------------------------------
class AsyncLoraServeClient:
    def __init__(self, target: str = "localhost:50051", *, timeout: float | None = None,
                 channel: grpc.aio.Channel | None = None, options: Sequence[tuple] = (),
                 token: str | None = None, admin_token: str | None = None, tls: ClientTLS | None = None):
        self._channel = channel or open_channel(target, tls, options, aio=True)
        self._metadata, self._admin_metadata = bearer(token), bearer(admin_token or token)
        self._generation = pb_grpc.GenerationStub(self._channel)
        self._adapters = pb_grpc.AdaptersStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout = timeout

    async def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None,
                       **params) -> AsyncIterator[GenerateChunk]:
        call = self._generation.Generate(build_generate_request(prompt, **params), timeout=self._timeout(timeout),
                                         metadata=with_trace_context(generate_metadata(self._metadata, params)))
        try:
            replica = None
            async for msg in call:
                if replica is None:
                    replica = replica_of(await call.initial_metadata())
                yield chunk_from_proto(msg, replica)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            call.cancel()

    async def complete(self, prompt: str | Sequence[int], **params) -> Completion:
        _one_choice(params)
        return join_chunks([c async for c in self.generate(prompt, **params)])

    async def complete_choices(self, prompt: str | Sequence[int], **params) -> list[Completion]:
        return join_choices([c async for c in self.generate(prompt, **params)])

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        req = pb.TokenizeRequest(text=text, add_special_tokens=add_special_tokens)
        return list((await self._unary(self._generation.Tokenize, req)).token_ids)

    async def model_info(self) -> ModelInfo:
        return _model_info(await self._unary(self._generation.ModelInfo, pb.ModelInfoRequest()))

    async def list_adapters(self) -> list[AdapterInfo]:
        resp = await self._unary(self._adapters.ListAdapters, pb.ListAdaptersRequest())
        return [_adapter_info(a) for a in resp.adapters]

    async def load_adapter(self, name: str, path: str = "") -> AdapterInfo:
        resp = await self._unary(self._adapters.LoadAdapter, pb.LoadAdapterRequest(name=name, path=str(path)),
                                 metadata=with_trace_context(self._admin_metadata))
        return _adapter_info(resp.adapter)

    async def unload_adapter(self, name: str) -> None:
        await self._unary(self._adapters.UnloadAdapter, pb.UnloadAdapterRequest(name=name),
                          metadata=with_trace_context(self._admin_metadata))

    async def health(self, service: str = "") -> str:
        resp = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service))
        return _HEALTH_NAMES[resp.status]

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncLoraServeClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def _unary(self, method, request, timeout: float | None = None, metadata=None):
        try:
            return await method(request, timeout=self._timeout(timeout), metadata=with_trace_context(metadata or self._metadata))
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
