"""The statuses of requests the engine refused or ended: an adapter that cannot be read, a step that ended a
request (its grammar, its adapter found bad, the engine's own failure). Which requests run is the engine's
Scheduler's (lora_compile/core/scheduler.py); what a refusal means to a client is the service's."""
from __future__ import annotations

from typing import TYPE_CHECKING

from lora_compile.errors import AdapterError, AdapterMixError, AdapterNotFoundError, AdapterOutputError, GrammarError
from lora_compile.lora.mixes import AdapterMix
from service.errors import EngineFailure, FailedPrecondition, FieldViolation, InvalidArgument

if TYPE_CHECKING:
    from service.runner.request_state import RequestState


def load_error(name: str, exc: BaseException, registered: bool, mix_field: str = "adapters") -> Exception:
    """The status of a request whose adapter cannot be read (bad or changed files); NOT_FOUND passes through; a mix
    its members cannot make (found when it was composed) is the request's INVALID_ARGUMENT, on `mix_field`."""
    if isinstance(exc, AdapterMixError):
        return InvalidArgument([FieldViolation(mix_field, str(exc))])
    if isinstance(exc, AdapterNotFoundError) or not isinstance(exc, AdapterError):
        return exc  # type: ignore[return-value]
    if isinstance(exc, AdapterOutputError):  # read fine, but refused since it overflowed at run time
        return FailedPrecondition(str(exc))
    if AdapterMix.parse(name) is not None:  # (the member's own message names it)
        return FailedPrecondition(f"the mix {name!r} cannot be made: {exc}")
    verb = "can no longer be loaded" if registered else "cannot be loaded"
    return FailedPrecondition(f"adapter {name!r} {verb}: {exc}")


def step_error(state: RequestState, failed: dict[str, AdapterOutputError]) -> Exception:
    """The status of a request its step ended: its own cause where the engine named one (its structured output's
    grammar: INVALID_ARGUMENT); FAILED_PRECONDITION when its adapter was found bad (non-finite values: every request
    using it ends so); else the engine's own failure (INTERNAL)."""
    if isinstance(state.seq.failure, GrammarError):
        return InvalidArgument([FieldViolation(state.request.structured_output_field, str(state.seq.failure))])
    exc = failed.get(state.request.adapter)
    return FailedPrecondition(str(exc)) if exc is not None else EngineFailure(state.seq.error)
