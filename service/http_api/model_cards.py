"""The entries of /v1/models and /v1/models/{id} (vLLM's ModelCard): the base model, then every known adapter."""
from __future__ import annotations

import time
from typing import Any

from service.front import RequestFront


def model_cards(front: RequestFront) -> list[dict[str, Any]]:
    info, created = front.model_info(), int(time.time())
    # vLLM's max_model_len, and the KV pool every entry shares (adapters run on the base model's cache)
    limits = {"max_model_len": info.max_seq_len, "num_kv_blocks": info.num_kv_blocks,
              "block_size": info.block_size, "kv_cache_tokens": info.kv_cache_tokens}
    # One entry per name the base model is served under (--served-model-name), as vLLM lists them.
    bases = [{"id": name, "object": "model", "created": created, "owned_by": "lora-serve",
              "root": info.model, "parent": None, **limits} for name in info.served_model_names]
    adapters = [{"id": a.name, "object": "model", "created": created, "owned_by": "lora-serve",
                 "root": a.path, "parent": info.model, **limits}
                for a in front.list_adapters()]
    return [*bases, *adapters]
