"""vLLM's own endpoints beside OpenAI's, with vLLM 0.32's request and response shapes, statuses and (where
operators match on them) messages: POST /v1/load_lora_adapter and /v1/unload_lora_adapter (what the inference
gateway's LoRA syncer calls), POST /tokenize and /detokenize, GET /version and GET /v1/models/{id}. (/ping is
/health, registered beside it.)

Each route stands for a gRPC method and is authorized by that method's policy: adapter loading as LoadAdapter
(the admin token, --disable-adapter-management), tokenizing as Tokenize (the API token), a model as
ListAdapters; adapters are loaded through the request front as gRPC's are (service/front/adapter_management.py:
roots, in-use refusal)."""
from __future__ import annotations

import importlib.metadata
import json
import os
from typing import TYPE_CHECKING

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from service.errors import AdapterError, AdapterNameError, AdapterPathError, FieldViolation, InvalidArgument, Unavailable
from service.front.chat_template import render_chat
from service.http_api.errors import HttpError, error_body, error_response
from service.http_api.model_cards import model_cards
from service.http_api.protocol import dumped
from service.http_api.request_checks import authorize, read_body, require_json
from service.http_api.vllm_protocol import (
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    UnloadLoRAAdapterRequest,
    unsupported_fields,
)
from service.lifecycle import ServingState
from service.limits import MAX_NAME_CHARS
from service.security import BearerAuth

if TYPE_CHECKING:
    from service.http_api.app import HttpDoor

_LOAD = "/loraserve.v1.Adapters/LoadAdapter"
_UNLOAD = "/loraserve.v1.Adapters/UnloadAdapter"
_TOKENIZE = "/loraserve.v1.Generation/Tokenize"
_LIST = "/loraserve.v1.Adapters/ListAdapters"
_LORA_FIELDS = {"name": "lora_name", "path": "lora_path"}  # AdapterManagement's field names → vLLM's


def register(app: FastAPI, door: HttpDoor) -> None:
    routes = _VllmRoutes(door)
    app.add_api_route("/v1/load_lora_adapter", routes.load_lora_adapter, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", routes.unload_lora_adapter, methods=["POST"])
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/version", routes.version, methods=["GET", "HEAD"])
    # (:path: a served model name may hold "/", as "org/model" does)
    app.add_api_route("/v1/models/{model_id:path}", routes.model, methods=["GET", "HEAD"])


def package_version() -> str:
    try:
        return importlib.metadata.version("lora-serve")
    except importlib.metadata.PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"


class _VllmRoutes:
    def __init__(self, door: HttpDoor):
        self.door = door
        self.front = door.front
        self.auth = BearerAuth(door.security)
        self.version_body = {"version": package_version()}

    # --- adapters ----------------------------------------------------------------------------------------
    async def load_lora_adapter(self, request: Request) -> Response:
        try:
            body = await self._body(request, _LOAD, LoadLoRAAdapterRequest)
            name, path = body.lora_name, body.lora_path
            if not name or not path:
                raise _bad_request("Both 'lora_name' and 'lora_path' must be provided.")
            _check_name_length(name)
            if self.front.model_info().is_base_model(name):
                raise _bad_request(f"The lora adapter '{name}' conflicts with a served base model.", "lora_name")
            if not body.load_inplace and self.front.is_adapter_known(name):
                raise _bad_request(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                                   "adapter in place, set 'load_inplace' to True.", "lora_name")
            try:
                await self.front.load_adapter(name, path)
            except AdapterError as e:
                if isinstance(e, (AdapterNameError, AdapterPathError)):
                    raise
                # (only reached inside the adapter roots: a path outside them was refused without a look)
                if not os.path.exists(os.path.expanduser(path)):
                    raise HttpError(404, grpc.StatusCode.NOT_FOUND,
                                    f"Loading lora {name} failed: No adapter found for {path}", "lora_path") from None
                raise
        except Exception as exc:  # noqa: BLE001 - every refusal is an error body
            return error_response(_vllm_fields(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            body = await self._body(request, _UNLOAD, UnloadLoRAAdapterRequest)
            name = body.lora_name
            if not name:
                raise _bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
            _check_name_length(name)
            if not self.front.is_adapter_known(name):
                raise HttpError(404, grpc.StatusCode.NOT_FOUND, f"The lora adapter '{name}' cannot be found.",
                                "lora_name")
            await self.front.unload_adapter(name)
        except Exception as exc:  # noqa: BLE001
            return error_response(_vllm_fields(exc))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    # --- tokenizer ---------------------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request, _TOKENIZE, (TokenizeCompletionRequest, TokenizeChatRequest))
            self._check_model(body.model)
            info = self.front.model_info()
            if isinstance(body, TokenizeChatRequest):
                field = "messages"
                text = render_chat(self.door.chat_template, info.model, dumped(body.messages), body.add_generation_prompt,
                                   body.chat_template_kwargs, instead="send a 'prompt' you format yourself",
                                   tools=body.tools)
            else:
                field, text = "prompt", body.prompt
            ids = await self.front.tokenize(text, body.add_special_tokens, field)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse({"count": len(ids), "max_model_len": info.max_seq_len, "tokens": ids,
                             "token_strs": self.front.token_strings(ids) if body.return_token_strs else None})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request, _TOKENIZE, DetokenizeRequest)
            self._check_model(body.model)
            info = self.front.model_info()
            if len(body.tokens) > info.max_seq_len:  # (no sequence of this model is longer; bounds the work)
                raise InvalidArgument([FieldViolation("tokens", (
                    f"at most {info.max_seq_len} tokens (the model's max_model_len), got {len(body.tokens)}"))])
            bad = [(i, t) for i, t in enumerate(body.tokens) if t >= info.vocab_size]
            if bad:
                raise InvalidArgument([FieldViolation(f"tokens[{i}]", (
                    f"token id {t} is outside the vocabulary [0, {info.vocab_size})")) for i, t in bad])
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return JSONResponse({"prompt": self.front.decode(body.tokens)})

    # --- open, and models ----------------------------------------------------------------------------------
    async def version(self) -> JSONResponse:
        return JSONResponse(self.version_body)

    async def model(self, request: Request, model_id: str) -> JSONResponse:
        try:
            authorize(self.auth, request, _LIST)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        card = next((c for c in model_cards(self.front) if c["id"] == model_id), None)
        if card is None:
            return JSONResponse(error_body(404, f"The model `{model_id[:MAX_NAME_CHARS]}` does not exist.",
                                           "not_found", "model"), status_code=404)
        return JSONResponse(card)

    # --- shared ----------------------------------------------------------------------------------------------
    async def _body(self, request: Request, method: str, kind):
        """The body of an authorized POST while serving, as `kind` (a pair: the chat form when it has
        'messages' and no 'prompt', as vLLM's union picks)."""
        authorize(self.auth, request, method)
        if (state := self.door.state()) is not ServingState.SERVING:
            raise Unavailable(f"server is {state.value}; retry later" if state is ServingState.WARMING_UP
                              else "server is draining (shutting down); retry on another replica")
        require_json(request.headers.get("content-type"))
        raw = await read_body(request, self.door.max_body_bytes)
        if isinstance(kind, tuple):
            prompt_form, chat_form = kind
            kind = chat_form if _is_chat(raw) else prompt_form
        body = kind.model_validate_json(raw)
        if bad := unsupported_fields(body):
            raise InvalidArgument(bad)
        return body

    def _check_model(self, model: str | None) -> None:
        """`model`, when set, names the base model or an adapter this server knows (vLLM's check; tokenizing is
        the same for every adapter of one base model)."""
        if not model or self.front.model_info().is_base_model(model):
            return
        if len(model) > MAX_NAME_CHARS:
            raise InvalidArgument([FieldViolation("model", f"at most {MAX_NAME_CHARS} characters, got {len(model)}")])
        try:
            known = self.front.has_adapter(model)
        except (AdapterNameError, AdapterPathError) as e:  # not a possible adapter directory entry
            raise InvalidArgument([FieldViolation("model", str(e))]) from None
        if not known:
            raise HttpError(404, grpc.StatusCode.NOT_FOUND, f"The model `{model}` does not exist.", "model")


def _is_chat(raw: bytes) -> bool:
    try:
        data = json.loads(raw)
    except ValueError:
        return False
    return isinstance(data, dict) and "messages" in data and "prompt" not in data


def _check_name_length(name: str) -> None:
    """Before a message quotes the name (as vLLM's do)."""
    if len(name) > MAX_NAME_CHARS:
        raise InvalidArgument([FieldViolation("lora_name", f"at most {MAX_NAME_CHARS} characters, got {len(name)}")])


def _bad_request(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, grpc.StatusCode.INVALID_ARGUMENT, message, param)


def _renamed(exc: InvalidArgument, names: dict[str, str]) -> InvalidArgument:
    return InvalidArgument([FieldViolation(names.get(v.field, v.field), v.description) for v in exc.violations])


def _vllm_fields(exc: Exception) -> Exception:
    """A refusal of AdapterManagement (or the engine) with the fields named as vLLM's request names them."""
    if isinstance(exc, AdapterNameError):
        return InvalidArgument([FieldViolation("lora_name", str(exc))])
    if isinstance(exc, AdapterPathError):
        return InvalidArgument([FieldViolation("lora_path", str(exc))])
    if isinstance(exc, InvalidArgument):
        return _renamed(exc, _LORA_FIELDS)
    return exc
