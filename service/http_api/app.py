"""The OpenAI-compatible HTTP door (FastAPI): /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics. A request becomes the GenerateRequest a gRPC client would send and goes through the gRPC servicer's
own `prepare` (tokenizing, every limit, the adapter check) into the same EngineRunner, so the two doors share
validation, limits, errors and the batch."""
from __future__ import annotations

import email.message
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.affinity import REPLICA_ID_HEADER
from service.errors import (
    FailedPrecondition,
    FieldViolation,
    InvalidArgument,
    ServiceError,
    Unavailable,
    status_of,
)
from service.grpc_api.interceptors import ServingState
from service.grpc_api.security import AuthInterceptor, SecurityConfig
from service.grpc_api.servicers import GenerationServicer
from service.http_api import convert
from service.http_api.chat_template import ChatTemplate, ChatTemplateError
from service.http_api.errors import HttpError, classify, error_body, error_response
from service.http_api.hosts import HostCheck, HostPolicy
from service.http_api.protocol import ChatCompletionRequest, CompletionRequest
from service.http_api.sse import DONE, EventStream, event, until_disconnect
from service.runner.request import GenerationRequest, RequestOutput
from service.runner.request_state import RequestState
from service.runner.scheduler import EngineRunner
from service.telemetry.http_tracing import HttpTracer
from service.telemetry.prometheus import CONTENT_TYPE, PrometheusMetrics

log = logging.getLogger(__name__)
_GENERATE = "/loraserve.v1.Generation/Generate"  # the same tokens open both doors
_LIST = "/loraserve.v1.Adapters/ListAdapters"


@dataclass
class HttpDoor:
    """What the HTTP routes need from the server (the same objects the gRPC door uses)."""

    runner: EngineRunner
    generation: GenerationServicer
    security: SecurityConfig
    state: Callable[[], ServingState]
    metrics: PrometheusMetrics
    max_body_bytes: int
    chat_template: ChatTemplate | None = None
    tracer: HttpTracer | None = None
    replica_id: str = ""  # x-replica-id on every response ("" : none)
    host: str = "127.0.0.1"  # the address it listens on (--host): the Host names it answers to follow from it


def create_app(door: HttpDoor) -> FastAPI:
    # No trailing-slash redirects: Starlette builds their Location from the Host header; "/v1/models/" is a 404.
    app = FastAPI(title="lora-serve", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    routes = _Routes(door)
    app.add_api_route("/health", routes.health, methods=["GET", "HEAD"])  # (HEAD: probes that send it)
    app.add_api_route("/metrics", routes.metrics, methods=["GET", "HEAD"])
    app.add_api_route("/v1/models", routes.models, methods=["GET", "HEAD"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", routes.chat_completions, methods=["POST"])

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
        self.runner = door.runner
        self.info = door.runner.model_info()
        self.auth = AuthInterceptor(door.security)

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
        created, info = convert.now(), self.info
        # vLLM's max_model_len, and the KV pool every entry shares (adapters run on the base model's cache)
        limits = {"max_model_len": info.max_seq_len, "num_kv_blocks": info.num_kv_blocks,
                  "block_size": info.block_size, "kv_cache_tokens": info.kv_cache_tokens}
        base = {"id": info.model, "object": "model", "created": created, "owned_by": "lora-serve",
                "root": info.model, "parent": None, **limits}
        adapters = [{"id": a.name, "object": "model", "created": created, "owned_by": "lora-serve",
                     "root": a.path, "parent": info.model, **limits}
                    for a in self.runner.list_adapters()]
        return JSONResponse({"object": "list", "data": [base, *adapters]})

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
            _require_json(request.headers.get("content-type"))
            body = model.model_validate_json(await self._read_body(request))
            chat = isinstance(body, ChatCompletionRequest)
            bad = convert.unsupported_fields(body)
            if bad:
                raise InvalidArgument(bad)
            adapter = convert.resolve_adapter(body.model, request.headers.get(convert.ADAPTER_HEADER), self.info.model)
            rid = convert.request_id("chatcmpl" if chat else "cmpl", request.headers.get("x-request-id"))
            msg = await (self._chat_message(body, adapter, rid) if chat else self._completion_message(body, adapter, rid))
            if tracer is not None:
                tracer.record_request(call, msg)
            try:
                req = await self.door.generation.prepare(msg)
            except Exception as e:  # noqa: BLE001 - refusals of a field, named as the OpenAI client names it
                raise convert.openai_error(e, "messages" if chat else "prompt") from None
            state = self.runner.add_request(req)
        except Exception as exc:  # noqa: BLE001 - every refusal is an OpenAI error body
            response = error_response(exc)
            if tracer is not None:
                code, message = _grpc_code(exc)
                tracer.end(call, code, response.status_code, message=message)
            return response
        name = body.model or self.info.model
        responder = _Responder(self, state, req, body, name, chat, call)
        if body.stream:
            return EventStream(responder.events(), responder.close, state.deliver,
                               headers={"x-request-id": req.request_id})
        result = await until_disconnect(request.receive, responder.collect(), lambda: None)
        responder.close()
        if result is None:  # the client went away
            return Response(status_code=499)
        return result

    def _authorize(self, request: Request, method: str) -> None:
        header = request.headers.get("authorization")
        refusal = self.auth.check(method, [("authorization", header)] if header is not None else [])
        if refusal is not None:
            code, message = refusal
            if header is None:
                message = "missing credentials: send the header 'Authorization: Bearer <token>'"
            raise HttpError(401, code, message)

    async def _read_body(self, request: Request) -> bytes:
        limit = self.door.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _too_large(int(declared), limit)
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(len(body), limit)
        return bytes(body)

    async def _completion_message(self, body: CompletionRequest, adapter: str, rid: str):
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidArgument([FieldViolation("prompt", (
                    f"one prompt per request, got a batch of {len(prompt)}; send one request per prompt"))])
            prompt = prompt[0]
        if isinstance(prompt, str):
            return convert.generate_request(body, adapter, rid, text=prompt)
        return convert.generate_request(body, adapter, rid, token_ids=prompt)

    async def _chat_message(self, body: ChatCompletionRequest, adapter: str, rid: str):
        template = self.door.chat_template
        if template is None:
            raise FailedPrecondition(
                f"model {self.info.model!r} has no chat template (tokenizer_config.json has no chat_template); "
                "use /v1/completions with a prompt you format yourself")
        messages = []
        for i, m in enumerate(body.messages):
            message = m.model_dump(exclude_none=True)
            if isinstance(m.content, list):  # content parts: text only
                if any(part.get("type") != "text" or not isinstance(part.get("text"), str) for part in m.content):
                    raise InvalidArgument([FieldViolation(f"messages[{i}].content",
                                                          "only text content parts are supported")])
                message["content"] = "".join(part["text"] for part in m.content)
            messages.append(message)
        try:
            text = template.render(messages, body.add_generation_prompt, body.chat_template_kwargs)
        except ChatTemplateError as e:
            raise InvalidArgument([FieldViolation("messages", str(e))]) from None
        # The template writes the special tokens itself (BOS...): tokenized without adding them again.
        ids = await self.door.generation.encode(text, add_special_tokens=False)
        return convert.generate_request(body, adapter, rid, token_ids=ids)


class _Responder:
    """One admitted request's answer: a JSON object, or server-sent events."""

    def __init__(self, routes: _Routes, state: RequestState, req: GenerationRequest, body: Any, model: str,
                 chat: bool, call):
        self.routes, self.state, self.req, self.body, self.model, self.chat, self.call = (
            routes, state, req, body, model, chat, call)
        self.created = convert.now()
        self.sent_chars = 0
        self._closed = False
        self._error: Exception | None = None
        self._finished = False

    def close(self) -> None:
        """However the response ended: the runner forgets the request (a no-op once finished), the span ends."""
        if self._closed:
            return
        self._closed = True
        self.routes.runner.abort(self.state)
        tracer = self.routes.door.tracer
        if tracer is not None:
            if self._error is not None:
                code, message = _grpc_code(self._error)
                tracer.end(self.call, code, 200, message=message)
            elif self._finished:
                tracer.end(self.call, grpc.StatusCode.OK, 200)
            else:
                tracer.end(self.call, grpc.StatusCode.CANCELLED, 499, cancelled=True)

    async def collect(self) -> JSONResponse:
        total = RequestOutput()
        try:
            while not total.finished:
                total.merge(await self.state.next_output())
        except ServiceError as exc:  # the engine failed this request: its error, no partial answer
            self._error = exc
            return error_response(exc)
        self._finished = True
        choice: dict[str, Any] = {"index": 0, "finish_reason": convert.finish_reason(total),
                                  "stop_reason": convert.stop_reason(total)}
        if self.body.return_token_ids:
            choice["token_ids"] = total.token_ids
        pieces = self.routes.runner.token_strings
        if self.chat:
            choice["message"] = {"role": "assistant", "content": total.text}
            choice["logprobs"] = convert.chat_logprobs(total, pieces) if total.logprobs else None
        else:
            choice["text"] = total.text
            choice["logprobs"] = convert.completion_logprobs(total, pieces, 0) if total.logprobs else None
        return JSONResponse({**self._head(), "choices": [choice], "usage": convert.usage(total)},
                            headers={"x-request-id": self.req.request_id})

    async def events(self) -> AsyncIterator[bytes]:
        pieces = self.routes.runner.token_strings
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        if self.chat:  # OpenAI's first chunk: the role
            yield event(self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}))
        while True:
            try:
                out = await self.state.next_output()
            except ServiceError as exc:  # mid-stream failure: an error event, then the end (as vLLM does)
                self._error = exc
                _, body, _ = classify(exc)
                yield event(body)
                yield DONE
                return
            choice: dict[str, Any] = {"index": 0, "finish_reason": convert.finish_reason(out)}
            if out.finished:
                choice["stop_reason"] = convert.stop_reason(out)
            if self.body.return_token_ids:
                choice["token_ids"] = out.token_ids
            if self.chat:
                choice["delta"] = {"content": out.text} if out.text or not out.finished else {}
                choice["logprobs"] = convert.chat_logprobs(out, pieces) if out.logprobs else None
            else:
                choice["text"] = out.text
                choice["logprobs"] = (convert.completion_logprobs(out, pieces, self.sent_chars)
                                      if out.logprobs else None)
            self.sent_chars += len(out.text)
            yield event(self._chunk(choice))
            if out.finished:
                self._finished = True
                if include_usage:
                    yield event({**self._head(chunk=True), "choices": [], "usage": convert.usage(out)})
                yield DONE
                return

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.req.request_id, "object": kind, "created": self.created, "model": self.model}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [choice]}


def _require_json(content_type: str | None) -> None:
    """415 unless the body is declared JSON (application/json or application/*+json, UTF-8), as FastAPI reads
    bodies, except that a missing Content-Type is refused too: a page on another origin can POST text/plain, a
    form or an untyped body without the browser asking first, and a JSON type needs that permission."""
    message = email.message.Message()
    message["content-type"] = content_type or ""
    subtype = message.get_content_subtype()
    charset = message.get_content_charset() or "utf-8"
    if (content_type and message.get_content_maintype() == "application" and (subtype == "json" or
            subtype.endswith("+json")) and charset.replace("-", "") == "utf8"):
        return
    got = f"Content-Type {content_type[:100]!r}" if content_type else "no Content-Type"
    raise HttpError(415, grpc.StatusCode.INVALID_ARGUMENT,
                    f"the request body must be JSON: send the header 'Content-Type: application/json' (got {got})")


def _too_large(size: int, limit: int) -> HttpError:
    return HttpError(413, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     f"the request body has {size} bytes; this server accepts at most {limit} (--max-message-bytes)")


def _grpc_code(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, (ValidationError, RequestValidationError)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, HttpError):
        return exc.code, str(exc)
    code, message, _ = status_of(exc)
    return code, message

