"""Generation backends: each turns prompt token ids into completion token ids (rloo.generation.base)."""

from rloo.generation.base import Completions, GenerationBackend
from rloo.generation.continuous_batching import ContinuousBatchingGenerator
from rloo.generation.transformers_backend import TransformersGenerator

__all__ = ["Completions", "ContinuousBatchingGenerator", "GenerationBackend", "TransformersGenerator"]
