"""lora-serve: the gRPC service in front of lora_compile (server, scheduler, SDK, CLI)."""
