"""EngineRunner: the asyncio scheduler between the servicers and the engine (continuous batching).

A waiting queue (FIFO) and a running set. Each loop iteration makes ONE call into the engine thread that
  1. releases sequences that finished or were aborted since the last step,
  2. admits waiting requests (admission.py: first come first served, but a request whose adapter is still being
     read, or waits for a device slot, does not hold up the others; adapters are read on the loader threads),
  3. runs `engine.step(running)`,
and then, back on the event loop, turns each sequence's new tokens into a RequestOutput on its queue.
All engine calls run in the process's one engine thread (engine_thread.py), so they never overlap and the
event loop keeps streaming.

Telemetry observes, it does not steer: the runner stamps lifecycle events on each request (RequestState.events,
always; a few per request) and hands them, with each StepOutput, to an optional RunnerObserver.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

import service.runner.engine_thread as engine_thread
from lora_compile import Engine, Sequence
from lora_compile.errors import AdapterError
from service.errors import EngineFailure, QueueFull, TooManyStreams, Unavailable
from service.limits import RequestLimits
from service.runner.admission import admit, load_error, start_load, step_error
from service.runner.engine_door import EngineDoor
from service.runner.output import OutputProcessor
from service.runner.parent_request import ParentRequest, fan_out
from service.runner.reports import IterationResult, RunnerObserver, SchedulerStats
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
        self._waiting: deque[RequestState] = deque()
        self._running: list[RequestState] = []
        self._to_release: list[Sequence] = []   # engine.release at the start of the next iteration
        self._seq_ids = itertools.count()
        self._wakeup: asyncio.Event | None = None
        self._event_loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._accepting = True
        self._idle: asyncio.Event | None = None
        self._open_streams = 0  # add_request .. abort: handlers still streaming, finished or not
        self.max_streams = limits.max_concurrent_streams or engine.config.max_num_seqs + limits.max_queue
        # One call's share (RequestLimits.max_request_share): choices running, and queued or running, at once.
        self._running_cap, self._in_flight_cap = limits.request_caps(engine.config.max_num_seqs)
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
            for state in [*self._waiting, *self._running, *self._backlogged()]:
                state.finish_with(state.processor.cancel())
                state.aborted = True
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
    def check_capacity(self, sequences: int = 1) -> None:
        """Cheap, before any work on a new request of `sequences` choices (each counts as a request against
        the queue and as a stream): refuse now rather than queue without bound."""
        if not self._accepting:
            raise Unavailable("server is draining (shutting down); retry on another replica")
        # Count against batch + queue, not the queue alone: a burst on an idle server is admitted at once.
        in_flight = len(self._waiting) + len(self._running)
        capacity = self.engine.config.max_num_seqs + self.limits.max_queue
        if in_flight + sequences > capacity:
            raise QueueFull(max(0, in_flight - self.engine.config.max_num_seqs), self.limits.retry_after_s, sequences,
                            max(0, capacity - in_flight))
        if self._open_streams + sequences > self.max_streams:  # includes finished streams flushing to slow readers
            raise TooManyStreams(self.max_streams, self.limits.retry_after_s)

    @property
    def max_request_sequences(self) -> int:
        """The most sequences (prompts x n) one call can ever be given: more is refused whatever the load."""
        return min(self.engine.config.max_num_seqs + self.limits.max_queue, self.max_streams)

    def add_parent_request(self, requests: list[GenerationRequest]) -> ParentRequest:
        """A call of one or several prompts, each with its n choices (parent_request.py): taken, or refused whole
        (RESOURCE_EXHAUSTED / UNAVAILABLE). At most its share of the places (RequestLimits.max_request_share) is
        queued now; the rest wait in its backlog and follow as its queued choices finish (_refill), so one call
        of many prompts leaves the queue and the batch to the others too."""
        choices = fan_out(requests, self.engine.kv_cache.block_size, self.engine.config.enable_prefix_caching)
        first = min(len(choices), self._in_flight_cap)
        self.check_capacity(first)
        states: list[RequestState] = []
        for choice in choices:
            state = self._new_state(choice.request, choice.index)
            if choice.waits_for is not None:
                state.waits_for = states[choice.waits_for]
            states.append(state)
        parent = ParentRequest(requests[0].request_id, states, keep_finished_s=self.limits.stall_timeout_s)
        for state in states[:first]:
            self._queue(state)
        if len(states) > first:
            parent.backlog.extend(states[first:])
            self._paced.append(parent)
        return parent

    def add_request(self, request: GenerationRequest) -> RequestState:
        """One sequence (n = 1) read on its own (benchmarks, tests); the doors call add_parent_request."""
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
        start_load(self.engine, state, self._on_load_done)  # its adapter's read starts now, while it queues
        if self.observer is not None:
            self.observer.on_added(state)
        self._open_streams += 1
        self._waiting.append(state)
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
            self._wake()

    def adapter_users(self, name: str) -> int:
        """In-flight (waiting or running) requests that use adapter `name`."""
        return sum(1 for s in (*self._waiting, *self._running) if s.request.adapter == name and not s.done)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + sum(len(p.backlog) for p in self._paced)

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
        return len(self._running)

    @property
    def num_open_streams(self) -> int:
        return self._open_streams

    @property
    def model_dir(self) -> str:
        """The directory of the model's tokenizer_config.json (the chat template): the model's own, --tokenizer's,
        or what a GGUF file's metadata was derived into."""
        return str(self.engine.tokenizer_dir)

    def stats(self) -> SchedulerStats:
        """A snapshot for metrics; cheap (no engine call: the KV counters are plain attributes), read on the
        event loop."""
        cfg, adapters, kv = self.engine.config, self.engine.adapters, self.engine.kv_cache
        running = [s for s in self._running if not s.done]
        waiting = [s for s in (*self._waiting, *self._backlogged()) if not s.aborted]
        device, host = adapters.residency()
        return SchedulerStats(
            num_running=len(running), num_waiting=len(waiting), kv_cache_usage=kv.usage,
            num_kv_blocks=kv.num_blocks, block_size=kv.block_size, prefix_caching=cfg.enable_prefix_caching,
            cache_dtype=cfg.kv_cache_dtype, prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.engine.num_preemptions, max_loras=cfg.max_loras_per_batch,
            running_adapters=tuple(sorted({s.request.adapter for s in running if s.request.adapter})),
            waiting_adapters=tuple(sorted({s.request.adapter for s in waiting if s.request.adapter})),
            device_adapters=device, host_adapters=host, adapter_tiers=adapters.tier_counts())

    # --- the loop -----------------------------------------------------------------------------------
    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    async def _loop(self) -> None:
        while True:
            self._sweep_aborted()
            self._refill()
            if not (self._waiting or self._running or self._to_release):
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self._running and self._waiting:
                await self._gather_burst()
            self._wakeup.clear()
            to_release, self._to_release = self._to_release, []
            candidates = list(self._waiting)
            try:
                result = await engine_thread.run(
                    self._engine_iteration, to_release, candidates, list(self._running))
                self._apply(result)
            except Exception:  # noqa: BLE001 - a scheduler bug must not leave every stream hanging
                log.exception("scheduler iteration failed; failing all in-flight requests")
                self._fail_all(EngineFailure("scheduler failure; see the server log"))
                continue
            if not result.stepped and not to_release and not result.admitted and not result.rejected:
                # Nothing running and the head of the queue cannot be admitted (e.g. its adapter has no free
                # slot): sleep until a new request, an abort or a release wakes us.
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
        while len(self._waiting) < self.engine.config.max_num_seqs:
            self._wakeup.clear()
            timeout = min(_BURST_GAP_S, deadline - loop.time())
            if timeout <= 0:
                return
            try:
                await asyncio.wait_for(self._wakeup.wait(), timeout)
            except asyncio.TimeoutError:
                return

    def _fail_all(self, error: Exception) -> None:
        for state in [*self._waiting, *self._running, *self._backlogged()]:
            state.finish_with(error)
            state.aborted = True

    def _sweep_aborted(self) -> None:
        if any(s.aborted for s in self._waiting):
            # (a waiting request holds no slots, unless an iteration failed between admitting and moving it)
            self._to_release += [s.seq for s in self._waiting if s.aborted and s.seq.is_admitted]
            self._waiting = deque(s for s in self._waiting if not s.aborted)
        for state in [s for s in self._running if s.aborted]:
            self._running.remove(state)
            self._to_release.append(state.seq)

    def _engine_iteration(self, to_release: list[Sequence], candidates: list[RequestState],
                          running: list[RequestState]) -> IterationResult:
        """Runs in the engine thread."""
        for seq in to_release:
            self._release(seq)
        admitted, rejected = admit(self.engine, candidates, self.limits.max_overtakes, self._on_load_done,
                                   self._running_cap, running)
        result = IterationResult(admitted=admitted, rejected=rejected, stepped=[],
                                 adapter_events=self.engine.adapters.take_events())
        result.stepped = [s for s in running if not s.aborted] + result.admitted
        if result.stepped:
            try:
                result.step = self.engine.step([s.seq for s in result.stepped])
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving
                log.exception("engine step failed; failing its %d requests", len(result.stepped))
                result.step_error = exc
        return result

    def _apply(self, result: IterationResult) -> None:
        """Back on the event loop: move admitted requests, push outputs, schedule releases."""
        handled = {id(s) for s in result.admitted} | {id(s) for s, _ in result.rejected}
        self._waiting = deque(s for s in self._waiting if id(s) not in handled)
        for state, exc in result.rejected:
            if isinstance(exc, AdapterError):  # its files changed since registration (re-read after eviction)
                exc = load_error(state.request.adapter, exc, True)
            if exc is not None:  # engine errors (e.g. AdapterNotFoundError) map to statuses in errors.py
                state.finish_with(exc)
        self._running.extend(result.admitted)
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
                self._running.remove(state)
                self._to_release.append(state.seq)
            return
        end_ns = result.step.end_ns if result.step is not None else 0
        failed = result.step.failed_adapters if result.step is not None else {}
        preempted = set(result.step.preempted) if result.step is not None else set()
        if preempted:  # their blocks were taken back: first in line again, oldest first; recomputed on readmission
            back = [s for s in result.stepped if s.seq.seq_id in preempted]
            self._running = [s for s in self._running if s.seq.seq_id not in preempted]
            self._waiting.extendleft(reversed(back))
        for state in result.stepped:
            if state.seq.seq_id in preempted:
                continue
            if len(state.seq.output_ids) == 1:  # at most one token per step: this step sampled the first
                state.record_event(RequestEventType.FIRST_TOKEN, end_ns)
            if state.aborted:
                continue  # swept (and released) next iteration
            # Non-finite logits: this request fails, and so does every one whose adapter was found bad.
            if state.seq.finish_reason == "error" or state.request.adapter in failed:
                state.finish_with(step_error(state, failed))
                self._running.remove(state)
                self._to_release.append(state.seq)
                continue
            try:
                out = state.processor.process()
            except Exception as exc:  # noqa: BLE001 - a detokenizer bug fails one request, not the loop
                log.exception("output processing failed for request %s", state.request.request_id)
                state.finish_with(EngineFailure(f"output processing failed: {exc}"))
                state.aborted = True
                continue
            if out is None:
                continue
            if out.finished:
                state.finish_with(out)
                self._running.remove(state)
                self._to_release.append(state.seq)
            elif not state.done:
                state.push(out)

    def _release(self, seq: Sequence) -> None:
        try:
            self.engine.release(seq)
        except Exception:  # noqa: BLE001 - a failed release must not stop the loop
            log.exception("engine.release failed for sequence %d", seq.seq_id)

    def _release_all(self) -> None:
        for seq in self._to_release:
            self._release(seq)
        for state in [*self._waiting, *self._running]:
            self._release(state.seq)
        self._to_release, self._running, self._waiting = [], [], deque()

