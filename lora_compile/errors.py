"""Errors the engine raises; the service maps each to one gRPC status."""


class LoraCompileError(Exception):
    """Base class of all engine errors."""


class CheckpointError(LoraCompileError):
    """A model directory that cannot be served: missing file, tensor, wrong shape, unsupported architecture."""


class GrammarError(LoraCompileError, ValueError):
    """A structured output that cannot be served: it does not compile, is over a budget (structured_output.
    GrammarLimits), or failed in a step. The message says why, in our words (no engine internals)."""


class AdapterError(LoraCompileError):
    """An adapter that cannot be loaded; the message says what is wrong with it."""


class AdapterNotFoundError(LoraCompileError):
    """A request names an adapter that is not registered."""


class AdapterInUseError(LoraCompileError):
    """An adapter cannot be unloaded while running sequences use it."""


class AdapterPathError(AdapterError):
    """An adapter path outside the allowed root directories."""


class AdapterNameError(AdapterError):
    """An adapter name that cannot name a directory inside an adapter directory (checked before any file access)."""


class AdapterOutputError(AdapterError):
    """An adapter that loaded but produces non-finite values at run time (its weights overflow): requests for it
    are refused until its weights are fixed or replaced."""


class AdapterNotReadyError(LoraCompileError):
    """An adapter left host memory (evicted) between admission's check and its copy into a device slot: the
    server reads it on the loader threads, never in the engine thread."""


class AdapterMixError(LoraCompileError):
    """A weighted mix of adapters that cannot be served as asked (their ranks add up past --max-lora-rank, or a
    member is an activated or DoRA adapter): the request's own fault, not the adapters'."""
