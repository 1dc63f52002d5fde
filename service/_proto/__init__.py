"""Generated gRPC stubs for loraserve.v1 (do not edit the *_pb2* files; run scripts/gen_proto.sh)."""
from . import lora_serve_pb2 as pb
from . import lora_serve_pb2_grpc as pb_grpc

__all__ = ["pb", "pb_grpc"]
