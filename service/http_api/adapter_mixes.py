"""Weighted adapter mixes at the HTTP door: the `adapters` body field (adapters by name, with weights), and
llama.cpp's server form: a per-request `lora` (adapters by id, with scales) and GET /lora-adapters, which lists
the ids.

Both become GenerateParams.adapters, checked by the request front as the gRPC door's are (service/front/prepare.py:
member count, names, duplicates, weights, ranks, DoRA and activated members), with every refusal naming the field
the client sent. A mix computes Σ w_i·B_i·A_i·scaling_i (PEFT's add_weighted_adapter, combination_type "cat").

llama.cpp's semantics are kept where they mean something per request: the request's `lora` list alone decides
which adapters act (one it does not list is off; scale 0 is off), and a request without it gets no adapter, so
GET /lora-adapters shows every scale as 0. Its global scales (POST /lora-adapters) would change every tenant's
requests at once: refused."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from service.errors import FieldViolation, InvalidArgument, NotFound
from service.front import RequestFront
from service.front.generate_params import FieldNames
from service.http_api.errors import error_body, error_response
from service.http_api.protocol import _Common
from service.http_api.request_checks import authorize
from service.security import BearerAuth

if TYPE_CHECKING:
    from service.http_api.app import HttpDoor

_LIST = "/loraserve.v1.Adapters/ListAdapters"  # (who may list adapters may list their ids)


@dataclass(frozen=True)
class RequestedMix:
    """The adapters a body mixes, as GenerateParams.adapters takes them, and where each came from in the body."""

    members: tuple[tuple[str, float], ...] = ()
    field: str = "adapters"         # the body's field: "adapters" or "lora"
    entries: tuple[int, ...] = ()   # each member's index in that field's list

    def names(self, names: dict[str, str]) -> FieldNames:
        """The door's field names, with a mix's members named as the entries they came from."""
        return _MixNames(names | {"adapters": f"{self.field}[]"}, self.entries)

    def param_of(self, name: str) -> str:
        """The entry that names adapter `name` (a NOT_FOUND member's), else the whole field."""
        index = next((i for i, (member, _) in enumerate(self.members) if member == name), None)
        return self.field if index is None else f"{self.field}[{self.entries[index]}]"


@dataclass(frozen=True)
class _MixNames(FieldNames):
    """FieldNames whose mix member i is named as body entry entries[i]: `lora` entries at scale 0 are off, so
    they are left out of the members, and a refusal of a member must still point at the entry the client wrote."""

    entries: tuple[int, ...] = ()

    def __call__(self, param: str, index: int | None = None) -> str:
        if param == "adapters" and index is not None and index < len(self.entries):
            index = self.entries[index]
        return super().__call__(param, index)


def requested_mix(body: _Common, adapter: str, front: RequestFront) -> RequestedMix:
    """The mix `body` asks for (no members: none); `adapter` is what `model` names ("" : the base model).
    INVALID_ARGUMENT for both forms at once, for a mix beside an adapter named by `model`, and for a `lora` id
    no adapter has."""
    if body.adapters is not None and body.lora is not None:
        raise InvalidArgument([FieldViolation("lora", (
            "name the adapters of a mix either in `adapters` (by name) or in `lora` (by id, as llama.cpp's server "
            "takes them), not both"))])
    field = "adapters" if body.adapters is not None else "lora" if body.lora is not None else None
    if field is None:
        return RequestedMix()
    if adapter:  # (also for an empty list: the mix field alone decides the adapters, as `lora` does in llama.cpp)
        raise InvalidArgument([FieldViolation(field, (
            f"the model field names the adapter {adapter!r}: name the adapters either in {field} (with the served "
            "base model as the model) or as the model, not both"))])
    if body.adapters is not None:
        members = tuple((a.name, a.weight) for a in body.adapters)
        return RequestedMix(members, "adapters", tuple(range(len(members))))
    names: dict[int, str | None] = {}
    bad, members, entries = [], [], []
    for i, entry in enumerate(body.lora):
        if entry.id in names:  # (llama.cpp lets the last one win, whatever the scales: refused, not guessed)
            bad.append(FieldViolation(f"lora[{i}].id", f"id {entry.id} is listed twice; list each adapter once"))
            continue
        names[entry.id] = name = front.adapter_name(entry.id)
        if name is None:
            bad.append(FieldViolation(f"lora[{i}].id", f"no adapter has id {entry.id}; GET /lora-adapters lists "
                                                        "the adapters and their ids"))
        elif entry.scale != 0:  # (scale 0: off, as in llama.cpp; not a member, so not counted toward the limit)
            members.append((name, entry.scale))
            entries.append(i)
    if bad:
        raise InvalidArgument(bad)
    return RequestedMix(tuple(members), "lora", tuple(entries))


def not_found(exc: NotFound, mix: RequestedMix) -> str:
    """The param of a 404 for an adapter: the mix's entry that names it, else `model`."""
    return mix.param_of(exc.name) if mix.members else "model"


def register(app: FastAPI, door: HttpDoor) -> None:
    routes = _LlamaRoutes(door)
    app.add_api_route("/lora-adapters", routes.list_adapters, methods=["GET", "HEAD"])
    app.add_api_route("/lora-adapters", routes.set_scales, methods=["POST"])


class _LlamaRoutes:
    def __init__(self, door: HttpDoor):
        self.front = door.front
        self.auth = BearerAuth(door.security)

    async def list_adapters(self, request: Request) -> Response:
        """llama.cpp's list: every known adapter with its id, path and scale (0: a request without `lora` gets
        none), and its name. Paths as /v1/models shows them (its `root`); an adapter directory's adapters appear
        once first used by name (their id is given then)."""
        try:
            authorize(self.auth, request, _LIST)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        adapters = sorted(self.front.list_adapters(), key=lambda a: a.id)
        # (task_name, prompt_prefix: llama.cpp's GGUF adapter metadata, which PEFT adapters do not carry)
        return JSONResponse([{"id": a.id, "name": a.name, "path": a.path, "scale": 0.0, "task_name": "",
                              "prompt_prefix": ""} for a in adapters])

    async def set_scales(self) -> JSONResponse:
        """llama.cpp's global scales apply to every request that sends no `lora`: on a shared server, every
        tenant's. Refused; the same scales per request are `lora`."""
        message = ("POST /lora-adapters would set adapter scales for every client of this server at once, so it is "
                   "not supported: pass the scales per request instead, as the `lora` field of /v1/completions or "
                   "/v1/chat/completions ([{\"id\": 0, \"scale\": 0.5}], ids from GET /lora-adapters)")
        return JSONResponse(error_body(405, message, "method_not_allowed", "lora"), status_code=405,
                            headers={"Allow": "GET, HEAD"})
