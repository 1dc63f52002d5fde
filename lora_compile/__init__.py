"""lora_compile: a batched multi-LoRA inference engine on torch.compile."""
from .config import EngineConfig, ModelConfig
from .engine import Engine
from .step_output import AdmitOutcome, StepOutput
from .sampling import SamplingParams
from .sequence import Sequence

__all__ = ["AdmitOutcome", "Engine", "EngineConfig", "ModelConfig", "SamplingParams", "Sequence", "StepOutput"]
