"""lora_compile: a batched multi-LoRA inference engine on torch.compile."""
from . import huge_pages

huge_pages.enable_by_default()  # before any engine allocates (huge_pages)

from .config import EngineConfig, ModelConfig
from .core.engine import Engine
from .core.step_output import AdmitOutcome, StepOutput
from .sample.sampling import SamplingParams
from .sequence import Sequence

__all__ = ["AdmitOutcome", "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "Sequence", "StepOutput"]
