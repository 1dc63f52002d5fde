"""The OpenAI-compatible HTTP door (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. A request becomes the GenerateParams a gRPC request becomes (openai_params.py) and goes through the
same request front (service/front/: capacity, tokenizing, every limit, the adapter check) into the same
EngineRunner, so the two doors share validation, limits, errors and the batch."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.affinity import REPLICA_ID_HEADER
from service.errors import InvalidArgument, NotFound, Unavailable
from service.front import GenerateParams, RequestFront
from service.front.chat_template import ChatTemplate, render_chat
from service.http_api import adapter_mixes, openai_params, vllm_routes
from service.http_api.adapter_mixes import RequestedMix
from service.http_api.errors import error_body, error_response, grpc_status
from service.http_api.hosts import HostCheck, HostPolicy
from service.http_api.model_cards import model_cards
from service.http_api.prompts import completion_params
from service.http_api.protocol import ChatCompletionRequest, CompletionRequest, dumped
from service.http_api.request_checks import authorize, read_body, require_json
from service.http_api.responses import Responder
from service.http_api.sse import EventStream, until_disconnect
from service.http_api.tool_calls import ToolPlan, plan_tools
from service.lifecycle import ServingState
from service.security import BearerAuth, SecurityConfig
from service.telemetry.http_tracing import HttpTracer
from service.telemetry.prometheus import CONTENT_TYPE, PrometheusMetrics

log = logging.getLogger(__name__)
_GENERATE = "/loraserve.v1.Generation/Generate"  # the same tokens open both doors
_LIST = "/loraserve.v1.Adapters/ListAdapters"


@dataclass
class HttpDoor:
    """What the HTTP routes need from the server (the same objects the gRPC door uses)."""

    front: RequestFront  # the gRPC door's too: capacity, tokenizing, every limit, the adapter check, the runner
    security: SecurityConfig
    state: Callable[[], ServingState]
    metrics: PrometheusMetrics
    max_body_bytes: int
    chat_template: ChatTemplate | None = None
    tool_call_parser: str | None = None  # --tool-call-parser: tool_choice "auto" parses the model's calls
    tracer: HttpTracer | None = None
    replica_id: str = ""  # x-replica-id on every response ("" : none)
    host: str = "127.0.0.1"  # the address it listens on (--host): the Host names it answers to follow from it


def create_app(door: HttpDoor) -> FastAPI:
    # No trailing-slash redirects: Starlette builds their Location from the Host header; "/v1/models/" is a 404.
    app = FastAPI(title="lora-serve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    routes = _Routes(door)
    app.add_api_route("/health", routes.health, methods=["GET", "HEAD"])  # (HEAD: probes that send it)
    app.add_api_route("/ping", routes.health, methods=["GET", "POST", "HEAD"])  # (vLLM's /health, SageMaker's name)
    app.add_api_route("/metrics", routes.metrics, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models", routes.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])
    vllm_routes.register(app, door)  # vLLM's own: adapter loading, tokenize, version, /v1/models/{id}
    adapter_mixes.register(app, door)  # llama.cpp's /lora-adapters (the ids its per-request `lora` names)

    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # unknown route, method
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message, headers = str(exc.detail), dict(exc.headers or {})
        if exc.status_code == 405 and "Allow" in headers:  # (Starlette lists a set: sorted, for stable answers)
            headers["Allow"] = ", ".join(sorted(headers["Allow"].split(", ")))
            message = f"{message}: {request.url.path} takes {headers['Allow']}, not {request.method}"
        return JSONResponse(error_body(exc.status_code, message, code), status_code=exc.status_code, headers=headers)

    async def any_error(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, any_error)
    hosts = HostPolicy.for_server(door.security, door.host)
    if not hosts.allows_any:
        app.add_middleware(HostCheck, policy=hosts)
    if door.replica_id:  # (added last: outermost, so refusals carry it too)
        app.add_middleware(ReplicaHeader, replica_id=door.replica_id)
    return app


class ReplicaHeader:
    """x-replica-id on every response (errors and streams included): which replica behind a balancer answered.
    Plain ASGI, so a streamed body passes through untouched."""

    def __init__(self, app, replica_id: str):
        self.app = app
        self.header = (REPLICA_ID_HEADER.encode(), replica_id.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_header(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)
        return await self.app(scope, receive, send_with_header)


class _Routes:
    def __init__(self, door: HttpDoor):
        self.door = door
        self.front = door.front
        self.info = door.front.model_info()
        self.auth = BearerAuth(door.security)

    # --- open endpoints ----------------------------------------------------------------------------------
    async def health(self) -> JSONResponse:
        state = self.door.state()
        if state is ServingState.SERVING:
            return JSONResponse({"status": state.value})
        return JSONResponse(error_body(503, f"server is {state.value}", "unavailable"), status_code=503)

    async def metrics(self) -> Response:
        return Response(self.door.metrics.exposition(), media_type=CONTENT_TYPE)

    # --- authenticated -----------------------------------------------------------------------------------
    async def models(self, request: Request) -> JSONResponse:
        try:
            self._authorize(request, _LIST)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse({"object": "list", "data": model_cards(self.front)})

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", CompletionRequest)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", ChatCompletionRequest)

    # --- generation --------------------------------------------------------------------------------------
    async def _generate(self, request: Request, route: str, model: type) -> Response:
        tracer = self.door.tracer
        call = tracer.start(route, dict(request.headers)) if tracer is not None else None
        try:
            self._authorize(request, _GENERATE)
            if (state := self.door.state()) is not ServingState.SERVING:
                raise Unavailable(f"server is {state.value}; retry later" if state is ServingState.WARMING_UP
                                  else "server is draining (shutting down); retry on another replica")
            require_json(request.headers.get("content-type"))
            body = model.model_validate_json(await self._read_body(request))
            chat = isinstance(body, ChatCompletionRequest)
            bad = openai_params.unsupported_fields(body)
            if bad:
                raise InvalidArgument(bad)
            adapter = openai_params.resolve_adapter(body.model, request.headers.get(openai_params.ADAPTER_HEADER),
                                                    self.info.served_model_names)
            mix = adapter_mixes.requested_mix(body, adapter, self.front)
            rid = openai_params.request_id("chatcmpl" if chat else "cmpl", request.headers.get("x-request-id"),
                                           body.request_id)
            # (a completions prompt list: one GenerateParams per prompt, prompts.py)
            tools = (plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, self.door.tool_call_parser)
                     if chat else None)
            params = ([self._chat_params(body, adapter, rid, tools, mix)] if chat
                      else self._completion_params(body, adapter, rid, mix))
            if tracer is not None:
                tracer.record_request(call, params[0])
            try:
                parent = await self.front.submit(params)
            except NotFound as e:  # an adapter that is not loaded: `model`'s 404 (or the mix entry's)
                raise openai_params.openai_error(e, mix) from None
        except Exception as exc:  # noqa: BLE001 - every refusal is an OpenAI error body
            response = error_response(exc)
            if tracer is not None:
                code, message = grpc_status(exc)
                tracer.end(call, code, response.status_code, message=message)
            return response
        name = adapter or self.info.model  # (vLLM's: the base model under its first served name)
        responder = Responder(self.front, tracer, call, parent, body, name, tools)
        if body.stream:
            return EventStream(responder.events(), responder.close, parent.deliver,
                               headers={"x-request-id": parent.request_id})
        result = await until_disconnect(request.receive, responder.collect(), lambda: None)
        responder.close()
        if result is None:  # the client went away
            return Response(status_code=499)
        return result

    def _authorize(self, request: Request, method: str) -> None:
        authorize(self.auth, request, method)

    async def _read_body(self, request: Request) -> bytes:
        return await read_body(request, self.door.max_body_bytes)

    def _completion_params(self, body: CompletionRequest, adapter: str, rid: str, mix: RequestedMix
                           ) -> list[GenerateParams]:
        def params_for(prompt: str | list[int]) -> GenerateParams:
            if isinstance(prompt, str):
                return openai_params.generate_params(body, adapter, rid, text=prompt, mix=mix)
            return openai_params.generate_params(body, adapter, rid, token_ids=prompt, mix=mix)
        return completion_params(body.prompt, body.n or 1, self.front.max_request_sequences, params_for)

    def _chat_params(self, body: ChatCompletionRequest, adapter: str, rid: str, tools: ToolPlan | None,
                     mix: RequestedMix) -> GenerateParams:
        """The messages as the model's template writes them, tokenized by the front without adding special tokens
        (the template writes them) unless add_special_tokens asks."""
        variables = body.chat_template_kwargs
        if body.documents is not None:  # (vLLM passes them to the template as `documents`)
            variables = {**(variables or {}), "documents": body.documents}
        text = render_chat(self.door.chat_template, self.info.model, dumped(body.messages), body.add_generation_prompt,
                           variables, instead="use /v1/completions with a prompt you format yourself",
                           tools=body.tools)
        return openai_params.generate_params(body, adapter, rid, text=text, tools=tools, mix=mix)
