"""Decode steps replayed from CUDA graphs (vLLM's and SGLang's CudaGraphRunner, around our compiled layer stack).

A decode step on a GPU is a few hundred small kernels; launching them from Python costs more than running them at
small batches. A graph records the launches of one step shape once and replays them in one call.

- One graph per (variant, rows, keys): the variant is the compiled stack's (no adapter / adapters), `rows` the
  decoding sequences padded up to a batch bucket, `keys` the keys each reads padded up to a key bucket. Padding
  rows decode token 0 at position 0 into the null KV block and are never sampled; padding keys are masked.
- Captured on first use, after warm-up, in one memory pool shared by all graphs (replays never overlap).
- Static inputs by construction: a padded decode step lays its metadata out at the same offsets of the engine's
  one metadata buffer every time (batch_init), the KV cache, weights and LoRA slots are buffers updated
  in place, so a new adapter mix or a newly loaded adapter replays the same graph. The addresses are checked at
  every replay: a mismatch is a bug, raised, never a silent re-capture.
- Prefill and mixed steps run without graphs (their shapes vary with the chunk lengths).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

MIN_KEYS = 64       # smallest key bucket
KEY_STEP = 256      # above it, key buckets step by this much (powers of two below): at most ~25 % padding there


def batch_buckets(max_batch_size: int) -> tuple[int, ...]:
    """Decode batch sizes a graph is captured for: 1, 2, 4, 8, then every 8 (vLLM's), and max_batch_size."""
    sizes = {b for b in (1, 2, 4) if b < max_batch_size} | set(range(8, max_batch_size, 8)) | {max_batch_size}
    return tuple(sorted(sizes))


def key_bucket(keys: int, max_seq_len: int) -> int:
    """Keys a decode graph reads for a step whose longest sequence needs `keys`: powers of two from MIN_KEYS up to
    KEY_STEP, then multiples of KEY_STEP, never past max_seq_len."""
    bucket = MIN_KEYS
    while bucket < min(keys, KEY_STEP):
        bucket *= 2
    if keys > bucket:
        bucket = -(-keys // KEY_STEP) * KEY_STEP
    return min(bucket, max_seq_len)


@dataclass(frozen=True)
class GraphShape:
    rows: int  # decoding sequences, padded
    keys: int  # keys read per sequence, padded


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph | None
    output: torch.Tensor | None
    addresses: tuple[int, ...]


class DecodeGraphs:
    """The captured decode graphs of one engine. `capture=False` runs the padded step without recording it (what
    a graph replays, on any device: the CPU tests of the padded layout)."""

    def __init__(self, max_batch_size: int, max_seq_len: int, device: torch.device, capture: bool = True):
        self.batch_sizes = batch_buckets(max_batch_size)
        self.max_seq_len = max_seq_len
        self.capture = capture
        self._graphs: dict[tuple[bool, GraphShape], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._stream = torch.cuda.Stream(device) if capture else None
        self.replays = 0  # steps served from a graph

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def shape(self, n_decode: int, longest: int) -> GraphShape:
        """The padded shape of a decode step of `n_decode` sequences whose longest reads `longest` keys."""
        rows = next(b for b in self.batch_sizes if b >= n_decode)
        return GraphShape(rows, key_bucket(longest, self.max_seq_len))

    def run(self, lora: bool, shape: GraphShape, addresses: tuple[int, ...],
            body: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The hidden states `body()` computes, from the graph of (lora, shape): captured now on its first use.
        `addresses`: the data pointers of the step's inputs, which must be the captured ones."""
        key = (lora, shape)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._graphs[key] = self._capture(body, addresses)
            log.info("captured the decode CUDA graph for %s%s (%d graphs)", shape, " with adapters" if lora else "",
                     len(self._graphs))
        elif captured.addresses != addresses:
            raise RuntimeError(f"decode graph {key}: the step's inputs moved since capture ({captured.addresses} -> "
                               f"{addresses}); a padded decode step must lay its metadata out identically")
        self.replays += 1
        if captured.graph is None:
            return body()
        captured.graph.replay()
        return captured.output

    def _capture(self, body: Callable[[], torch.Tensor], addresses: tuple[int, ...]) -> _Captured:
        if not self.capture:
            return _Captured(None, None, addresses)
        stream, current = self._stream, torch.cuda.current_stream()
        # One run first, on the capture stream: kernels autotune and compile for new sizes outside the capture.
        # It computes what the replay will (the same K/V writes), so running both is harmless.
        stream.wait_stream(current)
        with torch.cuda.stream(stream):
            body()
        current.wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: adapter loader threads may pin host memory meanwhile, which a global capture forbids.
        with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
            output = body()
        return _Captured(graph, output, addresses)
