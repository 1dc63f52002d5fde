"""Which waiting requests join the batch this iteration (runs in the engine thread, between steps).

Policy (docs/architecture.md, "Adapter-aware admission"): first come, first served across adapters, except that
a request never holds up the ones behind it for something they do not need:
- its adapter is still being read (loader thread): it keeps its place and is skipped;
- its adapter needs a device slot and every slot is pinned by running requests: it keeps its place, and requests
  behind it whose adapter is already in a slot (or the base model) may pass, at most `max_overtakes` of them;
  then admission holds until a slot is unpinned, so a hot adapter cannot starve a cold one;
- max_num_seqs sequences run, or too few KV blocks are free for its prompt: admission stops (first come, first
  served: a shorter prompt behind it does not pass it; blocks free up as running sequences finish);
- it is a sibling choice (n > 1) whose first choice has not computed their shared prompt yet: it keeps its place
  and is skipped, so it reads that prompt from the prefix cache (parent_request.py);
- its call (a prompt list, n) runs its share of the batch already (RequestLimits.max_request_share) while another
  call waits too: it keeps its place and is skipped, so one call of many prompts leaves the batch to the others
  (alone, it takes the free places: the share costs it nothing when nobody else waits).
The engine decides each of these (Engine.admit's AdmitOutcome); admission only orders the queue.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from lora_compile import Engine
from lora_compile.core.step_output import AdmitOutcome
from lora_compile.errors import (
    AdapterError,
    AdapterNotFoundError,
    AdapterNotReadyError,
    AdapterOutputError,
    GrammarError,
)
from service.errors import EngineFailure, FailedPrecondition, FieldViolation, InvalidArgument
from service.runner.request import RequestEventType

if TYPE_CHECKING:
    from service.runner.request_state import RequestState


def load_error(name: str, exc: BaseException, registered: bool) -> Exception:
    """The status of a request whose adapter cannot be read (bad or changed files); NOT_FOUND passes through."""
    if isinstance(exc, AdapterNotFoundError) or not isinstance(exc, AdapterError):
        return exc  # type: ignore[return-value]
    if isinstance(exc, AdapterOutputError):  # read fine, but refused since it overflowed at run time
        return FailedPrecondition(str(exc))
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


def start_load(engine: Engine, state: RequestState, on_done: Callable[[Future], None]) -> bool:
    """Have the request's adapter read into host memory if it is not there; True when a load is under way.
    Raises what a request for it must fail with (a cached failed load, an unknown or bad name)."""
    name = state.request.adapter
    if not name or engine.adapters.is_ready(name):
        return False
    try:
        future = engine.adapters.prefetch(name)
    except Exception as exc:  # noqa: BLE001 - mapped to the request's status
        raise load_error(name, exc, engine.adapters.is_registered(name)) from exc
    if future is None:
        return False
    if state.adapter_wait_ns is None:
        state.adapter_wait_ns = time.time_ns()
    state.adapter_load = future
    future.add_done_callback(on_done)
    return True


def prompt_computed(first: RequestState) -> bool:
    """Whether the choice a sibling waits for has its prompt's blocks in the prefix cache (it sampled a token:
    every prefill chunk ran) or never will (finished, failed, cancelled)."""
    return first.done or first.aborted or bool(first.seq.output_ids)


def admit(engine: Engine, candidates: list[RequestState], max_overtakes: int,
          on_load_done: Callable[[Future], None], running_cap: int | None = None,
          running: list[RequestState] = ()) -> tuple[list[RequestState], list[tuple[RequestState, Exception | None]]]:
    """`running_cap`: the most choices of one call (ParentRequest) that may run at once while another call's choices
    wait too (a call alone may take the places nobody else wants); `running` the batch now."""
    admitted: list[RequestState] = []
    rejected: list[tuple[RequestState, Exception | None]] = []
    blocked: RequestState | None = None  # the oldest request waiting for a device slot
    manager = engine.adapters
    per_call = Counter(id(s.parent) for s in running if s.parent is not None and not s.aborted)
    if len({id(s.parent) for s in candidates if not s.aborted}) < 2:
        running_cap = None  # one call waits alone: the batch's free places are its, not kept empty
    for state in candidates:
        if engine.num_running >= engine.config.max_num_seqs:
            break
        if state.aborted:
            rejected.append((state, None))  # dropped; nothing to report to anyone
            continue
        call = id(state.parent) if state.parent is not None else None
        if call is not None and running_cap is not None and per_call[call] >= running_cap:
            continue  # its call runs its share already: it keeps its place, the others go on
        if state.waits_for is not None:  # a sibling choice (n > 1): it keeps its place, the others go on
            if not prompt_computed(state.waits_for):
                continue
            state.waits_for = None
        name = state.request.adapter
        load = state.adapter_load
        if load is not None:
            if not load.done():
                continue  # its adapter is being read: it waits, the others go on
            state.adapter_load = None
            result = load.result()
            if result.error is not None:
                rejected.append((state, load_error(name, result.error, manager.is_registered(name))))
                continue
            state.adapter_read = (result.start_ns, result.end_ns)
        try:
            if start_load(engine, state, on_load_done):  # evicted from host memory since: read it again
                continue
        except Exception as exc:  # noqa: BLE001
            rejected.append((state, exc))
            continue
        resident = manager.is_resident(name)
        if blocked is not None and (not resident or blocked.overtaken >= max_overtakes):
            continue  # no slot for it either / the bound is reached: wait for the blocked request
        admit_ns = time.time_ns()
        try:
            outcome = engine.admit(state.seq, read_adapter=False)  # adapters are read on the loader, not here
        except AdapterNotReadyError:  # evicted from host memory since start_load: read again; it keeps its place
            try:
                if not start_load(engine, state, on_load_done):
                    on_load_done(None)  # back in host memory already: wake the runner for another try
            except Exception as exc:  # noqa: BLE001
                rejected.append((state, exc))
            continue
        except Exception as exc:  # noqa: BLE001 - e.g. the adapter was unloaded while it waited
            rejected.append((state, load_error(name, exc, manager.is_registered(name)) if name else exc))
            continue
        if outcome is AdmitOutcome.NO_ADAPTER_SLOT:
            blocked = blocked or state
            continue
        if outcome is not AdmitOutcome.ADMITTED:  # no sequence slot or KV blocks: nobody behind it passes
            break
        if blocked is not None:
            blocked.overtaken += 1
        fields = {"start_ns": admit_ns, "adapter_loaded": state.seq.adapter_loaded}
        if state.adapter_wait_ns is not None:
            fields["adapter_wait_start_ns"] = state.adapter_wait_ns
        if state.adapter_read is not None:
            fields["adapter_read"] = state.adapter_read
        state.record_event(RequestEventType.ADMITTED, **fields)
        admitted.append(state)
        if call is not None:
            per_call[call] += 1
    return admitted, rejected
