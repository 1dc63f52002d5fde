"""The engine: a model, its KV cache and LoRA slots, and `step()` over a batch of running sequences."""
from __future__ import annotations

import logging
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence as SequenceLike

import torch

from .. import compile_policy, huge_pages
from ..config import EngineConfig, resolve_device, resolve_dtype, resolve_kv_cache_dtype
from ..errors import AdapterOutputError
from ..host_memory import release_free_heap
from ..kv_cache import KVCacheManager, kv_cache_size
from ..kv_cache.sizing import format_bytes
from ..lora.host_cache import host_cache_bytes
from ..lora.manager import LoRAManager
from ..lora.merge import build_merger
from ..model.forward_batch import ForwardBatch
from ..model.layers import rope_tables
from ..model.loader.source import ModelSource
from ..sample.grammar_steps import GrammarSteps
from ..sample.prompt_logprobs import PromptLogprobs
from ..sample.sampling import NON_FINITE, SamplingParams, sample
from ..sample.structured_output import GrammarCompiler, GrammarError
from ..sequence import Sequence
from ..tokenizer import Tokenizer
from . import compiled_stack
from .batch_init import BatchInit, Planned, StepInputs
from .cuda_graphs import DecodeGraphs, GraphShape
from .model_loading import load_model
from .scheduler import Scheduler, SchedulerOutput
from .step_ahead import StepAhead
from .step_output import AdmitOutcome, StepOutput, adapter_output_error, non_finite_message


log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig):
        self.config = config
        # Where torch ran first. A process should keep all its torch work on one thread: every thread that runs
        # a parallel op gets an OpenMP team of its own, and more teams than cores slow each step (service.runner.engine_thread).
        self.thread_id = threading.get_ident()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        source = ModelSource.resolve(config.model, config.tokenizer)
        self.model_config = mc = source.config
        if config.max_seq_len > mc.max_position_embeddings:  # positions past it were never trained: refuse, not drift
            raise ValueError(
                f"max_seq_len {config.max_seq_len} exceeds the model's max_position_embeddings "
                f"{mc.max_position_embeddings}; set --max-seq-len (EngineConfig.max_seq_len) to at most "
                f"{mc.max_position_embeddings}"
            )
        self.tokenizer = Tokenizer(source.tokenizer_dir, mc.eos_token_ids)
        self.tokenizer_dir = source.tokenizer_dir  # tokenizer_config.json: the chat template
        self.model_name = source.name
        # With compile: the Inductor cache directory, which configure sets for the process (TORCHINDUCTOR_CACHE_DIR).
        self.inductor_cache_dir = compile_policy.configure(config.inductor_cache_dir) if config.compile else None
        self.lora_kernel = compile_policy.lora_kernel(config.lora_kernel, self.device, self.dtype, config.max_lora_rank,
                                                      config.compile)
        self.attention_backend = compile_policy.attention_backend(config.attention_backend, self.device,
                                                                  mc.attn_logit_softcapping)
        self.prefill_backend = compile_policy.prefill_attention_backend(config.attention_backend,
                                                                        mc.attn_logit_softcapping)
        loaded = load_model(config, source, self.device, self.dtype, self.lora_kernel, self.attention_backend,
                            self.prefill_backend)
        self.model, self.quantized = loaded.model, loaded.quantized
        # Sized after the weights and adapter slots are allocated: on CUDA the default budget is what they leave.
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        size = kv_cache_size(config, mc, kv_dtype, self.device)
        for layer in self.model.layers:
            layer.self_attn.allocate_kv_cache(size.num_blocks + 1, size.block_size, kv_dtype, self.device)
        self.kv_cache = KVCacheManager(size, config.enable_prefix_caching)
        log.info("KV cache: %s, prefix caching %s, %s growth", size.describe(kv_dtype),
                 "on" if config.enable_prefix_caching else "off", config.kv_growth)
        held = self.model.memory_bytes()
        log.info("memory: weights %s%s, adapter slots %s, KV cache %s", format_bytes(held["weights"]),
                 f" (+ {format_bytes(held['packed'])} oneDNN-packed copies)" if held["packed"] else "",
                 format_bytes(held["adapters"]), format_bytes(size.nbytes))
        if self.device.type == "cpu":
            log.info(huge_pages.status())
        self.rope_cos, self.rope_sin = rope_tables(mc, config.max_seq_len, self.dtype, self.device)
        self.adapters = LoRAManager(
            self.model, mc, config.max_loras_per_batch, config.max_lora_rank,
            host_cache_bytes(config.max_cpu_lora_bytes), tuple(config.adapter_roots), tuple(config.adapter_dirs),
            config.adapter_loader_threads, self.device, dora=not self.quantized,
        )
        self.scheduler = Scheduler(config, self.kv_cache, self.adapters,
                                   lambda seq: self.check_request(seq.prompt_ids, seq.sampling), self._on_admitted)
        # Merging is float32 only: a bf16 merge would round W + BA once more than the per-token LoRA path does.
        # (a quantized base has no float weight to merge into: its adapters run unmerged)
        self._merger = build_merger(self.model, config.merge_lone_adapter,
                                    self.weights_packed and self.dtype == torch.float32 and not self.quantized,
                                    self.adapters.slot_generation, config.merge_after_steps)
        overlap = config.overlap_batch_init if config.overlap_batch_init is not None else self.device.type == "cuda"
        overlap = overlap and self._merger is None  # (merging decides per step, on the CPU: no build ahead there)
        self.batch_init = BatchInit(config, self.device, mc.vocab_size, overlap=overlap)
        self.ahead = (StepAhead(self.batch_init, self.kv_cache, lambda single: self._graph_shape(single, []),
                                config.max_seq_len) if overlap else None)
        self._rng = random.Random(config.seed)
        self._compiled = config.compile
        self._warmed_up = False
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._grammar_steps = GrammarSteps(config.grammar_limits(), mc.vocab_size, self.device.type == "cuda")
        if self._compiled:
            compiled_stack.compile_model(self.model, self.inductor_cache_dir, config.precompile)
        # Decode steps replay CUDA graphs where the step is compiled (eager LoRA reads slots on the host).
        self._graphs = (DecodeGraphs(config.max_num_seqs, config.max_seq_len, self.device)
                        if config.cuda_graphs and self._compiled and self.device.type == "cuda" else None)

    @property
    def weights_packed(self) -> bool:
        """True when the GEMMs run on oneDNN-packed weights (CPU float32 or native bf16, prepack_weights)."""
        return self.model.lm_head_packed is not None or any(
            getattr(m, "weight_packed", None) is not None for m in self.model.modules())

    # --- capacity -----------------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Sequences admitted and holding KV blocks."""
        return self.scheduler.num_running

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler, made on first use (it reads the whole vocabulary once, holding the GIL:
        a server makes it at warm-up)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                 self.config.grammar_limits())
            return self._grammars

    def check_request(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError naming the problem if the engine could never serve this request."""
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        bad_bias = [t for t, _ in sampling.logit_bias if not 0 <= t < vocab]
        if bad_bias:  # vLLM's message
            raise ValueError(f"token_id(s) {bad_bias} in logit_bias contain out-of-vocab token ids. Vocabulary size: "
                             f"{vocab}")
        if sampling.structured_output is not None:  # compiled once per spec; the service compiles it beforehand
            self.grammars.compile(sampling.structured_output)
        total = len(prompt_ids) + sampling.max_new_tokens
        if total > self.config.max_seq_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) exceeds "
                f"max_seq_len {self.config.max_seq_len}"
            )

    def _on_admitted(self, seq: Sequence) -> None:
        """What a step needs of a newly admitted sequence: its random stream and its grammar's matcher, both kept
        across preemption (the same draws, the same grammar state)."""
        if not seq.sampling.greedy and seq.generator is None:
            seed = seq.sampling.seed if seq.sampling.seed is not None else self._rng.getrandbits(63)
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        if seq.sampling.structured_output is not None and seq.grammar is None:
            seq.grammar = self.grammars.matcher(seq.sampling.structured_output)

    # Admission and release outside the service's queue (offline loops, tests): the scheduler's own.
    def admit(self, seq: Sequence, read_adapter: bool = True) -> AdmitOutcome:
        return self.scheduler.admit(seq, read_adapter)

    def try_admit(self, seq: Sequence, read_adapter: bool = True) -> bool:
        """admit() as a bool: False (nothing changed) when a sequence slot, KV blocks or an adapter slot is short."""
        return self.scheduler.admit(seq, read_adapter) is AdmitOutcome.ADMITTED

    def release(self, seq: Sequence) -> None:
        """Free the sequence's KV blocks (cached ones stay findable) and unpin its adapter; idempotent."""
        self.scheduler.release(seq)

    # --- one step -----------------------------------------------------------------------------------
    def _forward_batch(self, inputs: StepInputs) -> ForwardBatch:
        pos = inputs.positions  # rotary tables gathered by position, on the device
        lora, grouped_from = inputs.lora, self.model.lora_grouped_from
        if grouped_from and lora.weight_indices is not None and lora.weight_indices.shape[0] >= grouped_from:
            lora = lora.derive("grouped", self.config.max_loras_per_batch + 1)  # (a long prefill: graph variant 2)
        return ForwardBatch(cos=self.rope_cos[pos], sin=self.rope_sin[pos], attn=inputs.attn, lora=lora)

    def _hidden_states(self, inputs: StepInputs) -> torch.Tensor:
        """The forward up to the last hidden states, on device tensors only: what a CUDA graph records."""
        return self.model.hidden_states(inputs.input_ids, self._forward_batch(inputs))

    def _graph_shape(self, single: list[Planned], chunks: list[Planned]) -> GraphShape | None:
        """The CUDA graph shape of this step, or None where it runs without one (prefill, mixed, before warm-up)."""
        if self._graphs is None or chunks or not self._warmed_up:
            return None
        return self._graphs.shape(len(single), max(p.start for p in single) + 1)

    @torch.inference_mode()
    def step(self, batch: SchedulerOutput | SequenceLike[Sequence], return_logits: bool = False) -> StepOutput:
        """Run one forward over the batch and give each sequence that completed its tokens one new token: a
        SchedulerOutput (its blocks taken by Scheduler.schedule), or admitted sequences, which the scheduler
        grows first (offline loops, tests)."""
        start_ns, t0 = time.time_ns(), time.perf_counter()
        if isinstance(batch, SchedulerOutput):
            seqs, preempted = batch.scheduled, []
        else:
            seqs, preempted = self.scheduler.grow(batch)
        ahead = self.ahead.take(seqs, self.scheduler.epoch) if self.ahead is not None else None
        if ahead is not None:  # built while the last step ran (step_ahead): its blocks are taken, its ids written
            single, chunks, merged, merge_s, graph = ahead.planned, [], ahead.merged, 0.0, ahead.graph
            inputs = ahead.inputs
        else:
            if not seqs:  # (only when one sequence alone cannot grow: it waits to be admitted again)
                return StepOutput([], [], preempted=[q.seq_id for q in preempted], start_ns=start_ns)
            single, chunks = self.batch_init.plan(seqs)
            merged, merge_s = self._select_weights(single, chunks)
            graph = self._graph_shape(single, chunks)
            inputs = self.batch_init.build(single, chunks, merged, graph)
        sampled = inputs.sampled
        t1 = time.perf_counter()
        with compile_policy.steady_state(self._compiled and self._warmed_up):
            if graph is None:
                h = self._hidden_states(inputs)
            else:
                h = self._graphs.run(inputs.lora.weight_indices is not None, graph, inputs.addresses(),
                                     lambda: self._hidden_states(inputs))
            logits = self.model.logits(h, inputs.logits_idx)
        ahead_s = 0.0
        if self.ahead is not None and single and not chunks and self._warmed_up:  # the device runs this step
            t_ahead = time.perf_counter()
            self.ahead.prepare(single, merged, self.scheduler.epoch)
            ahead_s = time.perf_counter() - t_ahead
        bitmask, grammar_failed = self._grammar_steps.masks(sampled)
        t2 = time.perf_counter()
        n = len(sampled)  # logits rows: the sampled ones, then those of prompt log-probabilities
        prompt = PromptLogprobs(logits[n:], inputs.prompt_targets, inputs.prompt_rows) if inputs.prompt_rows else None
        raw = logits[:n].clone() if return_logits else None  # (the sampler changes its rows in place)
        next_ids = self.ahead.next_input_ids() if self.ahead is not None else None
        result = sample(logits[:n], sampled, next_ids, bitmask) if sampled else None
        if prompt is not None:
            prompt.record()
        for p in (*single, *chunks):
            p.seq.num_computed_tokens += p.length
            if self.scheduler.holds(p.seq):  # (warm-up's throwaway sequences write only the null block)
                self.kv_cache.cache_full_blocks(p.seq)
        token_ids = result.token_ids if result else []
        failed: dict[str, AdapterOutputError] = {}
        constrained: list[tuple[int, Sequence, int]] = []
        for i, (seq, token) in enumerate(zip(sampled, token_ids)):
            if i in grammar_failed:  # its mask failed or was late: it ends, its token is not used
                self._end_with(seq, grammar_failed[i])
                continue
            if token == NON_FINITE:  # this sequence alone ends; the rest of the batch is unaffected
                seq.finish_reason = "error"
                if seq.adapter:  # and its adapter is refused from now on
                    if seq.adapter not in failed:
                        failed[seq.adapter] = adapter_output_error(seq, self.adapters.is_registered(seq.adapter))
                        self.adapters.mark_failed(seq.adapter, failed[seq.adapter])
                    seq.error = str(failed[seq.adapter])
                else:
                    seq.error = non_finite_message(seq)
                continue
            seq.output_ids.append(token)
            if result.logprobs is not None and (seq.sampling.logprobs or seq.sampling.top_logprobs):
                seq.output_logprobs.append(result.logprobs[i])
                if result.top_logprobs is not None:
                    seq.output_top_logprobs.append(result.top_logprobs[i])
            seq.finish_reason = self._finish_reason(seq, token)
            if seq.grammar is not None:
                constrained.append((i, seq, token))
        outcomes = self._grammar_steps.consume([(seq, token) for _, seq, token in constrained])
        for n, (_, seq, _) in enumerate(constrained):
            outcome = outcomes.get(n)
            if isinstance(outcome, GrammarError):
                self._end_with(seq, outcome)
            elif outcome == "stop" and seq.finish_reason is None:  # complete: nothing may follow ("eos" stays)
                seq.finish_reason = "grammar"
        if self.ahead is not None and self.ahead.pending is not None and any(s.finish_reason for s in sampled):
            self.ahead.drop()  # built for sequences that continue
        t3 = time.perf_counter()
        kind = "mixed" if chunks and single else ("prefill" if chunks else "decode")
        ok = [i for i, t in enumerate(token_ids) if t != NON_FINITE and i not in grammar_failed]
        return StepOutput(
            seq_ids=[sampled[i].seq_id for i in ok], token_ids=[token_ids[i] for i in ok],
            logits=raw,
            num_tokens=len(single) + sum(p.length for p in chunks), num_adapters=inputs.num_adapters, kind=kind,
            failed_adapters=failed, preempted=[q.seq_id for q in preempted],
            merged=merged, cuda_graph=graph is not None,
            start_ns=start_ns, batch_init_s=t1 - t0 - merge_s, merge_s=merge_s, forward_s=t2 - t1 - ahead_s,
            sample_s=t3 - t2, batch_init_ahead_s=ahead_s,
        )

    def _end_with(self, seq: Sequence, error: GrammarError) -> None:
        """The sequence ends with its structured output's error; the spec's compiled matcher goes (it failed: the
        next request for it compiles again, and is refused there if it fails again)."""
        seq.finish_reason, seq.error, seq.failure = "error", str(error), error
        if self._grammars is not None and seq.sampling.structured_output is not None:
            self._grammars.forget(seq.sampling.structured_output)

    def _select_weights(self, single: list[Planned], chunks: list[Planned]) -> tuple[bool, float]:
        """Whether the step runs on its lone adapter merged into the weights, and the seconds merging took."""
        if self._merger is None:
            return False, 0.0
        slots = {slot for p in (*single, *chunks) for slot in (p.seq.slot_at(p.start),
                                                               p.seq.slot_at(p.start + p.length - 1))}
        lone = next(iter(slots)) if len(slots) == 1 and 0 not in slots else None
        rows = len(single) + sum(p.length for p in chunks) + 1  # + the dummy token
        return self._merger.select(lone, rows)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if token in sp.stop_token_ids:
            return "stop"
        if not sp.ignore_eos and token in self.tokenizer.eos_token_ids:
            return "eos"
        if len(seq.output_ids) >= sp.max_new_tokens or seq.num_tokens >= self.config.max_seq_len:
            return "length"
        return None

    # --- warm-up ------------------------------------------------------------------------------------
    def warmup(self) -> float:
        """Compile every graph variant (base model only, adapters, and adapters over segments where long steps take
        grouped LoRA) on throwaway sequences that write only to the null KV block: decodes and prefill chunks, so
        every dynamic dim is traced at a size >= 2."""
        t0 = time.perf_counter()
        if self._compiled and not self._warmed_up:
            max_tokens = self.config.max_num_batched_tokens
            lengths = [1, 1, 1, min(5, max_tokens // 4), min(7, max_tokens // 3)]
            # An adapter variant is one graph for any mix of slots: slot 1 (zeros or an adapter) beside base tokens.
            variants = [(lengths, [0, 0, 0, 0, 0]), (lengths, [1, 0, 1, 0, 1])]
            grouped_from = self.model.lora_grouped_from
            if grouped_from and grouped_from + 3 <= max_tokens:  # long prefill steps' grouped LoRA: a third graph
                # (a prompt holds at most max_seq_len tokens: a longer step is several prompts)
                long = [min(self.config.max_seq_len, grouped_from - done)
                        for done in range(0, grouped_from, self.config.max_seq_len)]
                if len(long) <= self.config.max_num_seqs:  # (else no step reaches grouped_from tokens)
                    variants.append(([1, 2, *long], [1, 0, *[1] * len(long)]))
            for lengths, slots in variants:
                seqs = []
                for i, (n, slot) in enumerate(zip(lengths, slots)):
                    seq = Sequence(-1 - i, list(range(1, n + 1)), SamplingParams(max_new_tokens=1))
                    seq.block_table, seq.lora_slot = [0] * -(-n // self.config.block_size), slot
                    seqs.append(seq)
                self.step(seqs)
            release_free_heap()  # (compiling's temporaries)
        self._warmed_up = True
        return time.perf_counter() - t0

    # --- offline use --------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        adapters: list[str | None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[list[int]]:
        """Generate for every prompt with continuous batching; returns each prompt's new token ids."""
        return [s.output_ids for s in self.generate_sequences(prompts, sampling, adapters, on_token)]

    def generate_sequences(
        self,
        prompts: list[list[int]] | list[str],
        sampling: SamplingParams | list[SamplingParams] = SamplingParams(),
        adapters: list[str | None] | None = None,
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[Sequence]:
        """generate(), returning each prompt's finished Sequence (log-probabilities, prompt log-probabilities)."""
        n = len(prompts)
        params = sampling if isinstance(sampling, list) else [sampling] * n
        names = adapters or [None] * n
        seqs = [
            Sequence(i, self.tokenizer.encode(p) if isinstance(p, str) else list(p), params[i], names[i])
            for i, p in enumerate(prompts)
        ]
        # Its own queue, admitted through the scheduler's primitives: a server's queue may share this engine (a
        # reference run between its steps), and this loop must neither run nor release that queue's sequences.
        waiting, running = deque(seqs), []
        try:
            while waiting or running:
                while waiting and self.try_admit(waiting[0]):  # (reads an adapter in this thread where needed)
                    running.append(waiting.popleft())
                if not running:
                    raise RuntimeError("no capacity to admit a sequence: check max_num_seqs / max_loras_per_batch / "
                                       "kv_cache_memory")
                out = self.step(running)
                if out.preempted:  # back to the front of the queue, oldest first
                    gone = set(out.preempted)
                    back = [q for q in running if q.seq_id in gone]
                    running = [q for q in running if q.seq_id not in gone]
                    waiting.extendleft(reversed(back))
                if on_token:
                    for seq_id, token in zip(out.seq_ids, out.token_ids):
                        on_token(seq_id, token)
                self.release_finished(running)
        finally:
            for seq in running:
                self.release(seq)
        return seqs

    def release_finished(self, running: list[Sequence]) -> None:
        """Release the finished sequences of `running` and drop them from it (a caller's own generate loop)."""
        for seq in [s for s in running if s.is_finished]:
            self.release(seq)
            running.remove(seq)
