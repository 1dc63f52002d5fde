"""EngineRunner: the asyncio bridge between the servicers and the engine (continuous batching).

The engine's Scheduler (lora_compile/core/scheduler.py) owns the queue, the batch and every admission decision.
The runner submits, streams and aborts: each loop iteration makes ONE call into the engine thread that
  1. hands the scheduler the choices queued since the last step, and the sequences that ended outside a step
     (finished by a stop string, failed, cancelled),
  2. runs `scheduler.schedule()` and `engine.step()` on its SchedulerOutput,
and then, back on the event loop, turns each sequence's new tokens into a RequestOutput on its queue and each
refusal into its status. All engine calls run in the process's one engine thread (engine_thread.py), so they
never overlap and the event loop keeps streaming.

Telemetry observes, it does not steer: the runner stamps lifecycle events on each request (RequestState.events,
always; a few per request) and hands them, with each StepOutput, to an optional RunnerObserver.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import service.runner.engine_thread as engine_thread
from lora_compile import Engine, Sequence
from service.errors import EngineFailure, Unavailable
from service.limits import RequestLimits
from service.runner.capacity import Capacity, Reservation
from service.runner.statuses import load_error, step_error
from service.runner.engine_door import EngineDoor
from service.runner.output import OutputProcessor
from service.runner.parent_request import ParentRequest, fan_out
from service.runner.reports import IterationResult, RunnerObserver, SchedulerStats, scheduler_stats
from service.runner.request import GenerationRequest, RequestEventType
from service.runner.request_state import RequestState

log = logging.getLogger(__name__)
T = TypeVar("T")
# Burst admission (EngineRunner._gather_burst): concurrent requests arrive a fraction of a millisecond apart.
_BURST_GAP_S = 0.002
_BURST_MAX_S = 0.02


class EngineRunner(EngineDoor):
    def __init__(self, engine: Engine, limits: RequestLimits = RequestLimits(),
                 observer: RunnerObserver | None = None, served_model_names: tuple[str, ...] = ()):
        self.engine = engine
        self.limits = limits
        # --served-model-name: the names the base model answers to, the first reported (default: its directory's)
        self.served_model_names = tuple(served_model_names) or (engine.model_name,)
        self.observer = observer  # None: tracing off (the only check on the hot path)
        self.scheduler = engine.scheduler
        self._states: dict[int, RequestState] = {}  # seq_id: every choice handed to the scheduler, until it ends
        self._new: list[Sequence] = []             # queued since the last iteration: the scheduler's next
        self._to_finish: list[Sequence] = []       # ended outside a step: the scheduler releases them next
        self._seq_ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._idle: asyncio.Event | None = None
        self._open_streams = 0  # add_request .. abort: handlers still streaming, finished or not
        self._capacity = Capacity(engine.config.max_num_seqs, limits)  # batch + queue, streams (capacity.py)
        # One call's share (RequestLimits.max_request_share): choices running, and queued or running, at once.
        running_cap, self._in_flight_cap = limits.request_caps(engine.config.max_num_seqs)
        self.scheduler.max_running_per_group, self.scheduler.max_overtakes = running_cap, limits.max_overtakes
        self.scheduler.on_adapter_ready = self._on_load_done
        self._paced: list[ParentRequest] = []  # calls with choices in their backlog

    # --- lifecycle ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self._wakeup, self._idle = asyncio.Event(), asyncio.Event()
        self._event_loop = asyncio.get_running_loop()
        self._idle.set()
        self._task = asyncio.create_task(self._loop(), name="engine-runner")

    async def drain(self, timeout: float) -> bool:
        """Stop accepting; wait up to `timeout` for in-flight requests. True if all finished on their own;
        otherwise the rest are ended with finish_reason "cancelled"."""
        self._accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            for state in [*self._states.values(), *self._backlogged()]:
                state.finish_with(state.processor.cancel())
                state.aborted = True
                self._end(state)
            self._wake()
            await self._idle.wait()  # the loop releases them within one step
            return False

    async def shutdown(self) -> None:
        """Abort everything, release every slot, stop the loop (the engine thread stays for the process)."""
        self._accepting = False
        self._fail_all(Unavailable("server is shutting down"))
        if self._task is not None:
            self._wake()
            await self._idle.wait()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await engine_thread.run(self._release_all)

    async def run_in_engine_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` between steps (e.g. warm-up, unloading an adapter), never during one."""
        return await engine_thread.run(fn, *args)

    # --- requests -----------------------------------------------------------------------------------
    def reserve(self, choices: int = 1) -> Reservation:
        """The capacity check, once per call before any work on it: places for the choices of a call that are
        queued at once (at most its share), held until add_parent_request takes them or release gives them
        back. UNAVAILABLE while draining, else RESOURCE_EXHAUSTED rather than a queue without bound."""
        self._check_accepting()
        return self._capacity.reserve(min(choices, self._in_flight_cap), len(self._states), self._open_streams)

    def release(self, reservation: Reservation) -> None:
        """A refused call's places go back (a no-op once add_parent_request took them)."""
        self._capacity.release(reservation)

    def _check_accepting(self) -> None:
        if not self._accepting:
            raise Unavailable("server is draining (shutting down); retry on another replica")

    @property
    def max_request_sequences(self) -> int:
        """The most sequences (prompts x n) one call can ever be given: more is refused whatever the load."""
        return self._capacity.max_request_sequences

    def add_parent_request(self, requests: list[GenerationRequest],
                           reservation: Reservation | None = None) -> ParentRequest:
        """A call of one or several prompts, each with its n choices (parent_request.py): taken on the places
        `reservation` holds for it (None: checked now), or refused whole (RESOURCE_EXHAUSTED / UNAVAILABLE). At
        most its share of the places (RequestLimits.max_request_share) is queued now; the rest wait in its backlog
        and follow as its queued choices finish (_refill), so one call of many prompts leaves the queue and the
        batch to the others too."""
        choices = fan_out(requests, self.engine.kv_cache.block_size, self.engine.config.enable_prefix_caching)
        first = min(len(choices), self._in_flight_cap)
        # The places reserved (or checked now) pass to the choices queued below.
        self._capacity.release(reservation if reservation is not None else self.reserve(len(choices)))
        self._check_accepting()  # a drain that began while the call was prepared: nothing is queued after it
        states: list[RequestState] = []
        for choice in choices:
            state = self._new_state(choice.request, choice.index)
            if choice.waits_for is not None:
                state.seq.waits_for = states[choice.waits_for].seq
            states.append(state)
        parent = ParentRequest(requests[0].request_id, states, keep_finished_s=self.limits.stall_timeout_s,
                               requests=tuple(requests))
        for state in states:
            state.seq.group = parent  # the scheduler's share per call
        for state in states[:first]:
            self._queue(state)
        if len(states) > first:
            parent.backlog.extend(states[first:])
            self._paced.append(parent)
        return parent

    def add_request(self, request: GenerationRequest) -> RequestState:
        """One sequence (n = 1) read on its own (benchmarks, tests); the request front calls add_parent_request."""
        if request.n != 1:
            raise ValueError(f"add_request takes one choice, got n = {request.n}; use add_parent_request")
        return self.add_parent_request([request]).choices[0]

    def _new_state(self, request: GenerationRequest, index: int) -> RequestState:
        seq = Sequence(seq_id=next(self._seq_ids), prompt_ids=list(request.prompt_ids),
                       sampling=request.sampling, adapter=request.adapter)
        return RequestState(request, seq, OutputProcessor(self.engine.tokenizer, seq, request.stop), index=index)

    def _queue(self, state: RequestState) -> None:
        state.queued = True
        state.record_event(RequestEventType.QUEUED)
        name = state.request.adapter
        try:  # its adapter's read starts now, while it queues
            self.scheduler.start_load(state.seq)
        except Exception as exc:  # noqa: BLE001 - mapped to the request's status
            raise load_error(name, exc, self.engine.adapters.is_registered(name),
                             state.request.adapters_field) from exc
        if self.observer is not None:
            self.observer.on_added(state)
        self._open_streams += 1
        self._states[state.seq.seq_id] = state
        self._new.append(state.seq)
        self._idle.clear()
        self._wake()

    def abort(self, request: ParentRequest | RequestState) -> None:
        """The stream ended (or the client is gone): drop the request (every choice of a ParentRequest); its slots
        are freed within one step."""
        states = request.choices if isinstance(request, ParentRequest) else [request]
        for state in states:
            self._abort(state)
        parent = states[0].parent if states else None
        if parent is not None and not parent.closed and all(s.closed for s in parent.choices):
            parent.close()

    def _abort(self, state: RequestState) -> None:
        if not state.done:
            state.record_event(RequestEventType.ABORTED)
        if not state.closed:
            state.close()
            if state.queued:  # (one still in its call's backlog was never counted, nor reported)
                self._open_streams -= 1
                if self.observer is not None:
                    self.observer.on_finished(state)
        if not state.aborted:
            state.aborted = True
            state.done = True
            self._end(state)
            self._wake()

    def adapter_users(self, name: str) -> int:
        """In-flight (waiting or running) requests that use adapter `name`."""
        return sum(1 for s in self._states.values() if s.request.adapter == name and not s.done)

    @property
    def num_waiting(self) -> int:
        return sum(1 for s in self._states.values() if not s.running) + sum(len(p.backlog) for p in self._paced)

    def _backlogged(self) -> list[RequestState]:
        return [s for p in self._paced for s in p.backlog]

    def _refill(self) -> None:
        """Queue calls' backlogged choices as their queued ones finish, each call up to its share."""
        for parent in list(self._paced):
            in_flight = sum(1 for s in parent.choices if s.queued and not s.done)
            while parent.backlog and in_flight < self._in_flight_cap:
                state = parent.backlog.popleft()
                if not state.aborted:
                    self._queue(state)
                    in_flight += 1
            if not parent.backlog:
                self._paced.remove(parent)

    @property
    def num_running(self) -> int:
        return sum(1 for s in self._states.values() if s.running)

    @property
    def num_open_streams(self) -> int:
        return self._open_streams

    def stats(self) -> SchedulerStats:
        """A snapshot for metrics; cheap (no engine call), read on the event loop."""
        return scheduler_stats(self.engine, self._states.values(), self._backlogged())

    # --- the loop -----------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _loop(self) -> None:
        while True:
            self._refill()
            if not (self._states or self._to_finish):
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self.num_running and self._new:
                await self._gather_burst()
            self._wakeup.clear()
            new, self._new = self._new, []
            to_finish, self._to_finish = self._to_finish, []
            try:
                result = await engine_thread.run(self._engine_iteration, new, to_finish)
                self._apply(result)
            except Exception:  # noqa: BLE001 - a scheduler bug must not leave every stream hanging
                log.exception("scheduler iteration failed; failing all in-flight requests")
                self._fail_all(EngineFailure("scheduler failure; see the server log"))
                continue
            if not result.stepped and not to_finish and not result.admitted and not result.rejected \
                    and not self._new:
                # Nothing running and the head of the queue cannot be admitted (e.g. its adapter has no free
                # slot): sleep until a new request, an abort, a release or an adapter read wakes us.
                await self._wakeup.wait()

    def _on_load_done(self, _future) -> None:
        """An adapter read finished (a loader thread): wake the loop, whose waiting requests may now be admitted."""
        try:
            if self._event_loop is not None:
                self._event_loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop is closed (shutdown)
            pass

    async def _gather_burst(self) -> None:
        """Nothing running and a request waits: take in the rest of its burst before the step.

        Without this the first request of a burst starts a step alone, the others arrive while it runs, and their
        prefill waits for that step and then runs as a second one: two prefill steps before a burst's first tokens
        (measured: 8 concurrent streams from one client, admitted 1 then 7). The runner waits while requests keep
        arriving less than _BURST_GAP_S apart, at most _BURST_MAX_S in all (a prefill step takes tens of ms on
        CPU), and not once a batch is waiting. A lone request on an idle server pays _BURST_GAP_S."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _BURST_MAX_S
        while len(self._new) < self.engine.config.max_num_seqs:
            self._wakeup.clear()
            timeout = min(_BURST_GAP_S, deadline - loop.time())
            if timeout <= 0:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                return

    def _fail_all(self, error: Exception) -> None:
        for state in [*self._states.values(), *self._backlogged()]:
            state.finish_with(error)
            state.aborted = True
            self._end(state)

    def _end(self, state: RequestState) -> None:
        """The choice leaves the runner: the scheduler releases its sequence at the next step."""
        if self._states.pop(state.seq.seq_id, None) is not None:
            state.running = False
            self._to_finish.append(state.seq)

    def _engine_iteration(self, new: list[Sequence], to_finish: list[Sequence]) -> IterationResult:
        """Runs in the engine thread: the scheduler takes what changed, plans the step, the engine runs it."""
        for seq in new:
            self.scheduler.add(seq)
        for seq in to_finish:
            self.scheduler.finish(seq)
        plan = self.scheduler.schedule()
        states = self._states
        result = IterationResult(
            admitted=[st for seq in plan.admitted if (st := states.get(seq.seq_id)) is not None],
            rejected=[(st, exc) for seq, exc in plan.rejected if (st := states.get(seq.seq_id)) is not None],
            stepped=[st for seq in plan.scheduled if (st := states.get(seq.seq_id)) is not None],
            preempted=[st for seq in plan.preempted if (st := states.get(seq.seq_id)) is not None],
            adapter_events=self.engine.adapters.take_events())
        if plan.scheduled:
            try:
                result.step = self.engine.step(plan)
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                log.exception("engine step failed; failing its %d requests", len(plan.scheduled))
                result.step_error = exc
        return result

    def _apply(self, result: IterationResult) -> None:
        """Back on the event loop: stamp admissions, push outputs, end what finished or failed."""
        for state in result.admitted:
            seq = state.seq
            state.running = True
            start_ns, end_ns = seq.admission_ns
            fields = {"start_ns": start_ns, "adapter_loaded": seq.adapter_loaded}
            if seq.adapter_wait_ns is not None:
                fields["adapter_wait_start_ns"] = seq.adapter_wait_ns
            if seq.adapter_read is not None:
                fields["adapter_read"] = seq.adapter_read
            state.record_event(RequestEventType.ADMITTED, end_ns, **fields)
        for state in result.preempted:  # first in line again (the scheduler's); recomputed on readmission
            state.running = False
        for state, exc in result.rejected:
            if exc is not None:  # engine errors (e.g. AdapterNotFoundError) map to statuses in errors.py
                name = state.request.adapter
                state.finish_with(load_error(name, exc, self.engine.adapters.is_registered(name),
                                             state.request.adapters_field) if name else exc)
            self._end(state)
        if result.adapter_events and log.isEnabledFor(logging.DEBUG):
            for e in result.adapter_events:  # (benchmarks.many_adapters reads these lines)
                log.debug("adapter event %s %s start_ns=%d end_ns=%d bytes=%d", e.kind, e.name, e.start_ns,
                          e.end_ns, e.nbytes)
        if self.observer is not None:
            # Reported once the next step is under way (call_soon: after _loop has handed the next iteration to
            # the engine thread), with the events stamped below.
            asyncio.get_running_loop().call_soon(self.observer.on_iteration, result)
        if result.step_error is not None:
            error = EngineFailure(f"engine step failed: {type(result.step_error).__name__}: {result.step_error}")
            for state in result.stepped:
                state.finish_with(error)
                self._end(state)
            return
        end_ns = result.step.end_ns if result.step is not None else 0
        failed = result.step.failed_adapters if result.step is not None else {}
        for state in result.stepped:
            if len(state.seq.output_ids) == 1:  # at most one token per step: this step sampled the first
                state.record_event(RequestEventType.FIRST_TOKEN, end_ns)
            if state.aborted:
                continue  # the scheduler releases it at the next step
            # Non-finite logits: this request fails, and so does every one whose adapter was found bad.
            if state.seq.finish_reason == "error" or state.request.adapter in failed:
                state.finish_with(step_error(state, failed))
                self._end(state)
                continue
            try:
                out = state.processor.process()
            except Exception as exc:  # noqa: BLE001 - a detokenizer bug fails one request, not the loop
                log.exception("output processing failed for request %s", state.request.request_id)
                state.finish_with(EngineFailure(f"output processing failed: {exc}"))
                state.aborted = True
                self._end(state)
                continue
            if out is None:
                continue
            if out.finished:
                state.finish_with(out)
                self._end(state)
            elif not state.done:
                state.push(out)

    def _release_all(self) -> None:
        self.scheduler.release_all()
        self._to_finish, self._new = [], []
