"""Which demo a server with no --model serves: SmolLM2-135M-Instruct with two trained adapters (the default), or
the random-weights model written locally (offline use and tests; gibberish by design)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)
DEMOS = ("smollm2", "random")


@dataclass(frozen=True)
class Demo:
    model: str                  # a GGUF file or a model directory
    adapters: dict[str, str]    # name -> adapter directory
    served_name: str | None     # the model's name in /v1/models (None: the engine's default)
    description: str


def prepare_demo(kind: str = "smollm2") -> Demo:
    """The demo's files, fetched or written on first use. SmolLM2 falls back to the random demo (with an error
    logged saying why) when it cannot be fetched."""
    if kind not in DEMOS:
        raise ValueError(f"demo must be one of {', '.join(DEMOS)}, got {kind!r}")
    if kind == "smollm2":
        from .smollm2 import SERVED_NAME, demo_adapters, fetch_smollm2

        path = fetch_smollm2()
        if path is not None:
            return Demo(str(path), demo_adapters(), SERVED_NAME,
                        "SmolLM2-135M-Instruct (Apache-2.0; Q4_1 GGUF, dequantised at load) with adapters "
                        f"{', '.join(demo_adapters())}")
        log.error("SmolLM2 could not be fetched (above): serving the random demo instead (gibberish output); "
                  "--demo random chooses it outright")
    from . import write_demo_adapters, write_demo_checkpoint

    model = write_demo_checkpoint()
    adapters = {name: str(path) for name, path in write_demo_adapters().items()}
    return Demo(str(model), adapters, None,
                f"the random demo model (random weights: gibberish output) with adapters {', '.join(adapters)}")
