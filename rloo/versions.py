"""The library versions rloo runs on: each dependency checked against the installed package's own
ranges at import (a clear error naming the version and the fix, not an obscure one mid-training),
and the differences between supported transformers releases that the code has to ask about."""

from __future__ import annotations

import importlib.metadata
import os

from packaging.requirements import Requirement
from packaging.version import Version

# From the installed package's metadata, not `import transformers`: `import rloo` (this check) stays
# cheap for the processes that use none of the trainer (a job's launcher, the pipeline's CLI).
TRANSFORMERS = Version(importlib.metadata.version("transformers"))
# transformers 4.x: the releases TRL 1.16 still supports (>= 4.56.2)
TRANSFORMERS_4 = TRANSFORMERS.major < 5

PRECISION = "ACCELERATE_MIXED_PRECISION"
# What the launcher (`accelerate launch --mixed_precision ...`) set before any config was made.
LAUNCHER_PRECISION = os.environ.get(PRECISION)


def check_installed(distribution: str = "rloo") -> None:
    """Every dependency of the installed `distribution` (extras aside) within its range; nothing to
    check where rloo runs from a checkout without being installed."""
    try:
        requirements = importlib.metadata.requires(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return
    for line in requirements:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            continue  # (pip installs them; a missing one fails at its own import, by name)
        if not requirement.specifier.contains(Version(installed).base_version, prereleases=True):
            raise ImportError(
                f"{distribution} needs {requirement.name}{requirement.specifier}; "
                f"{requirement.name} {installed} is installed. Fix: pip install "
                f"'{requirement.name}{requirement.specifier}'."
            )


def precision_environment(args) -> None:
    """transformers 4.x hands the mixed precision to accelerate through the process environment
    (TrainingArguments writes ACCELERATE_MIXED_PRECISION, and every later config and Accelerator
    reads it back): a second config in the same process, bf16=False, trained in the first's bf16.
    Each config and trainer sets it from its own flags, over the launcher's value. transformers 5
    passes the precision to accelerate itself: nothing to do."""
    if not TRANSFORMERS_4:
        return
    value = "fp16" if args.fp16 else "bf16" if args.bf16 else LAUNCHER_PRECISION
    if value is None:
        os.environ.pop(PRECISION, None)
    else:
        os.environ[PRECISION] = value
