"""RLOO fine-tuning for language models, with TRL's RLOOTrainer API."""

from rloo.versions import check_installed

check_installed()

from rloo.config import RLOOConfig  # noqa: E402 (after the versions are known good)
from rloo.trainer import RLOOTrainer  # noqa: E402

__all__ = ["RLOOConfig", "RLOOTrainer"]
__version__ = "0.1.0"
