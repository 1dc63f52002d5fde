"""Hand-made protobuf wire bytes (what a buggy or hostile client can send), and raw calls that send them."""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

GENERATE = "/loraserve.v1.Generation/Generate"
TOKENIZE = "/loraserve.v1.Generation/Tokenize"


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


@dataclass
class RawResult:
    code: grpc.StatusCode
    message: str = ""
    responses: list[bytes] = field(default_factory=list)
    error: grpc.RpcError | None = None  # for service.client.from_rpc_error (rich details)


def raw_generate(channel: grpc.Channel, payload: bytes, timeout: float = 30.0) -> RawResult:
    """Send `payload` as the bytes of a GenerateRequest."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
    result = RawResult(grpc.StatusCode.OK)
    try:
        for msg in call(payload, timeout=timeout):
            result.responses.append(msg)
    except grpc.RpcError as e:
        result.code, result.message, result.error = e.code(), e.details() or "", e
    return result


def raw_tokenize(channel: grpc.Channel, payload: bytes, timeout: float = 30.0) -> RawResult:
    call = channel.unary_unary(TOKENIZE, request_serializer=None, response_deserializer=None)
    try:
        return RawResult(grpc.StatusCode.OK, responses=[call(payload, timeout=timeout)])
    except grpc.RpcError as e:
        return RawResult(e.code(), e.details() or "", error=e)
