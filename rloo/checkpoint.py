"""What an RLOO checkpoint adds to a transformers one, when a checkpoint counts as complete, and
finding the newest complete one.

`checkpoint-N/rloo_state/rank<R>.pt` holds, per process, the micro-step counter and the buffered
generation batch (so a resumed run continues inside a generation exactly), the batch settings and
the model's identity (checked before any weight loads); `ref_model.pt` the moved reference of
sync_ref_model runs; `complete.json`, written last once every rank's files are on disk, lists each
file with its size: a checkpoint without it, or whose files no longer match it (a truncated weight
file, a missing state file), is skipped by every resume path."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import warnings

import torch

from rloo import faults
from rloo.rollout import Rollout
from rloo.zero import gathered_parameters

STATE_DIR = "rloo_state"
REFERENCE_FILE = "ref_model.pt"
MARKER = "complete.json"
CHECKPOINT = re.compile(r"checkpoint-[0-9]+")


class DiskFull(OSError):
    """A checkpoint save ran out of space; the partial checkpoint is gone, the previous complete one
    is intact."""


def _disk_full(err: BaseException, folder: str, needed: int) -> bool:
    """ENOSPC somewhere in the exception chain, or a failed write (torch.save and safetensors lose
    the errno) with less free space left than a checkpoint takes."""
    seen = err
    while seen is not None:
        if (
            isinstance(seen, OSError)
            and seen.errno in (errno.ENOSPC, errno.EDQUOT)
            or any(text in str(seen) for text in ("No space left", "StorageFull"))
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return shutil.disk_usage(
            folder if os.path.isdir(folder) else os.path.dirname(folder)
        ).free < max(needed, 1)
    except OSError:
        return False


def _size(folder: str) -> int:
    return sum(_files(folder).values()) if os.path.isdir(folder) else 0


def _remove_partial(folder: str, device_of: str) -> str:
    """Remove a save that ran out of space; says how much it had written and what is free now."""
    written = _size(folder)
    shutil.rmtree(folder, ignore_errors=True)
    free = shutil.disk_usage(device_of).free
    return f"{written / 2**20:.1f} MiB were written, {free / 2**20:.1f} MiB are free"


def atomic_save(obj, path: str) -> None:
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def marker_path(checkpoint: str) -> str:
    return os.path.join(checkpoint, STATE_DIR, MARKER)


def _files(checkpoint: str) -> dict[str, int]:
    found = {}
    for directory, _, names in os.walk(checkpoint):
        for name in names:
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, checkpoint)
            if relative != os.path.join(STATE_DIR, MARKER) and not name.endswith(".tmp"):
                found[relative] = os.path.getsize(path)
    return found


def problem(checkpoint: str) -> str | None:
    """Why a checkpoint cannot be resumed from (None: it is complete)."""
    try:
        with open(marker_path(checkpoint)) as handle:
            files = json.load(handle)["files"]
    except (OSError, ValueError, KeyError):
        return "no completion marker (its save was interrupted)"
    for relative, size in files.items():
        path = os.path.join(checkpoint, relative)
        if not os.path.exists(path):
            return f"{relative} is missing"
        if os.path.getsize(path) != size:
            return f"{relative} has {os.path.getsize(path)} bytes, {size} were written (truncated?)"
    return None


def is_complete(checkpoint: str) -> bool:
    return problem(checkpoint) is None


def save_complete(trainer, trial, save) -> None:
    """Run the Trainer's checkpoint save `save()` so that the checkpoint becomes complete only when
    every rank's files are written (the marker goes last), and save_total_limit's rotation runs only
    after that: whatever moment a save is interrupted at, the previous complete checkpoint is still
    there."""
    args = trainer.args
    run_dir = trainer._get_output_dir(trial=trial)
    folder = os.path.join(run_dir, f"checkpoint-{trainer.state.global_step}")
    if args.should_save and os.path.exists(marker_path(folder)):
        # a folder being written again is not complete until it is done
        os.remove(marker_path(folder))
    limit, args.save_total_limit = args.save_total_limit, None
    previous = latest_checkpoint(run_dir, quiet=True) if args.should_save else None
    try:
        save()
    except Exception as err:
        needed = max(_size(previous) if previous else 0, _size(folder))
        if not (args.should_save and _disk_full(err, folder, needed)):
            raise
        removed = _remove_partial(folder, run_dir)  # no half-written checkpoint is left behind
        raise DiskFull(
            errno.ENOSPC,
            f"no space left on the device of {run_dir} while saving {folder}: "
            f"{removed}, a checkpoint of this run takes "
            f"{'' if previous else 'more than '}{needed / 2**20:.1f} MiB"
            + (f" ({os.path.basename(previous)} is intact)" if previous else "")
            + ". Fix: free space (or lower save_total_limit), then resume.",
        ) from err
    finally:
        args.save_total_limit = limit
    trainer.accelerator.wait_for_everyone()
    if args.should_save:
        faults.point("before-marker")
        os.makedirs(os.path.join(folder, STATE_DIR), exist_ok=True)
        with open(marker_path(folder) + ".tmp", "w") as handle:
            json.dump({"files": _files(folder), "global_step": trainer.state.global_step}, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(marker_path(folder) + ".tmp", marker_path(folder))
        _rotate(trainer, run_dir, limit)


def _rotate(trainer, run_dir: str, limit: int | None) -> None:
    """save_total_limit's rotation of the run's checkpoints, the newest kept (transformers 5's
    function; 4.x has it as a Trainer method reading args.save_total_limit, which is `limit` again
    here)."""
    try:
        from transformers.trainer_utils import rotate_checkpoints
    except ImportError:
        trainer._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        return
    rotate_checkpoints(
        output_dir=run_dir,
        save_total_limit=limit,
        best_model_checkpoint=trainer.state.best_model_checkpoint,
        use_mtime=True,
    )


def save_final(trainer, output_dir: str) -> None:
    """`trainer.save_model` into a staging folder inside output_dir, then moved in file by file: the
    final model is never half-written over an earlier one. Out of space: the staging folder goes and
    DiskFull says so."""
    staging = os.path.join(output_dir, ".final-model.tmp")
    if trainer.args.should_save:
        shutil.rmtree(staging, ignore_errors=True)
    try:
        trainer.save_model(staging)
    except Exception as err:
        if not (trainer.args.should_save and _disk_full(err, staging, _size(staging))):
            raise
        raise DiskFull(
            errno.ENOSPC,
            f"no space left on the device of {output_dir} while saving the final model: "
            f"{_remove_partial(staging, output_dir)}. Fix: free space, then resume.",
        ) from err
    trainer.accelerator.wait_for_everyone()
    if trainer.args.should_save:
        for name in os.listdir(staging):
            target = os.path.join(output_dir, name)
            if os.path.isdir(target) and not os.path.islink(target):
                shutil.rmtree(target)
            os.replace(os.path.join(staging, name), target)
        os.rmdir(staging)


def checked_resume(trainer, value) -> str | None:
    """resume_from_checkpoint resolved (resolve_resume) and checked against this run
    (check_compatible), before any weight loads."""
    path = resolve_resume(value, trainer.args.output_dir)
    if path:
        state = read_state(path, trainer.accelerator.process_index)
        if state is not None:
            check_compatible(
                path,
                state,
                trainer.args.num_generations,
                trainer.args.generation_batch_size,
                trainer._model_identity,
            )
    return path


def finished_run(trainer, path: str):
    """When the checkpoint is already at max_steps (a run killed after its last step, before it
    exited), the run is over: transformers would train one step past max_steps; instead load the
    checkpoint's weights and state and return its TrainOutput. None when there is training left."""
    from transformers import TrainerState
    from transformers.trainer_utils import TrainOutput

    state = TrainerState.load_from_json(os.path.join(path, "trainer_state.json"))
    if trainer.args.max_steps <= 0 or state.global_step < trainer.args.max_steps:
        return None
    if trainer.is_deepspeed_enabled:
        raise ValueError(
            f"{path} is at step {state.global_step} = max_steps: that run had finished. Resuming a "
            "finished DeepSpeed run is not supported; its weights are in that checkpoint (raise "
            "max_steps to train on)."
        )
    warnings.warn(
        f"{path} is at step {state.global_step} = max_steps: the run had finished; its weights are "
        "loaded and nothing more is trained."
    )
    trainer._load_from_checkpoint(path)
    trainer.state = state
    losses = [log["loss"] for log in state.log_history if "loss" in log]
    return TrainOutput(state.global_step, sum(losses) / len(losses) if losses else 0.0, {})


def latest_checkpoint(output_dir: str, quiet: bool = False) -> str | None:
    """The newest complete `checkpoint-N` folder of output_dir, or None (also when output_dir
    does not exist); a newer incomplete one (a save that was killed) is skipped with a warning
    naming it."""
    if not os.path.isdir(output_dir):
        return None
    found = [
        name
        for name in os.listdir(output_dir)
        if CHECKPOINT.fullmatch(name) and os.path.isdir(os.path.join(output_dir, name))
    ]
    for name in sorted(found, key=lambda n: int(n.split("-")[1]), reverse=True):
        path = os.path.join(output_dir, name)
        why = problem(path)
        if why is None:
            return path
        if not quiet:
            warnings.warn(f"{path} cannot be resumed from: {why}; using the checkpoint before it.")
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
    return (
        torch.load(path, map_location="cpu", weights_only=False) if os.path.exists(path) else None
    )


def restore_state(trainer, checkpoint_dir: str) -> None:
    """After the weights: the moved reference of a sync_ref_model run, the micro-step counter and
    the buffered generation batch of this process (a resumed run continues inside a generation
    exactly)."""

    reference_file = reference_path(checkpoint_dir)
    if trainer.args.sync_ref_model and os.path.exists(reference_file):
        reference = trainer.accelerator.unwrap_model(trainer.ref_model)
        with gathered_parameters(reference, trainer._zero3, modifier_rank=0):
            if trainer.accelerator.is_main_process or not trainer._zero3:
                reference.load_state_dict(
                    torch.load(reference_file, map_location="cpu", weights_only=True)
                )
    state = read_state(checkpoint_dir, trainer.accelerator.process_index)
    if state is None:
        return
    trainer._step = state["step"]
    buffered = state["buffered_inputs"]
    if buffered and not isinstance(buffered[0], Rollout):
        raise ValueError(
            f"checkpoint {checkpoint_dir} holds a generation buffer in the format of an older rloo "
            "version (dicts, not Rollouts). Fix: resume it with the version that wrote it, or "
            "start a new run in another output_dir."
        )
    trainer._buffered_inputs = (
        None if buffered is None else [part.to(trainer.accelerator.device) for part in buffered]
    )
    # the backend's own: its request counter (seeds), a generation that was in flight
    trainer.generator.restore(state.get("generator"))


def check_compatible(
    checkpoint: str,
    state: dict,
    num_generations: int,
    generation_batch_size: int,
    model_identity: dict,
) -> None:
    """A checkpoint of another model or another group size is refused before any weight loads."""
    if state["num_generations"] != num_generations:
        raise ValueError(
            f"checkpoint {checkpoint} was trained with num_generations={state['num_generations']}, "
            f"this run has {num_generations}: the prompt groups would not line up. Fix: resume "
            "with the same num_generations, or start a new run in another output_dir."
        )
    saved = state.get("model")
    if saved is not None and (saved["class"], saved["shapes_digest"]) != (
        model_identity["class"],
        model_identity["shapes_digest"],
    ):
        raise ValueError(
            f"checkpoint {checkpoint} was trained from a different model ({saved['class']} "
            f"{saved['name_or_path']!r}, weights {saved['shapes_digest']}) than this run "
            f"({model_identity['class']} {model_identity['name_or_path']!r}, weights "
            f"{model_identity['shapes_digest']}). Fix: resume with the model the checkpoint was "
            "trained from, or start a new run in another output_dir."
        )
    if state["generation_batch_size"] != generation_batch_size:
        warnings.warn(
            f"checkpoint {checkpoint} used generation_batch_size={state['generation_batch_size']}, "
            f"this run uses {generation_batch_size}: the resumed run will not replay the same "
            "prompt order."
        )


def resolve_resume(value, output_dir: str, missing_ok: bool = False):
    """resume_from_checkpoint: True / 'latest' / 'true' -> the newest checkpoint (none there: an
    error, or None with missing_ok, as `rloo train` does so that a requeued job starts when nothing
    was saved yet), None / '' / 'none' / 'false' -> None, a path -> itself."""
    word = value.lower() if isinstance(value, str) else value
    if word in (None, False, "", "none", "false"):
        return None
    if word in (True, "latest", "true"):
        found = latest_checkpoint(output_dir)
        if found is None and not missing_ok:
            raise ValueError(
                f"resume_from_checkpoint=True but {output_dir} holds no checkpoint-N folder. Fix: "
                "start without resume_from_checkpoint, or point it at a checkpoint."
            )
        return found
    why = problem(value) if os.path.isdir(value) else "no such folder"
    if why is not None:
        raise ValueError(
            f"resume_from_checkpoint={value!r} cannot be resumed from: {why}. Fix: use 'latest' "
            "(the newest complete checkpoint) or another checkpoint."
        )
    return value


def load_renamed_weights(model: torch.nn.Module, checkpoint: str) -> bool:
    """Resume a full model whose checkpoint names its weights otherwise than the live model does:
    transformers saves vision-language models (Qwen2-VL, Gemma3, LLaVA-NeXT, ...) under their
    legacy names, and Trainer's resume loads with strict=False, so it would keep the initial
    weights with only a warning. Such a checkpoint is loaded through from_pretrained (which renames)
    and copied in. False where the plain load matches (then Trainer's own path runs)."""
    from safetensors import safe_open

    index, single = (
        os.path.join(checkpoint, name)
        for name in ("model.safetensors.index.json", "model.safetensors")
    )
    if os.path.exists(index):
        with open(index) as handle:
            keys = set(json.load(handle)["weight_map"])
    elif os.path.exists(single):
        with safe_open(single, "pt") as weights:
            keys = set(weights.keys())
    else:
        return False  # an adapter or a DeepSpeed checkpoint: Trainer's path
    if keys <= set(model.state_dict()):
        return False
    loaded = type(model).from_pretrained(checkpoint, dtype=next(model.parameters()).dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    return True
