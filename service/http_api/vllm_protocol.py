"""Request bodies of vLLM's own endpoints (vLLM 0.32's field names and defaults; pydantic, strict types): LoRA
adapter loading and unloading, /tokenize (a prompt, or a chat) and /detokenize. Unknown fields are ignored, as
vLLM does; vLLM fields lora-serve does not implement are accepted only at their neutral value
(`unsupported_fields`)."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from service.errors import FieldViolation
from service.http_api.protocol import ChatMessage

TokenId = Annotated[StrictInt, Field(ge=0, le=2**63 - 1)]  # (vLLM's bounds; the vocabulary is checked after)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class LoadLoRAAdapterRequest(_Body):
    lora_name: StrictStr
    lora_path: StrictStr
    load_inplace: StrictBool = False  # replace an adapter of the same name (else: 400, as vLLM)
    is_3d_lora_weight: StrictBool = False  # not implemented: false only


class UnloadLoRAAdapterRequest(_Body):
    lora_name: StrictStr
    lora_int_id: StrictInt | None = None  # vLLM's; unused there too (adapters are named)


class TokenizeCompletionRequest(_Body):
    model: StrictStr | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool | None = False


class TokenizeChatRequest(_Body):
    model: StrictStr | None = None
    messages: list[ChatMessage]
    add_generation_prompt: StrictBool = True
    add_special_tokens: StrictBool = False  # the template writes them
    return_token_strs: StrictBool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Not implemented: accepted at their neutral value only.
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Body):
    model: StrictStr | None = None
    tokens: list[TokenId]


def unsupported_fields(body: _Body) -> list[FieldViolation]:
    """vLLM fields lora-serve does not implement, set to anything but their neutral value."""
    bad = []
    if isinstance(body, LoadLoRAAdapterRequest) and body.is_3d_lora_weight:
        bad.append(FieldViolation("is_3d_lora_weight", "not supported (LoRA weights of 2-D linear layers only)"))
    if isinstance(body, TokenizeChatRequest):
        if body.continue_final_message:
            bad.append(FieldViolation("continue_final_message", "not supported"))
        if body.chat_template is not None:
            bad.append(FieldViolation("chat_template", "not supported: the model's own chat template is used"))
        for name in ("media_io_kwargs", "mm_processor_kwargs"):
            if getattr(body, name):
                bad.append(FieldViolation(name, "not supported (text-only models)"))
    return bad
