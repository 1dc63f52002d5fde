"""Server reflection under both names clients ask for: grpc.reflection.v1 (grpcurl and newer tools try it first)
and v1alpha (older ones).

grpcio-reflection serves v1alpha only. v1 is the same protocol renamed: the same messages, fields, numbers and
method, in proto package grpc.reflection.v1. So one servicer answers both names (the bytes on the wire are the
same), and v1's file descriptor, made from v1alpha's by renaming its package, is added to the default pool, so
that a client can also describe the v1 service it is talking to.
"""
from __future__ import annotations

from collections.abc import Iterable

import grpc
import grpc.aio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA = reflection.SERVICE_NAME            # grpc.reflection.v1alpha.ServerReflection
V1 = "grpc.reflection.v1.ServerReflection"
_V1_PACKAGE = "grpc.reflection.v1"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Reflection on `server` under v1 and v1alpha, listing `service_names` and both reflection services."""
    _add_v1_descriptor()
    servicer = reflection.aio.ReflectionServicer((*service_names, V1, V1ALPHA))
    handlers = {"ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)}
    for name in (V1, V1ALPHA):  # (as grpc's generated add_*_to_server registers a service)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        server.add_registered_method_handlers(name, handlers)


def _add_v1_descriptor() -> None:
    pool = descriptor_pool.Default()
    try:
        pool.FindFileByName(_V1_FILE)
        return  # added by an earlier server in this process, or by a library that ships v1
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old = f".{proto.package}."
    proto.name, proto.package = _V1_FILE, _V1_PACKAGE
    proto.ClearField("options")  # (v1alpha's language options name v1alpha's packages)

    def renamed(type_name: str) -> str:
        return f".{_V1_PACKAGE}.{type_name[len(old):]}"

    messages = list(proto.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            if field.type_name.startswith(old):  # (set only where set: a scalar field has none)
                field.type_name = renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = renamed(method.input_type), renamed(method.output_type)
    pool.AddSerializedFile(proto.SerializeToString())
