"""RLOO fine-tuning for language models, with TRL's RLOOTrainer API."""

from rloo import deepspeed_lookup
from rloo.versions import check_installed

check_installed()
deepspeed_lookup.install()

__all__ = ["RLOOConfig", "RLOOTrainer"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """RLOOConfig and RLOOTrainer on first use (`from rloo import RLOOTrainer` as in TRL): importing
    a submodule (rloo.watchdog, rloo.tiny) does not pay for torch, transformers and peft."""
    if name == "RLOOConfig":
        from rloo.config import RLOOConfig

        return RLOOConfig
    if name == "RLOOTrainer":
        from rloo.trainer import RLOOTrainer

        return RLOOTrainer
    raise AttributeError(f"module 'rloo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
