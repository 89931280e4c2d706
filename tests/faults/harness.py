"""Real `rloo train` processes on a tiny model (CPU, fixed seed), killed with SIGKILL at a named point or after a
random delay, resumed with `--resume_from_checkpoint latest`, compared with the uninterrupted run: the final
weights and the logged reward of every step, each step exactly once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from services import free_port  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.dirname(os.path.abspath(__file__))
MAX_STEPS = 6
RECIPE = {
    "model_name_or_path": "tiny",
    "dataset_name": os.path.join(ROOT, "data", "arithmetic.jsonl"),
    "reward_funcs": ["points:position_reward"],
    "callbacks": ["points:KillPoints"],
    "use_cpu": True,
    "bf16": False,
    "max_steps": MAX_STEPS,
    "per_device_train_batch_size": 4,
    "num_generations": 2,
    "max_completion_length": 6,
    "learning_rate": 0.05,
    "logging_steps": 1,
    "save_strategy": "steps",
    "save_steps": 1,
    "save_total_limit": 2,
    "report_to": "none",
    "disable_tqdm": True,
    "beta": 0.0,
    "seed": 0,
}


def write_recipe(folder: str, nproc: int, **changes) -> str:
    path = os.path.join(folder, f"recipe-{nproc}.yaml")
    with open(path, "w") as handle:
        yaml.safe_dump({**RECIPE, **changes}, handle)
    return path


def command(recipe: str, output_dir: str, nproc: int) -> list[str]:
    train = [
        "-m",
        "rloo",
        "train",
        "--config",
        recipe,
        "--output_dir",
        output_dir,
        "--resume_from_checkpoint",
        "latest",
    ]
    if nproc == 1:
        return [sys.executable, *train]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        *train,
    ]


def environment(extra: dict | None = None, **kill) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("RLOO_TEST_KILL_", "RLOO_TEST_REWARD_"))
    }
    env.update(extra or {})
    env.update({f"RLOO_TEST_KILL_{key.upper()}": str(value) for key, value in kill.items()})
    env["PYTHONPATH"] = os.pathsep.join([HERE, ROOT, env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(
    recipe: str,
    output_dir: str,
    nproc: int = 1,
    kill_after_s: float | None = None,
    timeout_s: float = 300,
    env: dict | None = None,
    **kill,
) -> subprocess.CompletedProcess:
    """One `rloo train` (a kill point in `kill`, or SIGKILL to the whole process group after `kill_after_s`; `env`:
    more variables, e.g. points.py's RLOO_TEST_REWARD_RAISES_AT)."""
    process = start(recipe, output_dir, nproc, env, **kill)
    if kill_after_s is not None:
        try:
            process.wait(timeout=kill_after_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
    output, _ = process.communicate(timeout=timeout_s)
    _reap(process)
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def start(
    recipe: str,
    output_dir: str,
    nproc: int = 1,
    env: dict | None = None,
    log: str | None = None,
    **kill,
) -> subprocess.Popen:
    """`rloo train` started in its own process group, its output in a pipe, or in the file `log` for a run whose
    output may outgrow a pipe's buffer before anyone reads it (a full pipe would stop the run)."""
    output = open(log, "w") if log else subprocess.PIPE
    return subprocess.Popen(
        command(recipe, output_dir, nproc),
        cwd=ROOT,
        env=environment(env, **kill),
        stdout=output,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _reap(process) -> None:
    """Nothing of a killed run lingers (torchrun workers whose agent was killed): the group is killed too."""
    try:
        os.killpg(process.pid, 9)
    except ProcessLookupError:
        pass
    time.sleep(0.2)


def final_weights(output_dir: str) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(output_dir, "model.safetensors"))


def reward_history(output_dir: str) -> list[tuple[int, float]]:
    """(step, reward) of every logged step, from the newest complete checkpoint's trainer state."""
    from rloo.checkpoint import latest_checkpoint

    with open(os.path.join(latest_checkpoint(output_dir), "trainer_state.json")) as handle:
        logs = json.load(handle)["log_history"]
    return [(log["step"], log["reward"]) for log in logs if "reward" in log]


def assert_same_as_reference(output_dir: str, reference: tuple) -> None:
    """The same final weights as the uninterrupted run, and its reward at every step, each step logged once."""
    import pytest
    import torch

    weights, history = reference
    got = final_weights(output_dir)
    assert got.keys() == weights.keys()
    for key in weights:
        assert torch.allclose(got[key], weights[key], atol=1e-6), key
    steps = [step for step, _ in reward_history(output_dir)]
    assert steps == list(range(1, MAX_STEPS + 1))  # none missing, none doubled
    assert [r for _, r in reward_history(output_dir)] == pytest.approx([r for _, r in history])
