"""One servicer per service of loraserve.v1. Handlers validate, call the runner or engine, and raise;
the interceptor turns what they raise into statuses."""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc

from service._proto import pb, pb_grpc
from service.affinity import (
    ADAPTER_ID_HEADER,
    REPLICA_ID_HEADER,
    adapter_header_problem,
)
from service.errors import FailedPrecondition, FieldViolation, InvalidArgument, NotFound
from service.grpc_api.heap import LARGE_REQUEST_BYTES, HeapTrimmer
from service.grpc_api.security import check_adapter_path
from service.grpc_api.validation import MAX_NAME_CHARS, validate_generate
from service.limits import RequestLimits
from service.runner.request import GenerationRequest, RequestOutput
from service.runner.scheduler import EngineRunner

log = logging.getLogger(__name__)

_FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS, "cancelled": pb.FINISH_REASON_CANCELLED,
}
_TIERS = {"disk": pb.ADAPTER_TIER_DISK, "host": pb.ADAPTER_TIER_HOST, "device": pb.ADAPTER_TIER_DEVICE}
_TOKENIZE_IN_THREAD_CHARS = 4096  # longer texts are tokenized off the event loop (the tokenizer thread)
_MAX_PATH_CHARS = 4096


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, runner: EngineRunner, limits: RequestLimits = RequestLimits(), replica_id: str = ""):
        self._runner = runner
        self._replica_metadata = ((REPLICA_ID_HEADER, replica_id),) if replica_id else ()
        self._model = info = runner.model_info()
        self._limits = limits
        # A text longer than this cannot fit in a prompt whatever it says: refused before it is tokenized.
        self._max_prompt = min(info.max_seq_len - 1, limits.max_prompt_tokens or info.max_seq_len)
        self._max_text_chars = self._max_prompt * info.max_token_chars
        # One thread: a burst of long texts queues there instead of taking every core from the engine thread.
        self._tokenizer_pool: ThreadPoolExecutor | None = None
        self._heap = HeapTrimmer()

    async def prepare(self, request: pb.GenerateRequest) -> GenerationRequest:
        """A GenerateRequest checked against every limit, its text tokenized (both front doors come here)."""
        self._runner.check_capacity()  # RESOURCE_EXHAUSTED / UNAVAILABLE before any work
        if len(request.text) + 4 * len(request.token_ids.ids) >= LARGE_REQUEST_BYTES:
            self._heap.after_large_request()
        prompt_ids = None
        if request.WhichOneof("input") == "text":
            prompt_ids = await self.encode(request.text)
        req = validate_generate(request, prompt_ids, self._limits, self._model)
        if req.adapter is not None and not self._runner.has_adapter(req.adapter):
            raise NotFound("adapter", req.adapter)
        return req

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self._replica_metadata:  # first, so a refusal below also names the replica that refused
            await context.send_initial_metadata(self._replica_metadata)
        self._check_adapter_header(request, context)
        req = await self.prepare(request)
        state = self._runner.add_request(req)
        # Cancellation, deadline or a closed stream: the runner drops the request within one step.
        context.add_done_callback(lambda _ctx: self._runner.abort(state))
        try:
            while True:
                out = await state.next_output()
                # A write waits while the client does not read (HTTP/2 flow control); the state may end it.
                await state.deliver(context.write(_response(req.request_id, out)))
                if out.finished:
                    return
        finally:
            self._runner.abort(state)  # no-op once finished

    def _check_adapter_header(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """x-adapter-id, when sent, must name the request's adapter: the balancer routed on it."""
        header = next((v for k, v in context.invocation_metadata() or () if k == ADAPTER_ID_HEADER), None)
        if isinstance(header, bytes):  # (only "-bin" keys carry bytes; be safe)
            header = header.decode("utf-8", "replace")
        problem = adapter_header_problem(header, request.adapter, self._model.model, "adapter")
        if problem is not None:
            raise InvalidArgument([FieldViolation("adapter", problem)])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        if len(request.text) >= LARGE_REQUEST_BYTES:
            self._heap.after_large_request()
        ids = await self.encode(request.text, add_special)
        return pb.TokenizeResponse(token_ids=ids, tokens=self._runner.token_strings(ids))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        m = self._model
        return pb.ModelInfoResponse(
            model=m.model, architecture=m.architecture, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
            max_batch_size=m.max_num_seqs, max_loras_per_batch=m.max_loras_per_batch,
            max_lora_rank=m.max_lora_rank, dtype=m.dtype, device=m.device, compiled=m.compiled,
            eos_token_ids=list(m.eos_token_ids), max_queue=self._runner.limits.max_queue,
            max_cpu_lora_bytes=m.max_cpu_lora_bytes, on_demand_adapters=m.on_demand_adapters,
            max_num_seqs=m.max_num_seqs, num_kv_blocks=m.num_kv_blocks, block_size=m.block_size,
            kv_cache_tokens=m.kv_cache_tokens, prefix_caching=m.prefix_caching,
        )

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > self._max_text_chars:
            raise InvalidArgument([FieldViolation("text", (
                f"the text has {len(text)} characters; a prompt of at most {self._max_prompt} tokens holds at "
                f"most {self._max_text_chars} characters with this model's tokenizer (--max-prompt-tokens)"))])
        encode = self._runner.encode
        if len(text) <= _TOKENIZE_IN_THREAD_CHARS:
            return encode(text, add_special_tokens)
        if self._tokenizer_pool is None:
            self._tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, encode, text, add_special_tokens)


class AdaptersServicer(pb_grpc.AdaptersServicer):
    def __init__(self, runner: EngineRunner):
        self._runner = runner

    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=[self._info(a) for a in self._runner.list_adapters()])

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.LoadAdapterResponse:
        # No path: a prefetch of an adapter-directory adapter (its name is checked before any file access).
        required = ("name",) if self._runner.model_info().on_demand_adapters else ("name", "path")
        bad = [FieldViolation(f, "must not be empty") for f in required if not getattr(request, f)]
        bad += [FieldViolation(f, f"at most {n} characters") for f, n in (("name", MAX_NAME_CHARS),
                                                                          ("path", _MAX_PATH_CHARS))
                if len(getattr(request, f)) > n]
        if bad:
            raise InvalidArgument(bad)
        if not request.path:
            if not self._runner.has_adapter(request.name):
                raise NotFound("adapter", request.name)
            info = await self._runner.load_adapter(request.name, None)
            return pb.LoadAdapterResponse(adapter=self._info(info))
        check_adapter_path(request.path, self._runner.adapter_roots)  # a precise message for escapes
        if self._runner.adapter_users(request.name):
            raise FailedPrecondition(f"adapter {request.name!r} is in use by in-flight requests; "
                                     "it cannot be replaced now")
        # (An unreadable path is an AdapterError from load_adapter: FAILED_PRECONDITION, docs/errors.md L06.)
        info = await self._runner.load_adapter(request.name, request.path)
        log.info("loaded adapter %s from %s (rank %d)", info.name, info.path, info.rank)
        return pb.LoadAdapterResponse(adapter=self._info(info))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        name = request.name
        if not name:
            raise InvalidArgument([FieldViolation("name", "must not be empty")])
        if len(name) > MAX_NAME_CHARS:
            raise InvalidArgument([FieldViolation("name", f"at most {MAX_NAME_CHARS} characters")])
        if not self._runner.has_adapter(name):
            raise NotFound("adapter", name)
        users = self._runner.adapter_users(name)
        if users:
            raise FailedPrecondition(f"adapter {name!r} is in use by {users} in-flight requests")
        await self._runner.unload_adapter(name)
        log.info("unloaded adapter %s", name)
        return pb.UnloadAdapterResponse()

    def _info(self, info) -> pb.AdapterInfo:
        msg = pb.AdapterInfo(name=info.name, path=str(info.path), rank=info.rank, alpha=info.alpha,
                             target_modules=list(info.target_modules),
                             active_requests=self._runner.adapter_users(info.name))
        if info.device_slot is not None:
            msg.device_slot = info.device_slot
        msg.tier = _TIERS[info.tier]
        msg.on_demand = info.on_demand
        msg.host_bytes = info.host_bytes
        return msg


def _response(request_id: str, out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, text=out.text, token_ids=out.token_ids,
                              logprobs=out.logprobs,
                              top_logprobs=[pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[p for _, p in top])
                                            for top in out.top_logprobs])
    if out.finished:
        msg.finish_reason = _FINISH_REASONS[out.finish_reason]
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        msg.usage.cached_tokens = out.cached_tokens
        if out.stop is not None:
            msg.stop = out.stop
        if out.stop_token_id is not None:
            msg.stop_token_id = out.stop_token_id
    return msg
