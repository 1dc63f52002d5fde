"""One servicer per service of loraserve.v1. Handlers parse, call the request front (service/front/), and raise;
the interceptor turns what they raise into statuses."""
from __future__ import annotations

import dataclasses

import grpc

from service._proto import pb, pb_grpc
from service.affinity import ADAPTER_ID_HEADER, REPLICA_ID_HEADER, adapter_header_problem
from service.errors import FieldViolation, InvalidArgument
from service.front import RequestFront, RequestOutput
from service.front.chat_template import ChatTemplate, render_chat
from service.grpc_api.params import add_generation_prompt, chat_messages, from_proto

_FINISH_REASONS = {
    "length": pb.FINISH_REASON_LENGTH, "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS, "cancelled": pb.FINISH_REASON_CANCELLED, "grammar": pb.FINISH_REASON_GRAMMAR,
}
_TIERS = {"disk": pb.ADAPTER_TIER_DISK, "host": pb.ADAPTER_TIER_HOST, "device": pb.ADAPTER_TIER_DEVICE}


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, front: RequestFront, replica_id: str = "", chat_template: ChatTemplate | None = None):
        self._front = front  # the HTTP door's too: tokenizing, every limit, the adapter check, capacity, the runner
        self._chat_template = chat_template  # the HTTP door's too: one rendering for both
        self._replica_metadata = ((REPLICA_ID_HEADER, replica_id),) if replica_id else ()
        self._model = front.model_info()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        if self._replica_metadata:  # first, so a refusal below also names the replica that refused
            await context.send_initial_metadata(self._replica_metadata)
        self._check_adapter_header(request, context)
        params = from_proto(request)
        if request.WhichOneof("input") == "chat":
            text = render_chat(self._chat_template, self._model.model, chat_messages(request.chat),
                               add_generation_prompt(request.chat), None, field="chat.messages",
                               instead="send text you format yourself")
            params = dataclasses.replace(params, text=text, add_special_tokens=False)
        parent = await self._front.submit([params])
        # Cancellation, deadline or a closed stream: the runner drops every choice within one step.
        context.add_done_callback(lambda _ctx: self._front.abort(parent))
        try:
            while not parent.finished:  # each choice's messages in order, its own last one included
                out = await parent.next_output()
                # A write waits while the client does not read (HTTP/2 flow control); the parent may end it.
                await parent.deliver(context.write(_response(parent.request_id, out)))
        finally:
            self._front.abort(parent)  # no-op once finished

    def _check_adapter_header(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        """x-adapter-id, when sent, must name the request's adapter: the balancer routed on it."""
        header = next((v for k, v in context.invocation_metadata() or () if k == ADAPTER_ID_HEADER), None)
        if isinstance(header, bytes):  # (only "-bin" keys carry bytes; be safe)
            header = header.decode("utf-8", "replace")
        problem = adapter_header_problem(header, request.adapter, self._model.served_model_names, "adapter")
        if problem is not None:
            raise InvalidArgument([FieldViolation("adapter", problem)])

    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        ids = await self._front.tokenize(request.text, add_special)
        return pb.TokenizeResponse(token_ids=ids, tokens=self._front.token_strings(ids))

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        m = self._model
        return pb.ModelInfoResponse(
            model=m.model, architecture=m.architecture, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
            max_batch_size=m.max_num_seqs, max_loras_per_batch=m.max_loras_per_batch,
            max_lora_rank=m.max_lora_rank, dtype=m.dtype, device=m.device, compiled=m.compiled,
            eos_token_ids=list(m.eos_token_ids), max_queue=self._front.limits.max_queue,
            max_cpu_lora_bytes=m.max_cpu_lora_bytes, on_demand_adapters=m.on_demand_adapters,
            max_num_seqs=m.max_num_seqs, num_kv_blocks=m.num_kv_blocks, block_size=m.block_size,
            kv_cache_tokens=m.kv_cache_tokens, prefix_caching=m.prefix_caching,
        )


class AdaptersServicer(pb_grpc.AdaptersServicer):
    def __init__(self, front: RequestFront):
        self._front = front  # (the HTTP door's /v1/load_lora_adapter loads through it too)

    async def ListAdapters(self, request, context) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=[self._info(a) for a in self._front.list_adapters()])

    async def LoadAdapter(self, request: pb.LoadAdapterRequest, context) -> pb.LoadAdapterResponse:
        # No path: a prefetch of an adapter-directory adapter (its name is checked before any file access).
        info = await self._front.load_adapter(request.name, request.path)
        return pb.LoadAdapterResponse(adapter=self._info(info))

    async def UnloadAdapter(self, request: pb.UnloadAdapterRequest, context) -> pb.UnloadAdapterResponse:
        await self._front.unload_adapter(request.name)
        return pb.UnloadAdapterResponse()

    def _info(self, info) -> pb.AdapterInfo:
        msg = pb.AdapterInfo(name=info.name, path=str(info.path), rank=info.rank, alpha=info.alpha,
                             target_modules=list(info.target_modules),
                             active_requests=self._front.adapter_users(info.name))
        if info.device_slot is not None:
            msg.device_slot = info.device_slot
        msg.tier = _TIERS[info.tier]
        msg.on_demand = info.on_demand
        msg.host_bytes = info.host_bytes
        return msg


def _response(request_id: str, out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=request_id, index=out.index, text=out.text, token_ids=out.token_ids,
                              logprobs=out.logprobs, top_logprobs=_top_logprobs(out.top_logprobs))
    if out.prompt_logprobs:  # the first message of each choice, with response.prompt_logprobs
        msg.prompt_logprobs.extend(out.prompt_logprobs)
        msg.prompt_top_logprobs.extend(_top_logprobs(out.prompt_top_logprobs))
    if out.finished:  # per choice: its own tokens (prompt_tokens: the prompt, which every choice reads)
        msg.finish_reason = _FINISH_REASONS[out.finish_reason]
        msg.usage.prompt_tokens = out.prompt_tokens
        msg.usage.completion_tokens = out.completion_tokens
        msg.usage.cached_tokens = out.cached_tokens
        if out.stop is not None:
            msg.stop = out.stop
        if out.stop_token_id is not None:
            msg.stop_token_id = out.stop_token_id
    return msg


def _top_logprobs(tops: list[list[tuple[int, float]]]) -> list[pb.TopLogprobs]:
    return [pb.TopLogprobs(token_ids=[t for t, _ in top], logprobs=[p for _, p in top]) for top in tops]
