"""RLOO fine-tuning for language models, with TRL's RLOOTrainer API."""

from rloo.config import RLOOConfig
from rloo.trainer import RLOOTrainer

__all__ = ["RLOOConfig", "RLOOTrainer"]
__version__ = "0.1.0"
