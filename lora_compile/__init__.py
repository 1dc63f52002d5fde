"""lora_compile: a batched multi-LoRA inference engine on torch.compile."""
from .config import EngineConfig, ModelConfig
from .engine import Engine, StepOutput
from .sampling import SamplingParams
from .sequence import Sequence

__all__ = ["Engine", "EngineConfig", "ModelConfig", "SamplingParams", "Sequence", "StepOutput"]
