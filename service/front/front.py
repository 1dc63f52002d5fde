"""RequestFront: what both doors hold instead of the runner. Each door parses its own wire format into
GenerateParams and writes outputs back in it; everything between, and every other question a door asks of the
model, the tokenizer or the adapters, goes through here, so the gRPC and the HTTP walks visit the same files
after their own parsing, and no door imports the runner or the engine.

A call is checked for capacity once, before any work on it (RESOURCE_EXHAUSTED / UNAVAILABLE before a token is
counted); the places it was given are held while each prompt is prepared (prepare.py: tokenizing, every limit,
the grammar compile, the adapter check) and pass to its choices when the runner queues them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from service.front.adapter_management import AdapterManagement
from service.front.generate_params import GenerateParams
from service.front.prepare import Preparer
from service.limits import RequestLimits
from service.runner.detokenizer import TokenText
from service.runner.engine_runner import EngineRunner
from service.runner.parent_request import ParentRequest
from service.runner.request import ModelInfo

if TYPE_CHECKING:
    from lora_compile.lora.manager import AdapterInfo


class RequestFront:
    """One per server, built by service/server.py over its runner; both doors hold it."""

    def __init__(self, runner: EngineRunner, limits: RequestLimits = RequestLimits()):
        self._runner = runner
        self.limits = limits  # the runner's too: one object of operator limits
        self._preparer = Preparer(runner, runner.model_info(), limits)
        self._adapters = AdapterManagement(runner)

    # --- generation ---------------------------------------------------------------------------------------------
    async def submit(self, params: list[GenerateParams]) -> ParentRequest:
        """One call (a prompt, or a completions prompt list, each with its n choices): its places reserved (the one
        capacity check), then each prompt prepared in order (the first refusal is the call's), then the call
        handed to the runner on those places. Refused whole, with nothing queued."""
        reservation = self._runner.reserve(sum(self._choices(p) for p in params))
        try:
            requests = [await self._preparer.prepare(p) for p in params]
            return self._runner.add_parent_request(requests, reservation)
        finally:
            self._runner.release(reservation)  # refused or cancelled while prepared (a no-op once taken)

    def _choices(self, params: GenerateParams) -> int:
        """The choices a prompt asks for; an n that validation will refuse counts as one (its refusal is
        INVALID_ARGUMENT, whatever the load)."""
        n = 1 if params.n is None else params.n
        return n if 1 <= n <= self._preparer.model.max_num_seqs else 1

    def abort(self, parent: ParentRequest) -> None:
        """The call's handler is done (finished, cancelled, or its client gone): every choice is dropped within one
        step; a no-op once finished."""
        self._runner.abort(parent)

    # --- model and limits ---------------------------------------------------------------------------------------
    def model_info(self) -> ModelInfo:
        """The model's facts and the engine's limits, as the runner reads them now."""
        return self._runner.model_info()

    @property
    def max_request_sequences(self) -> int:
        """The most sequences (prompts x n) one call can ever be given: more is refused whatever the load."""
        return self._runner.max_request_sequences

    # --- tokenizer ----------------------------------------------------------------------------------------------
    async def tokenize(self, text: str, add_special_tokens: bool = True, field: str = "text") -> list[int]:
        """A text's ids (Tokenize, /tokenize), bounded as a prompt is; `field` names it in a refusal."""
        self._preparer.note_input(len(text))
        return await self._preparer.encode(text, add_special_tokens, field)

    def token_strings(self, ids: list[int]) -> list[str]:
        """The vocabulary's pieces ("Ġmate"), as a tokenizer lists them."""
        return self._runner.token_strings(ids)

    def token_texts(self, ids: list[int]) -> list[TokenText]:
        """Each token's own text and bytes (" mate"), as logprobs show them."""
        return self._runner.token_texts(ids)

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens written out (vLLM's /detokenize)."""
        return self._runner.decode(ids)

    # --- adapters -----------------------------------------------------------------------------------------------
    def list_adapters(self) -> list[AdapterInfo]:
        """Every known adapter: name, path, rank, tier..."""
        return self._runner.list_adapters()

    def adapter_name(self, adapter_id: int) -> str | None:
        """The known adapter numbered `adapter_id` (AdapterInfo.id, kept for the process's life), if any."""
        return self._runner.adapter_name(adapter_id)

    async def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """LoadAdapter, /v1/load_lora_adapter: the checks, roots and in-use refusal of adapter_management.py."""
        return await self._adapters.load(name, path)

    async def unload_adapter(self, name: str) -> None:
        await self._adapters.unload(name)

    def adapter_users(self, name: str) -> int:
        """In-flight (waiting or running) requests that use adapter `name`."""
        return self._runner.adapter_users(name)

    def has_adapter(self, name: str) -> bool:
        """Registered, or found in an adapter directory. Raises AdapterNameError / AdapterPathError
        (service.errors) for a name no adapter directory could hold, before any file is touched."""
        return self._runner.has_adapter(name)

    def is_adapter_known(self, name: str) -> bool:
        """Registered or read once; no file access."""
        return self._runner.is_adapter_known(name)
