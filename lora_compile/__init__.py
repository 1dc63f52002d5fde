"""lora_compile: a batched multi-LoRA inference engine on torch.compile."""
from . import huge_pages

huge_pages.enable_by_default()  # before any engine allocates (huge_pages)

from .config import EngineConfig, ModelConfig
from .engine import Engine
from .step_output import AdmitOutcome, StepOutput
from .sampling import SamplingParams
from .sequence import Sequence

__all__ = ["AdmitOutcome", "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "Sequence", "StepOutput"]
