"""The compiled layer stack saved to disk with its traced frame, so that a warm start runs no Dynamo at all.

With torch.compile alone every start traces the stack again (Dynamo: ~8 s of a ~14 s warm start on 2 cores),
even when the Inductor cache holds all the generated code. torch's ahead-of-time capture (`aot_compile`) saves
the traced frame, its guards and its compiled code in one file; loading both takes 2-5 s,
most of it importing Inductor's runtime, which a traced start pays too (docs/benchmarks.md).

- One file per graph variant (no adapter in the step / adapters), under a key of what shapes the graph: torch
  and Python, Inductor's settings, the thread count, the vector ISA of the CPU kernels, the engine's source
  (every module of lora_compile), the model config, and the name, shape, dtype, device and layout of every model
  tensor. Any change there compiles and saves anew. (The engine limits reach the graph only through tensor shapes: KV cache, LoRA slots.)
- The model is an argument of the saved function, not part of it: the file serves any instance with that key.
- Guards kept: the relations between the step's sizes (shape-env guards), checked on every call, plus the hidden
  states' dtype and width, checked here. Left out: guards on the model, which the key covers and which cannot be
  saved (oneDNN-packed weights, module attributes); the other tensor guards, which hold for every step the engine
  builds and do not survive a reload. A step that fails a check raises, as a recompile after warm-up does.
- The files are pickles, like the rest of the Inductor cache they live in: that directory must be trusted.
"""
from __future__ import annotations

import hashlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.forward_batch import ForwardBatch

log = logging.getLogger(__name__)

# A step without adapters / with adapters / with adapters over per-slot segments (ForwardBatch.flat_variant).
VARIANTS = ("base", "lora", "lora-grouped")


class RecompileError(RuntimeError):
    """A step whose shapes the compiled layer stack was not traced for."""


def artifact_key(model: torch.nn.Module) -> str:
    """Hash of what the traced stack depends on (see the module docstring)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    h = hashlib.sha256()
    h.update(f"{torch.__version__} {sys.version_info[:3]} {model.config!r} {model.lora_kernel} "
             f"{model.attention_backend} {model.prefill_backend} {model.weight_forms!r}".encode())
    # What Inductor's own cache keys on besides the graph: its settings, threads (OpenMP team sizes are written
    # into the generated code), deterministic algorithms.
    h.update(repr(sorted(inductor_config.save_config_portable().items())).encode())
    h.update(f"{torch.get_num_threads()} {torch.are_deterministic_algorithms_enabled()}".encode())
    # The vector ISA the CPU kernels are written for (loop steps are its lane counts), which Inductor also compiles
    # them for when they load: a stack saved under AVX-512 and reloaded under AVX2 (another CPU sharing the
    # directory, or ATEN_CPU_CAPABILITY) gave NaN logits, half of every vector loop skipped.
    h.update(str(pick_vec_isa()).encode())
    package = Path(__file__).resolve().parents[1]  # the whole engine: the model's code lives in sub-packages
    for source in sorted(package.rglob("*.py")):
        h.update(str(source.relative_to(package)).encode() + source.read_bytes())
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        # the device with its index: generated GPU code names it
        h.update(f"{name} {tuple(t.shape)} {t.dtype} {t.device} {t.layout};".encode())
    if torch.cuda.is_available():
        h.update(torch.cuda.get_device_name().encode())
    return h.hexdigest()[:20]


def _portable_guards(entries) -> list[bool]:
    """Which guards a saved stack keeps (module docstring)."""
    return [e.guard_type == "SHAPE_ENV" for e in entries]


class PrecompiledStack:
    """The model's layer stack, `layer_stack(model, h, *batch)`, loaded from or compiled into `directory`.

    Each variant is loaded or compiled on its first call (the engine's warm-up); later calls run the saved
    function, behind its guards only."""

    def __init__(self, model: torch.nn.Module, layer_stack: Callable, mark_dynamic: Callable, directory: Path,
                 inductor_options: dict | None = None):
        self.model, self._layer_stack, self._mark_dynamic = model, layer_stack, mark_dynamic
        self.directory = directory
        self._options = {"guard_filter_fn": _portable_guards, **(inductor_options or {})}  # (compile_policy's)
        self.key = artifact_key(model)
        self._dtype, self._width = model.dtype, (model.config.hidden_size,)
        self._fns: dict[str, Callable] = {}
        self.sources: dict[str, str] = {}  # variant -> "loaded" or "compiled", for logs and tests

    def path(self, variant: str) -> Path:
        return self.directory / f"{self.key}-{variant}.bin"

    def __call__(self, h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        if h.dtype != self._dtype or h.shape[1:] != self._width:
            raise RecompileError(f"the compiled layer stack takes hidden states of {self._dtype} and width "
                                 f"{tuple(self._width)}; this step has {h.dtype} and {tuple(h.shape[1:])} "
                                 "(would recompile)")
        batch = fb.flat()
        variant = VARIANTS[ForwardBatch.flat_variant(batch)]
        fn = self._fns.get(variant) or self._load_or_compile(variant, h, fb)
        try:
            return fn(self.model, h, *batch)
        except RuntimeError as e:
            if str(e).startswith("GuardManager check failed"):
                raise RecompileError(f"the compiled layer stack ({variant}) would recompile for this step: {e}") from e
            raise

    def _load_or_compile(self, variant: str, h: torch.Tensor, fb: ForwardBatch) -> Callable:
        path = self.path(variant)
        fn = self._load(path)
        if fn is not None:
            self.sources[variant] = "loaded"
        else:
            # (a copy: torch.compile takes guard_filter_fn out of the dict it is given)
            compiled = torch.compile(self._layer_stack, fullgraph=True, options=dict(self._options))
            self._mark_dynamic(h, fb)  # for the trace only: the saved guards check sizes, not marks
            try:
                fn = compiled.aot_compile(((self.model, h, *fb.flat()), {}))
            except Exception as e:
                raise RuntimeError(f"compiling the layer stack ahead of time failed ({type(e).__name__}: {e}); "
                                   "precompile=False (--no-precompile) leaves it to torch.compile at every start") from e
            self.sources[variant] = "compiled"
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
                fn.save_compiled_function(str(path))  # written to a temporary file, then renamed
                path.chmod(0o644)  # the temporary file was private; a service may run as another user
            except Exception:  # serve anyway; the next start compiles again
                log.warning("could not save the compiled layer stack to %s", path, exc_info=True)
        log.info("layer stack (%s): %s %s", variant, self.sources[variant], path)
        self._fns[variant] = fn
        return fn

    def _load(self, path: Path) -> Callable | None:
        if not path.exists():
            return None
        try:
            with open(path, "rb") as f:  # in the globals it was traced in, as at save time
                return torch.compiler.load_compiled_function(f, f_globals=self._layer_stack.__globals__)
        except Exception:  # a file from an interrupted write or another build: compile anew, overwrite it
            log.warning("could not load the compiled layer stack %s; compiling it again", path, exc_info=True)
            return None


def stacks_directory(inductor_cache_dir: Path) -> Path:
    """Inside the Inductor cache directory, kept and trusted alike."""
    return inductor_cache_dir / "lora-serve-stacks"
