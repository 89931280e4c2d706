"""What an RLOO checkpoint adds to a transformers one, and finding the newest checkpoint.

`checkpoint-N/rloo_state/rank<R>.pt` holds, per process, the micro-step counter and the buffered generation batch
(so a resumed run continues inside a generation exactly), the batch settings and the model's identity (checked
before any weight loads); `ref_model.pt` the moved reference of sync_ref_model runs."""

from __future__ import annotations

import json
import os
import re
import warnings

import torch

STATE_DIR = "rloo_state"
REFERENCE_FILE = "ref_model.pt"
CHECKPOINT = re.compile(r"checkpoint-[0-9]+")


def atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def is_complete(checkpoint: str) -> bool:
    """transformers writes trainer_state.json last (after weights, optimizer, RNG and rloo state): a checkpoint
    whose trainer_state.json is missing or unreadable was interrupted while being saved."""
    try:
        with open(os.path.join(checkpoint, "trainer_state.json")) as handle:
            json.load(handle)
        return True
    except (OSError, ValueError):
        return False


def latest_checkpoint(output_dir: str) -> str | None:
    """The newest complete `checkpoint-N` folder of output_dir, or None (also when output_dir does not exist); a
    newer incomplete one (a save that was killed) is skipped with a warning naming it."""
    if not os.path.isdir(output_dir):
        return None
    found = [name for name in os.listdir(output_dir) if CHECKPOINT.fullmatch(name)
             and os.path.isdir(os.path.join(output_dir, name))]
    for name in sorted(found, key=lambda n: int(n.split("-")[1]), reverse=True):
        path = os.path.join(output_dir, name)
        if is_complete(path):
            return path
        warnings.warn(f"{path} is incomplete (no readable trainer_state.json: its save was interrupted); resuming "
                      "from the checkpoint before it.")
    return None


def state_path(checkpoint: str, process_index: int) -> str:
    return os.path.join(checkpoint, STATE_DIR, f"rank{process_index}.pt")


def reference_path(checkpoint: str) -> str:
    return os.path.join(checkpoint, STATE_DIR, REFERENCE_FILE)


def save_state(checkpoint: str, process_index: int, state: dict) -> None:
    os.makedirs(os.path.join(checkpoint, STATE_DIR), exist_ok=True)
    atomic_save(state, state_path(checkpoint, process_index))


def read_state(checkpoint: str, process_index: int) -> dict | None:
    path = state_path(checkpoint, process_index)
    return torch.load(path, map_location="cpu", weights_only=False) if os.path.exists(path) else None


def check_compatible(checkpoint: str, state: dict, num_generations: int, generation_batch_size: int,
                     model_identity: dict) -> None:
    """A checkpoint of another model or another group size is refused before any weight loads."""
    if state["num_generations"] != num_generations:
        raise ValueError(f"checkpoint {checkpoint} was trained with num_generations={state['num_generations']}, "
                         f"this run has {num_generations}: the prompt groups would not line up. "
                         "Fix: resume with the same num_generations, or start a new run in another output_dir.")
    saved = state.get("model")
    if saved is not None and (saved["class"], saved["shapes_digest"]) != (model_identity["class"],
                                                                          model_identity["shapes_digest"]):
        raise ValueError(f"checkpoint {checkpoint} was trained from a different model ({saved['class']} "
                         f"{saved['name_or_path']!r}, weights {saved['shapes_digest']}) than this run "
                         f"({model_identity['class']} {model_identity['name_or_path']!r}, weights "
                         f"{model_identity['shapes_digest']}). Fix: resume with the model the checkpoint was trained "
                         "from, or start a new run in another output_dir.")
    if state["generation_batch_size"] != generation_batch_size:
        warnings.warn(f"checkpoint {checkpoint} used generation_batch_size={state['generation_batch_size']}, "
                      f"this run uses {generation_batch_size}: the resumed run will not replay the same prompt "
                      "order.")


def resolve_resume(value, output_dir: str, missing_ok: bool = False):
    """resume_from_checkpoint: True / 'latest' / 'true' -> the newest checkpoint (none there: an error, or None
    with missing_ok, as `rloo train` does so that a requeued job starts when nothing was saved yet),
    None / '' / 'none' / 'false' -> None, a path -> itself."""
    word = value.lower() if isinstance(value, str) else value
    if word in (None, False, "", "none", "false"):
        return None
    if word in (True, "latest", "true"):
        found = latest_checkpoint(output_dir)
        if found is None and not missing_ok:
            raise ValueError(f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-N folder. Fix: start "
                             "without resume_from_checkpoint, or point it at a checkpoint.")
        return found
    return value
