"""accelerate looks for a DeepSpeed engine without importing DeepSpeed into a run that has none.

accelerate's `extract_model_from_parallel` (every `unwrap_model`: transformers' Trainer calls it
as it starts and at each save, `save_pretrained` calls it for every model written) imports deepspeed
whenever it is installed, only to test `isinstance(model, DeepSpeedEngine)`: 2-3 s of CPU in every
process that trains or saves a model (deepspeed imports mlflow, among others). No model can be a
DeepSpeedEngine while deepspeed was never imported, so the lookup asks for the class only once it
was. `import rloo` installs this: it patches accelerate's module when that is first imported."""

from __future__ import annotations

import importlib.abc
import sys

TARGET = "accelerate.utils.other"


def patch(module) -> None:
    """Make `module.is_deepspeed_available` (accelerate.utils.other's) true only once deepspeed is
    loaded. Idempotent."""
    available = getattr(module, "is_deepspeed_available", None)
    if available is None or getattr(available, "rloo_loaded_only", False):
        return  # (an accelerate without this lookup: nothing to change)

    def loaded_and_available() -> bool:
        return "deepspeed" in sys.modules and available()

    loaded_and_available.rloo_loaded_only = True
    module.is_deepspeed_available = loaded_and_available


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds accelerate.utils.other with the other finders and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


def install() -> None:
    """Patch accelerate now if it is loaded, else when it is imported."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
